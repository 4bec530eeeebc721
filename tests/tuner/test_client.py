"""The in-job client against a real lease server on 127.0.0.1 and real torch jobs."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import uvicorn
from fastapi import FastAPI
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from torch import nn

from collectors._points import CONFIG_VERSION_ATTR
from tests.rendezvous import file_rendezvous
from tests.servers import free_port, job_token_in_env
from tuner._lease import JobRegistry
from tuner._lease_http import lease_router
from tuner._lease_messages import Lease
from tuner.job import Session, attach
from workloads.process_group import rank_process_group

TTL_S = 1.0
TOKEN = "job-token-for-tests"
STEP_PAUSE_S = 0.02

pytestmark = pytest.mark.integration


class LeaseServer:
    """The lease router of a real registry, served by uvicorn in a thread; stop and restart."""

    def __init__(self, registry: JobRegistry, port: int) -> None:
        self.registry, self.port = registry, port
        self.url = f"http://127.0.0.1:{port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve; jobs attached while it serves find its token in $SEEDANCE_TOKEN."""
        self._token_env = job_token_in_env(TOKEN)
        self._token_env.__enter__()
        app = FastAPI()
        app.include_router(lease_router(self.registry, lambda job, token: token == TOKEN))
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "lease server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(30)
        self._token_env.__exit__(None, None, None)


@pytest.fixture
def server() -> Iterator[LeaseServer]:
    registry = JobRegistry(lease_ttl_s=TTL_S)
    registry.start()
    srv = LeaseServer(registry, free_port())
    srv.start()
    yield srv
    if srv._server is not None and not srv._server.should_exit:
        srv.stop()
    registry.shutdown()


