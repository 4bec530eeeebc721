"""A trial must never kill the job: a BatchNorm CNN on CPU, attached to a real lease server.

Norm layers compute in fp32 under any precision, a new config is first tried on a shadow step
(the last batch, forward and backward, everything put back), and a step that raises under an
experimental config is skipped under the baseline and reported as failed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from torch import nn

from tests.servers import free_port
from tests.tuner.test_client import LeaseServer
from tuner._lease import JobRegistry
from tuner._lease_messages import Ack
from tuner.job import attach
from tuner.precision import DTYPES

pytestmark = pytest.mark.integration

TTL_S = 2.0  # no test here is about lapses; a job's close waits up to a quarter of it
WAIT_S = 30.0
BLOCKS = {"block1": ("features.0", "features.1"), "block2": ("features.3", "features.4"),
          "head": ("head",)}
"""Groups that match each BatchNorm together with the conv before it."""
SUBTREES = {"features": ("features",), "head": ("head",)}
"""Groups whose BatchNorms inherit the precision of the Sequential they sit in."""
SPECTRAL = {"convs": ("features.0", "features.3"), "spectral": ("spectral",), "head": ("head",)}


class Spectral(nn.Module):
    """A learnable gain per frequency along the width. torch.fft has no fp16 or bf16 kernels on
    CPU, so in either precision this module raises: a real op that cannot take a trial."""

    def __init__(self, bins: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(bins))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(h, dim=-1) * self.gain, n=h.shape[-1], dim=-1)


class CNN(nn.Module):
    """Conv-BatchNorm-ReLU twice, pooling and a linear head: the model of the issue."""

    def __init__(self, *, spectral: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.spectral = Spectral(5) if spectral else nn.Identity()  # 5 bins of an 8-wide image
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.spectral(self.features(x)).mean(dim=(2, 3))))


class Job:
    """The user's loop: 8 random 8x8 images a step, cross-entropy, SGD with momentum; with a
    grad scaler it unscales and clips with ``error_if_nonfinite`` before the step."""

    def __init__(self, server: LeaseServer, name: str, groups: Mapping[str, Sequence[str]], *,
                 model: CNN | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        torch.manual_seed(0)
        self.name, self.registry = name, server.registry
        self.model = model or CNN()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.scaler = grad_scaler
        self.session = attach(self.model, self.optimizer, job=name, sidecar=server.url,
                              lease_ttl_s=TTL_S, meter=MeterProvider().get_meter("test"),
                              precision_groups=groups, grad_scaler=grad_scaler)
        self.data = torch.Generator().manual_seed(1)
        self.losses: list[float] = []
        self.forwards = 0
        self.model.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.forwards += 1

    def batch(self, channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(8, channels, 8, 8, generator=self.data),
                torch.randint(0, 4, (8,), generator=self.data))

    def step(self, channels: int = 3) -> None:
        x, y = self.batch(channels)
        with self.session.step(samples=8):
            loss = nn.functional.cross_entropy(self.model(x), y)
            if self.scaler is None:
                loss.backward()
                self.optimizer.step()
            else:
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, error_if_nonfinite=True)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.losses.append(float(loss.detach()))

    def idle(self) -> None:
        """A step boundary without a forward (a job still loading its data, say)."""
        with self.session.step():
            pass
        time.sleep(0.005)

    def until(self, done: Callable[[], bool], step: Callable[[], None] | None = None) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, "condition not met in time"
            (step or self.step)()

    def attached(self) -> bool:
        """The sidecar holds the job's lease and the job runs the config it was sent."""
        return any(s.job == self.name and s.state == "attached"
                   and s.desired.version == self.session.version for s in self.registry.jobs())

    def send(self, values: Mapping[str, Any]) -> int:
        return self.registry.set_desired(self.name, values).version

    def acks(self, version: int) -> list[Ack]:
        return [a for a in self.registry.acks(self.name) if a.version == version]

    def acks_until(self, version: int, count: int,
                   step: Callable[[], None] | None = None) -> list[Ack]:
        """Steps until the sidecar holds ``count`` acks of ``version``; those acks."""
        self.until(lambda: len(self.acks(version)) >= count, step)
        return self.acks(version)


@pytest.fixture(scope="module")
def server() -> Iterator[LeaseServer]:
    registry = JobRegistry(lease_ttl_s=TTL_S)
    registry.start()
    srv = LeaseServer(registry, free_port())
    srv.start()
    yield srv
    srv.stop()
    registry.shutdown()


