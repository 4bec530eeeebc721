"""A job never waits on its sidecar: with the sidecar killed (SIGKILL, mid-export), SIGTERM
stops the serving job and a training job within a grace period, their OTLP exporters and
lease threads bounded. Real processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from tests.faults._sidecar import ROOT, TOKEN, SidecarProcess, record
from tuner._sampler import unsafe_keys
from tuner._space import config_key
from tuner._study_records import StudyRecords

pytestmark = pytest.mark.integration

GRACE_S = 30.0
"""Kubernetes' default terminationGracePeriodSeconds, which deploy/k8s keeps; the job used to
need SIGKILL. It exits in 2-3 s on an idle box and 4-5 s beside two matmul-bound torch
processes (the exporter's last export to the dead sidecar times out after 2 s); beside the
suite's live sessions on two workers it once took more than 10 s, the bound this had before."""


@pytest.mark.parametrize("job", [
    ["-m", "workloads.serve_tuned", "--job", "serve", "--duration-s", "600",
     "--export-interval-s", "1"],
    ["-m", "workloads.train_family", "--family", "mlp", "--job", "train", "--seconds", "600"],
], ids=["serving", "training"])
def test_sigterm_stops_the_job_within_its_grace_period_when_the_sidecar_is_gone(
        tmp_path: Path, job: list[str]) -> None:
    log = (tmp_path / "job.log").open("wb")
    with SidecarProcess(tmp_path) as sidecar:
        proc = subprocess.Popen([sys.executable, *job, "--sidecar", sidecar.url],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT),
                                     "SEEDANCE_TOKEN": TOKEN})
        try:
            sidecar.wait_for("the job to attach", lambda: sidecar.http.get(
                "/v1/jobs").json(), timeout_s=120)
            sidecar.proc.kill()  # gone mid-whatever: no goodbye, connections refused
            sidecar.proc.wait(10)
            time.sleep(3)  # the job's exporter and lease are retrying by now
            assert proc.poll() is None, (tmp_path / "job.log").read_text()[-2000:]
            proc.send_signal(signal.SIGTERM)
            began = time.monotonic()
            try:
                code = proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the job was still running {GRACE_S:g} s after SIGTERM:\n"
                            + (tmp_path / "job.log").read_text()[-2000:])
            record(f"sigterm_without_sidecar_{job[1].rsplit('.', 1)[-1]}",
                   exited_after_s=round(time.monotonic() - began, 2), exit_code=code,
                   grace_s=GRACE_S)
            assert code == 0, (tmp_path / "job.log").read_text()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()


def test_a_job_that_dies_mid_trial_fails_the_trial_never_leaves_it_running(
        tmp_path: Path) -> None:
    log = (tmp_path / "job.log").open("wb")
    with SidecarProcess(tmp_path, approval={"mode": "auto"}, jobs={"train": {"tune": True}},
                        tuning_start_after_s=2, lease_ttl_s=3) as sidecar:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workloads.train_family", "--family", "mlp", "--job",
             "train", "--seconds", "600", "--sidecar", sidecar.url],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "SEEDANCE_TOKEN": TOKEN})
        try:
            trial = sidecar.wait_for("a trial in flight", lambda: next(
                (c for c in sidecar.http.get("/v1/changes").json()
                 if c["source"] == "trial" and c["state"] in ("applying", "observing")), None),
                timeout_s=180)
            proc.kill()  # the job dies mid-trial: no goodbye
            proc.wait(10)
            ended = sidecar.wait_for("the trial to be failed", lambda: (
                c := sidecar.http.get(f"/v1/changes/{trial['id']}").json())["state"]
                not in ("applying", "observing") and c, timeout_s=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
        assert ended["state"] == "failed", ended
        assert "lapsed" in ended["events"][-1]["reason"], ended["events"][-1]
        # the study bars the config that was in force when the job died
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'state.db'}")
        study = optuna.load_study(study_name=trial["meta"]["study"], storage=storage)
        # the search hears of the change's end just after the journal records it
        failed = sidecar.wait_for("the study to end the trial", lambda: (
            t := study.trials[trial["meta"]["trial"]]).state.is_finished() and t, timeout_s=30)
        assert failed.state == optuna.trial.TrialState.FAIL
        assert "the job died" in failed.user_attrs["seedance:fail_reason"]
        assert config_key(failed.params) in unsafe_keys(StudyRecords(storage, study.study_name))
        record("job_dies_mid_trial", change_state=ended["state"], trial_barred=True)