class Job:
    """A small real training job: MLP regression with AdamW, a user knob scaling the loss."""

    def __init__(self, session_factory: Callable[[nn.Module, torch.optim.Optimizer], Session],
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.session = session_factory(self.model, self.optimizer)
        self.scale = self.session.knob("loss_scale", 1.0, low=0.5, high=4.0)
        self.data = torch.Generator().manual_seed(seed)
        self.steps: list[dict[str, Any]] = []  # per step: start, knob values, version, loss, params

    def step(self) -> None:
        s = self.session
        x = torch.randn(8, 16, generator=self.data)
        y = x.sum(dim=1, keepdim=True)
        start = time.monotonic()
        with s.step(samples=8):
            params = [p.detach().clone() for p in self.model.parameters()]
            n = s.micro_batches(8)
            total = 0.0
            for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
                loss = nn.functional.mse_loss(self.model(xs), ys) * self.scale.value / n
                loss.backward()
                total += float(loss.detach())
            s.after_backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            s.record_loss(total)
        self.steps.append({"start": start, "scale": self.scale.value, "version": s.version,
                           "micro_batch": s.values["micro_batch"], "loss": total,
                           "params": params})
        time.sleep(STEP_PAUSE_S)

    def run_until(self, done: Callable[[], bool], max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError(f"condition not met in {max_steps} steps")


def new_job(server: LeaseServer, meter_provider: MeterProvider | None = None,
            job: str = "mlp") -> Job:
    meter = (meter_provider or MeterProvider()).get_meter("test")
    return Job(lambda model, opt: attach(model, opt, job=job, sidecar=server.url,
                                         lease_ttl_s=TTL_S, meter=meter, global_batch=8))


def attached(registry: JobRegistry, job: str) -> Callable[[], bool]:
    return lambda: any(s.job == job and s.state == "attached" for s in registry.jobs())


def test_a_pushed_config_applies_at_a_step_boundary_and_is_acked_with_the_step(
        server: LeaseServer) -> None:
    reader = InMemoryMetricReader()
    job = new_job(server, MeterProvider(metric_readers=[reader]))
    registry = server.registry
    try:
        job.run_until(attached(registry, "mlp"))
        desired = registry.set_desired("mlp", {"loss_scale": 2.0, "micro_batch": 2},
                                       change_id="c1")
        job.run_until(lambda: job.session.version == desired.version)
        ack = registry.wait_ack("mlp", desired.version, timeout_s=30)
        assert ack is not None and ack.status == "applied" and ack.version == desired.version
        switch = dict((v, s) for s, v in job.session.switches)[desired.version]
        assert ack.step == switch
        # the user knob and micro_batch changed exactly at that step, not before
        assert [r["scale"] for r in job.steps[:switch]] == [1.0] * switch
        assert job.steps[switch]["scale"] == 2.0 and job.steps[switch]["micro_batch"] == 2
        assert job.steps[switch - 1]["micro_batch"] == 8
        assert registry.status("mlp").acked_version == desired.version
        job.run_until(lambda: len(job.steps) > switch + 2)
    finally:
        job.session.close()
    versions = {dp.attributes[CONFIG_VERSION_ATTR]
                for rm in reader.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics
                if m.name == "seedance.train.step.duration" for dp in m.data.data_points}
    assert desired.version in versions


def test_losing_the_sidecar_returns_to_baseline_and_training_goes_on(
        server: LeaseServer) -> None:
    job = new_job(server)
    registry = server.registry
    try:
        job.run_until(attached(registry, "mlp"))
        baseline = registry.status("mlp").baseline
        trial = registry.set_desired("mlp", {"loss_scale": 3.0})
        job.run_until(lambda: job.session.version == trial.version)
        server.stop()
        stopped_at = time.monotonic()
        stopped_step = len(job.steps)
        job.run_until(lambda: job.steps[-1]["scale"] == 1.0 if job.steps else False)
        back = next(r for r in job.steps[stopped_step:] if r["scale"] == 1.0)
        gaps = [b["start"] - a["start"] for a, b in itertools.pairwise(job.steps)]
        # the lease was last renewed before the stop, so the baseline is in force at the
        # first boundary after the TTL: within TTL + one step (+ clock-read slack)
        assert back["start"] - stopped_at <= TTL_S + max(gaps) + 0.1
        assert back["version"] == baseline.version
        job.run_until(lambda: len(job.steps) >= stopped_step + 40)
        assert all(math.isfinite(r["loss"]) for r in job.steps)
        # the sidecar comes back: the job re-attaches and runs what the sidecar says
        server.start()
        job.run_until(attached(registry, "mlp"))
        after = registry.set_desired("mlp", {"loss_scale": 0.5})
        job.run_until(lambda: job.session.version == after.version)
        assert job.scale.value == 0.5
    finally:
        job.session.close()


class StallingRegistry(JobRegistry):
    """A real registry whose next lease call answers ``stall_s`` late: a busy sidecar, alive."""

    stall_s = 0.0
    stalled: list[float] = []

    def lease(self, job: str, session: str, known_version: int, wait_s: float) -> Lease:
        stall, self.stall_s = self.stall_s, 0.0
        if stall:
            self.stalled = [*self.stalled, stall]
            time.sleep(stall)
        return super().lease(job, session, known_version, max(0.0, wait_s - stall))


def test_a_sidecar_that_answers_late_but_within_the_ttl_keeps_the_lease() -> None:
    ttl_s = 4.0  # the job long-polls for ttl/4 = 1 s; the old client gave up after 2 s
    registry = StallingRegistry(lease_ttl_s=ttl_s)
    registry.start()
    server = LeaseServer(registry, free_port())
    server.start()
    meter = MeterProvider().get_meter("test")
    job = Job(lambda model, opt: attach(model, opt, job="mlp", sidecar=server.url,
                                        lease_ttl_s=ttl_s, meter=meter, global_batch=8))
    try:
        job.run_until(attached(registry, "mlp"))
        trial = registry.set_desired("mlp", {"loss_scale": 3.0})
        job.run_until(lambda: job.session.version == trial.version)
        session = registry.status("mlp").session
        registry.stall_s = 2.4  # answered 2.4 s after it was asked: 0.6 s before the lapse
        stalled_from = len(job.steps)
        job.run_until(lambda: len(job.steps) > stalled_from and
                      job.steps[-1]["start"] - job.steps[stalled_from]["start"] > 2 * ttl_s)
        assert registry.stalled == [2.4]
        assert {r["version"] for r in job.steps[stalled_from:]} == {trial.version}
        assert registry.status("mlp").session == session  # never lapsed, never re-attached
    finally:
        job.session.close()
        server.stop()
        registry.shutdown()


def test_null_session_trains_on_defaults() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = attach(model, optimizer, job="offline", sidecar=None, global_batch=4)
    knob = session.knob("alpha", 0.3, low=0.0, high=1.0)
    for _ in range(3):
        with session.step():
            assert session.micro_batches(4) == 1
            model(torch.randn(4, 4)).sum().mul(knob.value).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert session.version == 0 and knob.value == 0.3 and session.switches == []
    session.close()


def test_precision_knob_switches_the_groups_compute_dtype(server: LeaseServer) -> None:
    job = new_job(server)
    registry = server.registry
    seen: list[torch.dtype] = []
    job.model[2].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        groups = job.session.precision_groups
        assert set(groups) == {"_0", "_2"}  # Sequential children grouped by their names
        job.run_until(attached(registry, "mlp"))
        trial = registry.set_desired("mlp", {"precision._2": "bf16"})
        job.run_until(lambda: job.session.version == trial.version)
        seen.clear()
        job.step()
        assert seen[-1] == torch.bfloat16  # the module's own output, before the cast back
        back = registry.set_desired("mlp", {"precision._2": "fp32"})
        job.run_until(lambda: job.session.version == back.version)
        seen.clear()
        job.step()
        assert seen[-1] == torch.float32
    finally:
        job.session.close()


def test_snapshot_and_full_rollback_actions(server: LeaseServer) -> None:
    job = new_job(server)
    registry = server.registry
    try:
        job.run_until(attached(registry, "mlp"))
        snap = registry.push_action("mlp", {"kind": "snapshot", "change_id": "c5"})
        job.run_until(lambda: job.session.version == snap.version)
        taken = dict((v, s) for s, v in job.session.switches)[snap.version]
        job.run_until(lambda: len(job.steps) > taken + 5)
        roll = registry.push_action("mlp", {"kind": "rollback", "scope": "full",
                                            "change_id": "c5"})
        job.run_until(lambda: job.session.version == roll.version)
        restored = dict((v, s) for s, v in job.session.switches)[roll.version]
        ack = registry.wait_ack("mlp", roll.version, timeout_s=30)
    finally:
        job.session.close()
    assert ack is not None and [a["status"] for a in ack.actions] == ["done"]
    same = [torch.equal(a, b) for a, b in zip(job.steps[taken]["params"],
                                              job.steps[restored]["params"], strict=True)]
    moved = [torch.equal(a, b) for a, b in zip(job.steps[restored - 1]["params"],
                                               job.steps[restored]["params"], strict=True)]
    assert all(same) and not any(moved)


# ---- two ranks -----------------------------------------------------------------------------------


def _rank(rank: int, world_size: int, url: str, out: str) -> None:
    torch.set_num_threads(1)
    with rank_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=file_rendezvous(out)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        session = attach(ddp, optimizer, job="ddp", sidecar=url, lease_ttl_s=TTL_S,
                         meter=MeterProvider().get_meter("test"), global_batch=8)
        scale = session.knob("loss_scale", 1.0, low=0.5, high=4.0)
        values: list[float] = []
        stop = torch.zeros(1)
        generator = torch.Generator().manual_seed(rank)
        while True:
            with session.step(samples=4):
                values.append(float(scale.value))
                x = torch.randn(4, 16, generator=generator)
                loss = nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)) * scale.value
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            # rank 0 ends the run a few steps after the pushed config reached it
            stop.fill_(float(rank == 0 and scale.value == 2.0 and values.count(2.0) >= 5))
            dist.all_reduce(stop)
            if stop.item() or len(values) > 3000:
                break
            time.sleep(STEP_PAUSE_S)
        session.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"switches": session.switches, "values": values}))


def test_two_ranks_switch_on_the_same_step(server: LeaseServer, tmp_path: Path) -> None:
    registry = server.registry
    pushed: list[int] = []

    def push_when_attached() -> None:
        deadline = time.monotonic() + 120
        while not attached(registry, "ddp")() and time.monotonic() < deadline:
            time.sleep(0.05)
        pushed.append(registry.set_desired("ddp", {"loss_scale": 2.0}).version)

    pusher = threading.Thread(target=push_when_attached, daemon=True)
    pusher.start()
    mp.spawn(_rank, args=(2, server.url, str(tmp_path)), nprocs=2)
    pusher.join(5)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["switches"] == ranks[1]["switches"]
    assert ranks[0]["values"] == ranks[1]["values"]
    switch = dict((v, s) for s, v in ranks[0]["switches"])[pushed[0]]
    assert ranks[1]["values"][switch - 1] == 1.0 and ranks[1]["values"][switch] == 2.0
    ack = registry.wait_ack("ddp", pushed[0], timeout_s=10)
    assert ack is not None and ack.step == switch
    assert registry.status("ddp").world_size == 2
