"""Commands on the fleet's state database (the jobs of every sidecar sharing it): the fleet
priors a job gets, with the past jobs they come from."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from seedancectl.cli._app import (
    ConfigOption,
    JsonFlag,
    StateDbOption,
    fleet_app,
    print_json,
    state_database,
    stdout,
)


@fleet_app.command("priors")
def fleet_priors(
    job: Annotated[str, typer.Argument(help="The job whose fleet priors to show.")],
    config: ConfigOption = None,
    state_db: StateDbOption = None,
    json_out: JsonFlag = False,
) -> None:
    """The configs kept by the past jobs nearest to JOB, which its search tries first: each
    source job, its distance, the knobs it kept and its measured gain, and how the trial of
    it went on JOB (if it ran)."""
    from tuner import ChangeJournal, FleetJobs, FleetPriors, fleet_source_of

    with state_database(config, state_db) as url:
        jobs, journal = FleetJobs(url, create=False), ChangeJournal(url, create=False)
        try:
            priors = FleetPriors(jobs, journal)
            fingerprint = priors.fingerprint(job)
            sources = priors.sources(job, fingerprint)
            tried = {fleet_source_of(str(c.meta.get("origin", ""))): c
                     for c in journal.changes(job=job) if c.source == "trial"}
        finally:
            jobs.close()
            journal.close()
    rows: list[dict[str, Any]] = []
    for source in sources:
        change = tried.get(source.job)
        rows.append({**source.to_json(), "trial": None if change is None else {
            "change": change.id, "state": change.state,
            "gain": (change.comparison or {}).get("gain")}})
    if json_out:
        print_json({"job": job, "fingerprint": fingerprint.to_json(), "priors": rows})
        return
    stdout.print(f"job {job}: {fingerprint.params:,} parameters on {fingerprint.device}, "
                 f"world size {fingerprint.world_size}", markup=False, highlight=False)
    if not rows:
        stdout.print("no fleet priors: no near past job kept a config")
        return
    table = Table("source job", "distance", "kept", "gain there", "trial here")
    for row in rows:
        trial = row["trial"]
        table.add_row(row["job"], f"{row['distance']:.2f}",
                      ", ".join(f"{k}={v}" for k, v in row["values"].items()),
                      "-" if row["gain"] is None else f"{row['gain']:+.1%}",
                      "not yet" if trial is None else f"{trial['change']} {trial['state']}")
    stdout.print(table)
