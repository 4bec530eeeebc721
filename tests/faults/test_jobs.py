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

import pytest

from tests.faults._sidecar import ROOT, TOKEN, SidecarProcess, record

pytestmark = pytest.mark.integration

GRACE_S = 10.0
"""Well inside Kubernetes' default 30 s; the job used to need SIGKILL."""


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
            ended = sidecar.wait_for("the trial to be failed", lambda: next(
                (c for c in sidecar.http.get("/v1/changes").json()
                 if c["id"] == trial["id"] and c["state"] not in ("applying", "observing")),
                None), timeout_s=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
        assert ended["state"] == "failed", ended
        record("job_dies_mid_trial", change_state=ended["state"])