@pytest.mark.parametrize("groups", [BLOCKS, SUBTREES], ids=["matched", "inherited"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_every_group_in_half_precision_trains_a_batchnorm_cnn(
        server: LeaseServer, groups: Mapping[str, Sequence[str]], precision: str) -> None:
    job = Job(server, f"cnn-{precision}-{len(groups)}", groups)
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for name in ("features.0", "features.1", "features.4"):
        job.model.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, (args[0].dtype, out.dtype)))
    try:
        job.until(job.attached)
        before = {n: b.clone() for n, b in job.model.named_buffers()}
        trial = job.send({f"precision.{g}": precision for g in groups})
        job.until(lambda: job.session.version == trial)
        trained = len(job.losses)
        for _ in range(5):
            job.step()
    finally:
        job.session.close()
    low = DTYPES[precision]
    assert seen["features.0"] == (low, low)  # the conv does compute in the trial's precision
    assert seen["features.1"] == seen["features.4"] == (torch.float32, torch.float32)
    assert len(job.losses) == trained + 5 and all(math.isfinite(v) for v in job.losses)
    assert job.session.skipped_steps == 0
    for name, buffer in job.model.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert buffer > before[name], name
        else:
            assert buffer.dtype == torch.float32 and not torch.equal(buffer, before[name]), name
    assert all(p.dtype == torch.float32 for p in job.model.parameters())


def test_a_group_of_norm_layers_only_gets_no_precision_knob() -> None:
    model = CNN()
    session = attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job="knobs",
                     sidecar=None, precision_groups={
                         "convs": ("features.0", "features.3"),
                         "norms": ("features.1", "features.4"), "head": ("head",)})
    knobs = {n for n in session.knobs.knobs if n.startswith("precision.")}
    assert knobs == {"precision.convs", "precision.head"}
    assert "norms" in session.precision_groups  # still a module group (local rollback)
    session.close()


def test_a_config_failing_its_shadow_step_is_refused_and_training_goes_on(
        server: LeaseServer) -> None:
    job = Job(server, "spectral-shadow", SPECTRAL, model=CNN(spectral=True))
    try:
        job.until(job.attached)
        baseline = job.session.version
        bad = job.send({"precision.spectral": "bf16"})
        [failed] = job.acks_until(bad, 1)
        assert failed.status == "failed" and "Unsupported dtype BFloat16" in str(failed.error)
        assert job.session.version == baseline
        assert job.session.values["precision.spectral"] == "fp32"
        assert job.forwards == len(job.losses) + 1  # one shadow step
        again = job.send({"precision.spectral": "bf16"})
        [refused] = job.acks_until(again, 1)
        assert refused.status == "failed" and "failed before in this process" in str(
            refused.error)
        assert job.forwards == len(job.losses) + 1  # not tried again
        good = job.send({"precision.head": "bf16"})
        job.until(lambda: job.session.version == good)
        trained = len(job.losses)
        for _ in range(3):
            job.step()
    finally:
        job.session.close()
    assert len(job.losses) == trained + 3 and all(math.isfinite(v) for v in job.losses)
    assert job.session.switches[-1][1] == good and job.session.skipped_steps == 0


def test_a_step_raising_under_a_trial_is_skipped_under_the_baseline_and_reported(
        server: LeaseServer) -> None:
    job = Job(server, "spectral-step", SPECTRAL, model=CNN(spectral=True))
    try:
        job.until(job.attached, job.idle)
        baseline = job.session.version
        trial = job.send({"precision.spectral": "fp16"})
        job.until(lambda: job.session.version == trial, job.idle)  # no batch yet: untried
        params = [p.detach().clone() for p in job.model.parameters()]
        job.step()  # the forward raises in the fft: swallowed
        assert job.session.skipped_steps == 1 and job.losses == []
        assert job.session.version == baseline
        assert job.session.values["precision.spectral"] == "fp32"
        assert all(p.grad is None for p in job.model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(params, job.model.parameters(),
                                                     strict=True))
        applied, failed = job.acks_until(trial, 2)
        assert (applied.status, failed.status) == ("applied", "failed")
        assert "Unsupported dtype Half" in str(failed.error)
        assert failed.step > applied.step  # applied at an idle boundary, failed at a step
        for _ in range(5):
            job.step()
        again = job.send({"precision.spectral": "fp16"})
        [refused] = job.acks_until(again, 1)
    finally:
        job.session.close()
    assert refused.status == "failed"
    assert len(job.losses) >= 5 and all(math.isfinite(v) for v in job.losses)
    assert job.session.skipped_steps == 1


