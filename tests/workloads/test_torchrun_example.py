"""The torchrun example, started by the real torchrun with two gloo ranks against a real sidecar
process on loopback: an operator's change and its rollback reach both ranks at the same step,
and only rank 0 holds the lease. Waits are bounded; no time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
JOB = "torchrun-example"
JOB_SECONDS = 10.0  # from the first step on; the change and its rollback take about one


def _until(check: Callable[[], Any], what: str, alive: subprocess.Popen[bytes],
           timeout_s: float = 60) -> Any:
    """Poll ``check`` until it returns something truthy, while ``alive`` runs (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert alive.poll() is None and time.monotonic() < deadline, f"no {what}"
        time.sleep(0.1)
    return found


def _acked(http: httpx.Client, version: int) -> Callable[[], bool]:
    return lambda: any(a["version"] == version and a["status"] == "applied"
                       for a in http.get(f"/v1/jobs/{JOB}/acks").json())


def test_two_torchrun_ranks_switch_together_and_only_rank_0_holds_the_lease(
        tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (tmp_path / "sidecar.toml").write_text(textwrap.dedent(f"""\
        listen = "127.0.0.1:{port}"
        nvml = "off"
        """))
    record = tmp_path / "ranks"
    record.mkdir()
    env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"}
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("sidecar", "job")}
    # cwd tmp_path: the sidecar writes its token to seedance-data/, where the job finds it
    sidecar = subprocess.Popen([sys.executable, "-m", "seedancectl.sidecar", "--config",
                                str(tmp_path / "sidecar.toml")], stdout=logs["sidecar"],
                               stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    job: subprocess.Popen[bytes] | None = None
    try:
        with httpx.Client(base_url=url, timeout=10.0) as http:
            def ready() -> bool:
                try:
                    return http.get("/readyz").status_code == 200
                except httpx.HTTPError:
                    return False

            _until(ready, "ready sidecar", sidecar)
            job = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                 "-m", "workloads.torchrun_example", "--sidecar", url,
                 "--seconds", str(JOB_SECONDS), "--record", str(record)],
                stdout=logs["job"], stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
            _until(lambda: any(j["job"] == JOB and j["state"] == "attached"
                               for j in http.get("/v1/jobs").json()), "attach", job)
            baseline = http.get(f"/v1/jobs/{JOB}/knobs").json()["baseline"]["version"]
            token = (tmp_path / "seedance-data" / "token").read_text().strip()
            operator = {"Authorization": f"Bearer {token}"}
            reply = http.post(f"/v1/jobs/{JOB}/changes", headers=operator, json={
                "values": {"micro_batch": 2}, "reason": "two micro-batches", "by": "test"})
            assert reply.status_code == 201, reply.text
            reply = http.post(f"/v1/changes/{reply.json()['id']}/approve", headers=operator,
                              json={"by": "test"})
            assert reply.status_code == 200, reply.text
            applied = _until(lambda: [a for a in http.get(f"/v1/jobs/{JOB}/acks").json()
                                      if a["status"] == "applied" and a["version"] != baseline],
                             "ack of the change", job)
            reply = http.post(f"/v1/jobs/{JOB}/rollback", headers=operator,
                              json={"by": "test", "reason": "back to one micro-batch"})
            assert reply.status_code == 200, reply.text
            restored = next(j for j in http.get("/v1/jobs").json()
                            if j["job"] == JOB)["desired"]["version"]
            _until(_acked(http, restored), "ack of the rollback", job)
            assert job.wait(JOB_SECONDS + 60) == 0, (tmp_path / "job.log").read_text()[-3000:]
            acks = http.get(f"/v1/jobs/{JOB}/acks").json()
            attaches = [e for e in http.get("/v1/audit", params={"job": JOB}).json()
                        if e["kind"] == "attach"]
            registered = [j for j in http.get("/v1/jobs").json() if j["job"] == JOB]
    finally:
        for proc in (job, sidecar):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        for log in logs.values():
            log.close()
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in (0, 1)]
    # every rank ran the same config and micro-batch size at every step
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["switches"] == ranks[1]["switches"]
    switches = [tuple(s) for s in ranks[0]["switches"]]
    assert len(switches) >= 3, switches  # the launch config, the change, the rollback
    sizes = {version: size for _, version, size in ranks[0]["steps"]}
    assert switches[0][1] == baseline and switches[-1][1] == restored
    assert (sizes[baseline], sizes[applied[0]["version"]], sizes[restored]) == (8, 2, 8)
    # the sidecar's record: one attach (a rank 1 lease client would attach as rank 0 too),
    # the job's two ranks, and each applied version acked at the step both ranks switched
    assert len(attaches) == 1, attaches
    assert registered[0]["world_size"] == 2
    acked = {(a["step"], a["version"]) for a in acks if a["status"] == "applied"}
    assert set(switches) <= acked, (switches, acks)