def test_a_sidecar_killed_mid_change_rolls_it_back_on_restart_and_loses_nothing(
        tmp_path: Path) -> None:
    """SIGKILL while a change is in flight: after a restart on the same files the change is
    rolled back, the job is back on its baseline, and every point committed before the kill is
    still there (points answered 200 wait up to one flush interval, 1 s, for their commit)."""
    from collectors._store import TimeSeriesStore
    from tests.faults._sidecar import PROTOBUF, gauge_request

    log = (tmp_path / "job.log").open("wb")
    settings: dict[str, object] = {"approval": {"mode": "auto"}, "lease_ttl_s": 5}
    sidecar = SidecarProcess(tmp_path, **settings)
    proc = subprocess.Popen(
        [sys.executable, "-m", "workloads.train_family", "--family", "mlp", "--job", "train",
         "--seconds", "600", "--sidecar", sidecar.url],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SEEDANCE_TOKEN": TOKEN})
    try:
        sidecar.wait_for("the job to attach", lambda: sidecar.http.get("/v1/jobs").json(),
                         timeout_s=120)
        sent = 0
        t0 = time.time_ns()
        for i in range(50):
            r = sidecar.http.post("/v1/metrics", headers=PROTOBUF, content=gauge_request(
                "kept.gauge", range(10), t0_ns=t0 + i * 10**9))
            assert r.status_code == 200
            sent += 10

        def stored() -> int:
            with TimeSeriesStore(tmp_path / "metrics.db", readonly=True,
                                 raw_retention_s=None) as store:
                return len(store.query("kept.gauge", resolution="raw"))

        sidecar.wait_for("the points to be committed", lambda: stored() == sent)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        change = sidecar.http.post("/v1/jobs/train/changes", headers=headers, json={
            "values": {"threads": 1}, "by": "alice", "reason": "fault test"}).json()
        sidecar.wait_for("the change in flight", lambda: sidecar.http.get(
            f"/v1/changes/{change['id']}").json()["state"] in ("applying", "observing"))
        sidecar.proc.kill()
        sidecar.stop()
        again = SidecarProcess(tmp_path, port=sidecar.port, **settings)
        try:
            ended = again.wait_for("the change to be rolled back", lambda: (
                c := again.http.get(f"/v1/changes/{change['id']}").json())["state"]
                not in ("applying", "observing", "approved") and c)
            assert ended["state"] == "rolled_back", ended
            assert "restarted" in ended["plan"]["ended_because"]
            back = again.wait_for("the job back on its baseline", lambda: next(
                (j for j in again.http.get("/v1/jobs").json()
                 if j["state"] == "attached" and j["acked_version"] is not None
                 and j["acked_version"] >= j["desired"]["version"]), None), timeout_s=60)
            assert back["desired"]["values"]["threads"] != 1
        finally:
            again.stop()
        after = stored()
        record("sidecar_sigkill_mid_change", points_committed_before_kill=sent,
               points_after_restart=after, change_after_restart=ended["state"])
        assert after == sent  # nothing committed is lost
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


BLOWS_UP = """
import sys, time
import torch
from torch import nn
import tuner.job

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
session = tuner.job.attach(model, optimizer, job="train", sidecar=sys.argv[1],
                           global_batch=32, export_interval_s=0.5)
lr_scale = session.knob("lr_scale", 1.0, choices=[1.0, 1e30], description="fault drill")
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    x = torch.randn(32, 64)
    y = (x.sum(dim=1) > 0).long()
    with session.step(tokens=32, samples=32):
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * lr_scale.value
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        session.record_loss(loss)
        optimizer.step(); optimizer.zero_grad()
    time.sleep(0.02)
session.close()
"""


def test_a_rollback_the_job_cannot_carry_out_needs_a_person_and_says_so(tmp_path: Path) -> None:
    """A change blows the loss up; its full rollback needs a model snapshot the job never took
    (nothing lowered a precision), so the job cannot carry it out: the sidecar sends it
    ``restore_attempts`` times, then the change is ``manual_intervention_required`` and a
    critical finding says why."""
    job_file = tmp_path / "job.py"
    job_file.write_text(BLOWS_UP)
    log = (tmp_path / "job.log").open("wb")
    with SidecarProcess(tmp_path, policy_interval_s=1) as sidecar:
        proc = subprocess.Popen([sys.executable, str(job_file), sidecar.url], stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT),
                                     "SEEDANCE_TOKEN": TOKEN})
        try:
            sidecar.wait_for("the job to attach", lambda: sidecar.http.get(
                "/v1/jobs").json(), timeout_s=120)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            change = sidecar.http.post("/v1/jobs/train/changes", headers=headers, json={
                "values": {"lr_scale": 1e30}, "by": "alice", "reason": "fault drill"}).json()
            assert sidecar.http.post(f"/v1/changes/{change['id']}/approve", headers=headers,
                                     json={"by": "alice"}).status_code == 200
            stuck = sidecar.wait_for("the change to need a person", lambda: (
                c := sidecar.http.get(f"/v1/changes/{change['id']}").json())["state"]
                == "manual_intervention_required" and c, timeout_s=120)
            finding = sidecar.wait_for("the finding", lambda: next(
                (f for f in sidecar.http.get("/v1/findings").json()
                 if f["detector"] == "rollback_failed"), None), timeout_s=30)
        finally:
            proc.kill()
            proc.wait(10)
            log.close()
    kinds = [e["kind"] for e in stuck["events"]]
    assert kinds.count("restore_retry") == 2, kinds  # three attempts in all (the default)
    assert "no snapshot has been taken" in stuck["plan"]["restore"]["problem"]
    assert finding["severity"] == "critical" and finding["job"] == "train"
    assert finding["resource"] == {"change": change["id"]}
    record("rollback_fails", attempts=stuck["plan"]["restore"]["attempt"],
           change_state=stuck["state"], finding=finding["detector"])