def test_a_step_raising_after_unscale_is_skipped_and_the_grad_scaler_goes_on(
        server: LeaseServer) -> None:
    # A large loss scale overflows fp16 in the head's backward: the shadow step (no scale)
    # passes, the real step's clip finds the gradients non-finite and raises.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    job = Job(server, "cnn-scaled", BLOCKS, grad_scaler=scaler)
    try:
        job.until(job.attached)
        baseline = job.session.version
        trial = job.send({"precision.head": "fp16"})
        job.until(lambda: job.session.skipped_steps == 1)
        assert job.session.version == baseline and job.session.values["precision.head"] == "fp32"
        trained = len(job.losses)
        for _ in range(5):
            job.step()  # unscale_ again: the skipped step's record of it is gone
        stepped = len(job.losses) - trained  # before acks_until, which steps while it waits
        applied, failed = job.acks_until(trial, 2)
    finally:
        job.session.close()
    assert (applied.status, failed.status) == ("applied", "failed")
    assert "non-finite" in str(failed.error)
    assert stepped == 5 and all(math.isfinite(v) for v in job.losses)
    assert job.session.skipped_steps == 1


def test_an_exception_the_baseline_raises_too_propagates(server: LeaseServer) -> None:
    job = Job(server, "cnn-user-error", BLOCKS)
    try:
        job.until(job.attached)
        baseline = job.session.version
        with pytest.raises(RuntimeError, match="channels"):
            job.step(channels=5)  # under the baseline: as before
        trial = job.send({"precision.block1": "bf16"})
        # no forward in between: the shadow step replays the batch before the one that raised
        job.until(lambda: job.session.version == trial, job.idle)
        with pytest.raises(RuntimeError, match="channels") as raised:
            job.step(channels=5)  # under a trial, but the baseline fails on that batch too
        assert raised.value.__context__ is None  # the original, not the baseline's
        assert not any(entry.name == "_shadow_step" for entry in raised.traceback)
        assert job.session.version == trial and job.session.skipped_steps == 0
        assert job.session.values["precision.block1"] == "bf16"
        with pytest.raises(KeyboardInterrupt), job.session.step():
            raise KeyboardInterrupt  # never swallowed, trial or not
        assert job.session.version == trial and job.session.skipped_steps == 0
        job.step()
    finally:
        job.session.close()  # delivers every ack queued
    assert [a.status for a in job.acks(trial)] == ["applied"]
    assert baseline != trial and all(math.isfinite(v) for v in job.losses)


def _state(model: nn.Module) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "grad_refs": [p.grad for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()], "rng": torch.get_rng_state()}


def _assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in ("params", "grads", "buffers"):
        for x, y in zip(a[name], b[name], strict=True):
            assert (x is None and y is None) or (
                x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y)), name
    assert all(x is y for x, y in zip(a["grad_refs"], b["grad_refs"], strict=True))
    assert torch.equal(a["rng"], b["rng"])


def test_the_shadow_step_puts_back_grads_buffers_and_rng_bit_for_bit(
        server: LeaseServer) -> None:
    job = Job(server, "cnn-shadow", BLOCKS, model=CNN(dropout=0.5))
    bn = job.model.features[4]
    during: list[tuple[int, torch.Tensor]] = []
    bn.register_forward_hook(lambda m, a, o: during.append(
        (int(bn.num_batches_tracked), torch.get_rng_state())))
    try:
        job.until(job.attached)
        # gradients left behind by a backward (accumulating, say), one of them None
        x, y = job.batch()
        nn.functional.cross_entropy(job.model(x), y).backward()
        job.model.head.bias.grad = None
        forwards, tracked = job.forwards, int(bn.num_batches_tracked)
        trial = job.send({"precision.block2": "fp16"})
        while job.session.version != trial:
            before = _state(job.model)
            with job.session.step():
                inside = _state(job.model)  # right after the boundary that ran the shadow step
            time.sleep(0.005)
        assert job.forwards == forwards + 1  # the shadow step ran, once
        _assert_identical(before, inside)
        assert during[-1][0] == tracked + 1 and int(bn.num_batches_tracked) == tracked
        back = job.send({"precision.block2": "fp32"})
        job.until(lambda: job.session.version == back, job.idle)
        again = job.send({"precision.block2": "fp16"})
        job.until(lambda: job.session.version == again, job.idle)
        assert job.forwards == forwards + 1  # both passed before: no shadow step
    finally:
        job.session.close()
