"""Commands on the fleet: the sidecars that share one state database and their jobs, read from
that database (no sidecar needs to answer, so a dead one shows as dead, not as an error), and
the fleet priors a job gets, with the past jobs they come from."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Column, Table

from seedancectl._config import load_config
from seedancectl.cli._app import ConfigOption, JsonFlag, fleet_app, print_json, stdout
from seedancectl.cli._local import StateDbOption, state_db_errors, state_db_url

if TYPE_CHECKING:
    from dashboards import FleetJobView


@fleet_app.command("status")
def fleet_status(config: ConfigOption = None, state_db: StateDbOption = None,
                 json_out: JsonFlag = False) -> None:
    """Every job across the sidecars: owner and whether it is alive, kind, kept config, the
    gain kept since the first baseline, open findings, changes waiting for a person."""
    from dashboards import fleet_view

    url = state_db_url(config, state_db)
    heartbeat_s = load_config(config).fleet_heartbeat_s
    with state_db_errors(url):
        view = fleet_view(url, heartbeat_s=heartbeat_s)
    if json_out:
        print_json(view.to_json())
        return
    if not view.jobs:
        stdout.print(f"no jobs in the fleet of {url}")
        return
    table = Table("job", "kind", Column("owner", overflow="fold"), "alive",
                  Column("kept config", overflow="fold"), "gain kept", "open findings",
                  Column("waiting for a person", overflow="fold"))
    for job in view.jobs:
        table.add_row(job.fleet.job, job.fleet.kind, _owner(job), _alive(job, view.at_s),
                      _kept(job), _gain(job), _findings(job),
                      "\n".join(f"{c.id} {_values(c.values)}" for c in job.waiting) or "-")
    stdout.print(table)
    alive = sum(s.alive for s in view.sidecars)
    stdout.print(f"{len(view.jobs)} jobs on {len(view.sidecars)} sidecars ({alive} alive; a "
                 f"sidecar silent for {view.stale_after_s:g} s counts as down)")


def _owner(job: FleetJobView) -> str:
    owner = job.fleet.owner
    return job.fleet.owner_id + ("" if owner is None else f"\n{owner.url}")


def _alive(job: FleetJobView, now_s: float) -> str:
    owner = job.fleet.owner
    if owner is None:
        return "[red]gone[/]"
    if job.owner_alive:
        return "[green]yes[/]"
    return f"[red]down[/] ({now_s - owner.heartbeat_at:.0f} s)"


def _kept(job: FleetJobView) -> str:
    baseline = job.fleet.baseline
    if baseline is None:
        return "-"
    return f"v{baseline.version}: {_values(baseline.values)}"


def _gain(job: FleetJobView) -> str:
    if job.kept_gain is None:
        return "-"
    return f"{job.kept_gain:+.1%} ({len(job.kept)} kept)"


def _findings(job: FleetJobView) -> str:
    return "\n".join(f"{f.detector} ({f.severity})" for f in job.findings) or "-"


def _values(values: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(values.items()))


@fleet_app.command("priors")
def fleet_priors(
    job: Annotated[str, typer.Argument(help="The job whose fleet priors to show.")],
    config: ConfigOption = None,
    state_db: StateDbOption = None,
    json_out: JsonFlag = False,
) -> None:
    """The configs measured best on the past jobs nearest to JOB, which its search tries
    first: each source job, its distance, the config (the one it kept, a faster one it
    rolled back as a tie, or for a job twice its size or more the kept one at half the
    micro-batch) and its measured gain, and how the trial of it went on JOB (if it ran)."""
    from tuner import ChangeJournal, FleetJobs, FleetPriors, lead_kind

    url = state_db_url(config, state_db)
    with state_db_errors(url):
        jobs, journal = FleetJobs(url, create=False), ChangeJournal(url, create=False)
        try:
            priors = FleetPriors(jobs, journal)
            fingerprint = priors.fingerprint(job)
            sources = priors.sources(job, fingerprint)
            tried = {str(c.meta.get("origin", "")): c
                     for c in journal.changes(job=job) if c.source == "trial"}
        finally:
            jobs.close()
            journal.close()
    rows: list[dict[str, Any]] = []
    for source in sources:
        for why, values, gain in source.leads():
            change = tried.get(why)
            rows.append({"job": source.job, "distance": round(source.distance, 4),
                         "values": dict(values), "gain": gain, "why": why,
                         "lead": lead_kind(why), "kept_there": values == source.values,
                         "changes": list(source.changes),
                         "trial": None if change is None else {
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
    table = Table("source job", "distance", Column("config", overflow="fold"), "there",
                  "gain there", "trial here")
    for row in rows:
        trial = row["trial"]
        table.add_row(row["job"], f"{row['distance']:.2f}",
                      ", ".join(f"{k}={v}" for k, v in row["values"].items()),
                      row["lead"],
                      "-" if row["gain"] is None else f"{row['gain']:+.1%}",
                      "not yet" if trial is None else f"{trial['change']} {trial['state']}")
    stdout.print(table)
