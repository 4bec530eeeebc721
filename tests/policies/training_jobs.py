"""Real small torch jobs whose telemetry goes through the real OTel set-up into a real store.

Every step is exported once (``force_flush`` after it), so the store holds one reading per
step, as a job exporting faster than it steps would; the gradients are read every step to match
(``grad_interval_s=0``, as a session exporting that often would set it). Windows cover the whole
run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from collectors._otel import Telemetry, TelemetryConfig, setup_telemetry
from collectors._store import TimeSeriesStore
from collectors.torch_training import TrainingInstrumentation
from policies import StoreWindow

JOB = "train-under-test"


@dataclass
class Run:
    """A live store fed by a live meter provider; ``window()`` covers everything written."""

    store: TimeSeriesStore
    telemetry: Telemetry

    def instrument(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, version: int,
                   **kwargs: object) -> TrainingInstrumentation:
        return TrainingInstrumentation(model, optimizer, self.telemetry.meter("test"),
                                       config_version=version, stats_every=1,
                                       grad_interval_s=0.0, **kwargs)  # type: ignore[arg-type]

    def export(self) -> None:
        assert self.telemetry.force_flush(timeout_s=10.0)

    def window(self, since_ns: int = 0, until_ns: int = 2**62) -> StoreWindow:
        """A window over a read-only handle on the file, as the sidecar reads a job's store
        (it stays open after the run; :func:`close_readers` closes them)."""
        self.store.flush()
        reader = TimeSeriesStore(self.store.path, readonly=True, raw_retention_s=None)
        _READERS.append(reader)
        return StoreWindow(reader, job=JOB, since_ns=since_ns, until_ns=until_ns)


_READERS: list[TimeSeriesStore] = []


def close_readers() -> None:
    """Close every read-only store :meth:`Run.window` opened."""
    while _READERS:
        _READERS.pop().close()


@contextmanager
def store_run(tmp_path: Path) -> Iterator[Run]:
    """A TimeSeriesStore file and a MeterProvider whose store sink writes into it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    with TimeSeriesStore(tmp_path / "ts.db", raw_retention_s=None) as store:
        config = TelemetryConfig(job=JOB, export_interval_s=3600.0)
        with setup_telemetry(config, store_sink=lambda d: store.write(d.points)) as telemetry:
            yield Run(store=store, telemetry=telemetry)


class HalfLinear(nn.Module):
    """Runs a Linear in fp16 with fp32 master weights: a local stand-in for the precision
    actuator's per-module cast (tuner.precision), which this test must not depend on.

    Input and weights are cast to fp16 for the matmul and the output back to fp32, so the
    backward computes in fp16 from an fp16 copy of the incoming gradient, which flushes to zero
    below fp16's smallest subnormal (6e-8); the optimizer still sees fp32 gradients.
    """

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.inner.bias is None else self.inner.bias.half()
        return nn.functional.linear(x.half(), self.inner.weight.half(), bias).float()


def mlp(seed: int = 0) -> nn.Sequential:
    """A residual-free stack: each Linear's gradient flows through every one after it.

    Module groups fall back to the top-level children: "0", "2", "4", "6" (input to loss).
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


MLP_ORDER = ("0", "2", "4", "6")
