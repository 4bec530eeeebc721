"""Fleet priors through the sidecar: a real torch job (a small MLP of ``workloads.families``)
attaches to a real sidecar (uvicorn on 127.0.0.1) with its fingerprint; the sidecar writes it
to the fleet's table of its real SQLite state database, and the job's search proposes first
the config a past job with the same fingerprint kept there. ``seedancectl fleet priors``
shows it, with its source and how the trial went."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert
from typer.testing import CliRunner, Result

from collectors import JobFingerprint, sqlite_url, state_engine
from collectors.torch_fingerprint import job_fingerprint
from seedancectl.cli import app
from tests.seedancectl._live import KNOBS, live_sidecar
from tuner import Change, ChangeJournal, FleetJobs
from tuner._fleet_tables import jobs_table
from tuner.job import attach
from workloads.families import family
from workloads.train_family import train_step

PAST, NEW = "mlp-past", "mlp-new"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def kept(job: str, n: int, baseline: dict[str, Any], values: dict[str, Any],
         gain: float) -> Change:
    """A kept change as the controller journals it."""
    return Change(id=f"{job}-{n}", job=job, state="kept", source="trial", reason="trial",
                  risk="low", scope="live", values=values, baseline=baseline,
                  created_at_s=float(n), expires_at_s=float(n), comparison={"gain": gain})


def past_job(url: str, fingerprint: JobFingerprint, kept_values: list[dict[str, Any]],
             *, job: str = PAST) -> None:
    """A job another sidecar tuned in this state database: its fingerprint and kept changes."""
    jobs, journal = FleetJobs(url), ChangeJournal(url)
    jobs.record_fingerprint(job, fingerprint, kind="train", sidecar_id="other:4318",
                            study=f"seedance:{job}")
    baseline = {"micro_batch": 32, "threads": 2}
    for n, values in enumerate(kept_values):
        journal.add(kept(job, n, baseline, values, 0.25), actor="optuna", reason="r",
                    version_before=None, detail={})
        baseline = {**baseline, **values}
    jobs.close()
    journal.close()


@pytest.fixture
def mlp_fingerprint() -> JobFingerprint:
    """The tiny MLP's fingerprint as a job on this machine measures it (same model, same
    device, its measured fast precisions)."""
    return job_fingerprint(family("mlp").build(seed=1, tiny=True).model)


@pytest.mark.integration
def test_attach_records_the_fingerprint_and_the_search_tries_the_fleet_prior_first(
        tmp_path: Path, mlp_fingerprint: JobFingerprint) -> None:
    url = sqlite_url(tmp_path / "state.db")
    past_job(url, mlp_fingerprint, [{"micro_batch": 64}, {"micro_batch": 128}])
    with live_sidecar(tmp_path, jobs={NEW: {"tune": True, "knobs": ["micro_batch"]}},
                      tuning_start_after_s=0) as live:
        built = family("mlp").build(tiny=True)
        session = attach(built.model, built.optimizer, job=NEW, sidecar=live.url,
                         global_batch=built.global_batch, micro_batch=32)
        try:
            deadline = time.monotonic() + 60
            while not live.get("/v1/changes", job=NEW):
                assert time.monotonic() < deadline, "the search proposed nothing"
                train_step(built, session)
            first = live.get("/v1/changes", job=NEW)[0]
            (shown,) = [j for j in live.get("/v1/jobs") if j["job"] == NEW]
        finally:
            session.close()
    sent = job_fingerprint(built.model, speedups=session.speedups)
    assert JobFingerprint.from_json(shown["fingerprint"]) == sent
    rows = FleetJobs(url, create=False)
    assert rows.fingerprints()[NEW] == sent
    rows.close()
    assert first["values"] == {"micro_batch": 128}  # the past job's final kept config
    assert first["meta"]["origin"] == f"fleet: kept by job {PAST} (distance 0.00)"

    result = invoke("fleet", "priors", NEW, "--state-db", url, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    (prior,) = out["priors"]
    assert prior["job"] == PAST and prior["values"] == {"micro_batch": 128}
    assert prior["gain"] == pytest.approx(1.25 ** 2 - 1) and prior["distance"] == 0
    assert prior["trial"]["change"] == first["id"]


@pytest.mark.integration
def test_a_malformed_fingerprint_is_refused_in_one_line(tmp_path: Path) -> None:
    with live_sidecar(tmp_path) as live:
        reply = live.post("/v1/jobs/j/attach", {"knobs": KNOBS, "baseline": {},
                                                "fingerprint": {"modules": {"Linear": -1},
                                                                "params": 1, "device": "cpu"}})
        assert reply.status_code == 422
        assert reply.json()["detail"] == ("fingerprint.modules['Linear'] must be an integer "
                                          "from 1 to 1000000000, got -1")
        assert live.get("/v1/jobs") == []
        plain = live.post("/v1/jobs/j/attach", {"knobs": KNOBS, "baseline": {}})
        assert plain.status_code == 200  # a client that sends none still attaches
        (shown,) = live.get("/v1/jobs")
        assert shown["fingerprint"] is None


@pytest.fixture
def fleet_db(tmp_path: Path, mlp_fingerprint: JobFingerprint) -> Iterator[str]:
    url = sqlite_url(tmp_path / "state.db")
    past_job(url, mlp_fingerprint, [{"micro_batch": 64}])
    far = JobFingerprint(modules={"Conv2d": 6, "BatchNorm2d": 6}, params=10**5,
                         device=mlp_fingerprint.device)
    past_job(url, far, [{"micro_batch": 16}], job="cnn")
    jobs = FleetJobs(url)
    jobs.record_fingerprint(NEW, mlp_fingerprint, kind="train", sidecar_id="me:4318",
                            study=None)
    jobs.close()
    engine = state_engine(url)
    with engine.begin() as conn:  # a job whose client sends no fingerprint (an old one)
        conn.execute(insert(jobs_table).values(job="old-client", sidecar_id="me:4318",
                                               kind="train", attached_at=1.0, seen_at=1.0))
    engine.dispose()
    yield url


def test_cli_shows_the_near_sources_with_distance_and_gain(fleet_db: str) -> None:
    result = invoke("fleet", "priors", NEW, "--state-db", fleet_db, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["fingerprint"]["modules"] == {"Linear": 3}
    assert [(p["job"], p["values"], p["trial"]) for p in out["priors"]] == [
        (PAST, {"micro_batch": 64}, None)]  # not the cnn: far
    table = invoke("fleet", "priors", NEW, "--state-db", fleet_db)
    assert table.exit_code == 0
    assert PAST in table.stdout and "micro_batch=64" in table.stdout
    assert "+25.0%" in table.stdout and "not yet" in table.stdout


def test_cli_shows_a_faster_tie_of_a_source_before_its_kept_config(fleet_db: str) -> None:
    journal = ChangeJournal(fleet_db)
    tie = Change(id=f"{PAST}-9", job=PAST, state="rolled_back", source="trial", reason="trial",
                 risk="low", scope="live", values={"threads": 4},
                 baseline={"micro_batch": 64, "threads": 2}, created_at_s=9.0,
                 expires_at_s=9.0, comparison={"gain": 0.02, "pairs": 6, "ci_low": -0.01,
                                               "ci_high": 0.05})
    journal.add(tie, actor="optuna", reason="r", version_before=None, detail={})
    journal.close()
    out = json.loads(invoke("fleet", "priors", NEW, "--state-db", fleet_db, "--json").stdout)
    assert [(p["values"], p["kept_there"]) for p in out["priors"]] == [
        ({"micro_batch": 64, "threads": 4}, False), ({"micro_batch": 64}, True)]
    assert out["priors"][0]["gain"] == pytest.approx(1.25 * 1.02 - 1)
    table = invoke("fleet", "priors", NEW, "--state-db", fleet_db).stdout
    assert "threads=4" in table and "…" not in table  # folded, not cut
    assert table.index("│ tie ") < table.index("│ kept ")


def test_cli_shows_half_the_micro_batch_to_a_job_four_times_the_sources_size(
        fleet_db: str, mlp_fingerprint: JobFingerprint) -> None:
    import dataclasses
    jobs = FleetJobs(fleet_db)
    bigger = dataclasses.replace(mlp_fingerprint, params=4 * mlp_fingerprint.params)
    jobs.record_fingerprint("mlp-big", bigger, kind="train", sidecar_id="me:4318", study=None)
    jobs.close()
    out = json.loads(invoke("fleet", "priors", "mlp-big", "--state-db", fleet_db,
                            "--json").stdout)
    assert [(p["job"], p["values"], p["lead"]) for p in out["priors"]] == [
        (PAST, {"micro_batch": 64}, "kept"), (PAST, {"micro_batch": 32}, "kept mb/2")]
    table = invoke("fleet", "priors", "mlp-big", "--state-db", fleet_db).stdout
    assert "micro_batch=32" in table and "kept mb/2" in table


def test_cli_errors_are_one_line(fleet_db: str, tmp_path: Path) -> None:
    unknown = invoke("fleet", "priors", "nobody", "--state-db", fleet_db)
    assert unknown.exit_code == 2
    assert unknown.output.strip().splitlines() == [
        "error: unknown job 'nobody': no sidecar sharing this state database has seen it "
        "attach"]
    old = invoke("fleet", "priors", "old-client", "--state-db", fleet_db)
    assert old.exit_code == 2 and len(old.output.strip().splitlines()) == 1
    assert "job 'old-client' has no fingerprint yet" in old.output
    missing = invoke("fleet", "priors", NEW, "--state-db",
                     sqlite_url(tmp_path / "nothing.db"))
    assert missing.exit_code == 2 and len(missing.output.strip().splitlines()) == 1
    assert "no state database here" in missing.output


def test_cli_says_when_no_near_job_kept_anything(tmp_path: Path,
                                                 mlp_fingerprint: JobFingerprint) -> None:
    url = sqlite_url(tmp_path / "state.db")
    jobs = FleetJobs(url)
    jobs.record_fingerprint(NEW, mlp_fingerprint, kind="train", sidecar_id="me", study=None)
    jobs.close()
    result = invoke("fleet", "priors", NEW, "--state-db", url)
    assert result.exit_code == 0
    assert "no fleet priors" in result.stdout

