"""Detectors read the model as the job runs it (the profiler's forward order and dtypes), not
as the tuner's knobs say: a group cast to fp16 by hand, outside ``precision.<group>``, is named
as the cause of an underflow, and no suggestion sets a knob to the value it already holds.

The jobs are real (a residual-free MLP on this CPU under a GradScaler with a tiny loss scale,
the real instrumentation, profiler and OTel set-up into a real store); the one thing chosen by
hand is the fault: group "4" runs under ``torch.autocast(float16)`` from step 6.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from collectors.torch_profile import CACHE_ENV, ModuleGroupProfiler, ProfilerConfig
from policies import StoreWindow
from policies.detectors import GradientUnderflowDetector, UnderflowConfig
from policies.detectors._model_view import computes_in, forward_order
from tests.policies.training_jobs import MLP_ORDER, close_readers, mlp, store_run

FAULT_AT = 6


class AutocastHalf(nn.Module):
    """Runs its module under fp16 autocast: what a user does by hand to one layer."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return self.inner(x).float()


def _run(tmp_path: Path, *, knob_precision: str | None) -> StoreWindow:
    """The job; ``knob_precision`` is the precision its points say its knobs hold
    (``seedance.precision``; None: it says nothing)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-30, growth_interval=10**6)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    with store_run(tmp_path) as run:
        attributes = {} if knob_precision is None else {"seedance.precision": knob_precision}
        instr = run.instrument(model, opt, version=1, grad_scaler=scaler,
                               attributes=attributes)
        profiler = ModuleGroupProfiler(model, {g: (g,) for g in MLP_ORDER},
                                       run.telemetry.meter("test"),
                                       config=ProfilerConfig(every_n_steps=2),
                                       speedups={"fp32": 1.0})
        for step in range(16):
            if step == FAULT_AT:
                model[4] = AutocastHalf(model[4])
                profiler.close()
                profiler = ModuleGroupProfiler(model, {g: (g,) for g in MLP_ORDER},
                                               run.telemetry.meter("test"),
                                               config=ProfilerConfig(every_n_steps=2),
                                               speedups={"fp32": 1.0})
            with profiler.step(step), instr.step(samples=32):
                loss = nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                instr.after_backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                instr.record_loss(loss)
            run.export()
        profiler.close()
        return run.window()


@pytest.fixture(autouse=True)
def _quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    close_readers()


def test_the_profiler_sees_the_hand_cast_and_the_order(tmp_path: Path) -> None:
    window = _run(tmp_path, knob_precision=None)
    assert forward_order(window) == MLP_ORDER
    seen = computes_in(window)
    assert seen["4"] == {"fp16"} and seen["0"] == seen["6"] == {"fp32"}


def test_a_group_cast_by_hand_is_named_as_the_cause(tmp_path: Path) -> None:
    window = _run(tmp_path, knob_precision=None)
    findings = GradientUnderflowDetector(UnderflowConfig()).evaluate(window)
    assert len(findings) == 1, [f.evidence.summary for f in findings]
    finding = findings[0]
    assert finding.resource["module_group"] == "4"
    assert "computes in fp16" in finding.evidence.summary
    assert [(c.knob, c.value) for c in finding.suggested_changes] == [("precision.4", "fp32")]


def test_no_suggestion_sets_a_knob_to_the_value_it_holds(tmp_path: Path) -> None:
    window = _run(tmp_path, knob_precision="fp32")
    (finding,) = GradientUnderflowDetector(UnderflowConfig()).evaluate(window)
    assert finding.resource["module_group"] == "4"
    assert "precision.4 holds fp32" in finding.evidence.summary
    assert not [c for c in finding.suggested_changes if c.knob == "precision.4"]
