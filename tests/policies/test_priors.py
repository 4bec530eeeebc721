"""ComputePriorsDetector: unit cases over hand-built frames, then the real profiler on CPU.

Frames built here by hand are SYNTHETIC (labelled per test). The integration test profiles a
real model with collectors.torch_profile, exports through the real OTel set-up into memory and
feeds the decoded points to the detector.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import policies.detectors
from collectors import Point
from collectors._otel import Telemetry, TelemetryConfig, setup_telemetry
from collectors.torch_profile import CACHE_ENV, ModuleGroupProfiler, ProfilerConfig
from policies import Detector, Finding, FrameStore, StoreWindow
from policies.detectors import (
    EXPECTED_GAIN,
    ComputePriorsConfig,
    ComputePriorsDetector,
    amdahl_speedup,
)
from tests.collectors.test_torch_profile import Stack, owner_groups

JOB = "train-a"
S = 10**9
BASE = {"service.name": JOB, "seedance.rank": "0"}
SHARE = "seedance.train.group.time_share"
DTYPE = "seedance.train.group.param_dtype"
SPEEDUP = "seedance.device.matmul_speedup"


def _frames(shares: dict[str, list[float]], *, speedups: dict[str, float],
            dtypes: dict[str, list[tuple[str, str]]] | None = None, version: int = 1,
            t0: int = 0) -> dict[str, list[dict[str, object]]]:
    """SYNTHETIC profiler points: ``shares[group][i]`` is sampled step i; every sample also
    carries the group's dtypes (default float32 parameters) and the device's speedups."""
    attrs = {**BASE, "seedance.config.version": str(version)}
    rows: dict[str, list[dict[str, object]]] = {SHARE: [], DTYPE: [], SPEEDUP: []}
    for group, series in shares.items():
        for i, share in enumerate(series):
            t = t0 + i * 60 * S
            rows[SHARE].append({"time": t, "value": share, **attrs,
                                "seedance.module_group": group})
            for dtype, source in (dtypes or {}).get(group, [("float32", "parameters")]):
                rows[DTYPE].append({"time": t, "value": 1.0, **attrs,
                                    "seedance.module_group": group, "seedance.dtype": dtype,
                                    "seedance.dtype.source": source})
            for dtype, speedup in speedups.items():
                rows[SPEEDUP].append({"time": t, "value": speedup, **attrs,
                                      "seedance.dtype": dtype, "hw.model": "Test GPU"})
    return rows


def _merge(*parts: dict[str, list[dict[str, object]]]) -> dict[str, list[dict[str, object]]]:
    out: dict[str, list[dict[str, object]]] = {}
    for part in parts:
        for name, rows in part.items():
            out.setdefault(name, []).extend(rows)
    return out


def _window(rows: dict[str, list[dict[str, object]]]) -> StoreWindow:
    store = FrameStore({name: pd.DataFrame(r) for name, r in rows.items() if r})
    return StoreWindow(store, job=JOB, since_ns=0, until_ns=10**6 * S)


GPU = {"float32": 1.0, "bfloat16": 2.3, "float16": 2.3}
CPU = {"float32": 1.0, "bfloat16": 0.02, "float16": 0.015}


def test_findings_rank_groups_by_expected_gain() -> None:
    """SYNTHETIC: ffn holds 72% of the forward, attention 20%, norm 3% (too little to pay)."""
    rows = _frames({"ffn": [0.70, 0.72, 0.74], "attention": [0.2, 0.2, 0.2],
                    "norm": [0.03, 0.03, 0.03]}, speedups={"float32": 1.0, "bfloat16": 2.3})
    findings = ComputePriorsDetector().evaluate(_window(rows))
    assert [f.resource for f in findings] == [{"module_group": "ffn"},
                                              {"module_group": "attention"}]
    ffn = findings[0]
    factor = 1 / (1 - 0.72 * (1 - 1 / 2.3))
    assert amdahl_speedup(0.72, 2.3) == pytest.approx(factor)
    assert ffn.evidence.value(EXPECTED_GAIN) == pytest.approx(factor - 1)
    assert ffn.evidence.value("expected_step_speedup") == pytest.approx(factor)
    assert ffn.evidence.value("group_time_share") == pytest.approx(0.72)
    assert ffn.evidence.value("samples") == 3
    assert (ffn.detector, ffn.job, ffn.severity) == ("compute_priors", JOB, "info")
    assert ffn.evidence.summary.startswith(
        "72% of forward time is in group ffn, computed in fp32; bf16 matmul measured 2.3x "
        "faster here (Test GPU); expected x1.69 step speed")
    assert [(c.knob, c.value) for c in ffn.suggested_changes] == [("precision.ffn", "bf16")]
    assert "Amdahl" in ffn.evidence.model and "proxy" in ffn.evidence.model
    assert findings[1].evidence.value(EXPECTED_GAIN) < ffn.evidence.value(EXPECTED_GAIN)
    assert Finding.from_json(ffn.to_json()) == ffn
    assert "set precision.ffn = 'bf16'" in ffn.render()


def test_min_gain_sets_what_is_worth_a_trial() -> None:
    """SYNTHETIC: norm's 3% at 2.3x buys +1.7%: below the default +2%, above a lower bound."""
    rows = _frames({"norm": [0.03]}, speedups={"float32": 1.0, "bfloat16": 2.3})
    assert ComputePriorsDetector().evaluate(_window(rows)) == []
    (finding,) = ComputePriorsDetector(ComputePriorsConfig(min_gain=0.01)).evaluate(
        _window(rows))
    assert finding.evidence.value(EXPECTED_GAIN) == pytest.approx(0.0172, abs=1e-3)
    with pytest.raises(ValueError, match="min_gain"):
        ComputePriorsConfig(min_gain=-0.1)


@pytest.mark.parametrize("speedups", [
    CPU,  # bf16 and fp16 50x slower than fp32, as on this box's CPU
    {"float32": 1.0, "bfloat16": 1.0},  # no faster is not faster
    {"float32": 1.0, "bfloat16": 0.8, "float16": 3.0},  # only fp16 pays: a person decides
])
def test_no_finding_for_a_dtype_not_faster_than_fp32(speedups: dict[str, float]) -> None:
    """SYNTHETIC: a group holding 90% of the forward, on devices where bf16 does not pay."""
    rows = _frames({"ffn": [0.9, 0.9]}, speedups=speedups)
    assert ComputePriorsDetector().evaluate(_window(rows)) == []


def test_fp16_and_fp8_are_mentioned_never_suggested() -> None:
    """SYNTHETIC: fp16 and fp8 measured faster than bf16; the suggestion is still bf16."""
    rows = _frames({"ffn": [0.6]}, speedups={"float32": 1.0, "bfloat16": 2.0,
                                             "float16": 2.5, "float8_e4m3fn": 4.0})
    (finding,) = ComputePriorsDetector().evaluate(_window(rows))
    assert [(c.knob, c.value) for c in finding.suggested_changes] == [("precision.ffn", "bf16")]
    assert finding.evidence.value("fp16_matmul_speedup") == 2.5
    assert finding.evidence.value("fp8_matmul_speedup") == 4.0
    assert "fp16 2.5x, fp8 4x also faster, not suggested" in finding.evidence.summary


def test_no_suggestion_for_a_group_already_in_bf16() -> None:
    """SYNTHETIC: ffn computes with bf16 weight copies, attention under bf16 autocast, head
    partly (float32 parameters under bf16 autocast); only norm still computes in fp32 alone."""
    rows = _frames({"ffn": [0.6], "attention": [0.2], "head": [0.1], "norm": [0.1]},
                   speedups=GPU, dtypes={
                       "ffn": [("bfloat16", "parameters")],
                       "attention": [("float32", "parameters"), ("bfloat16", "autocast")],
                       "head": [("float32", "parameters"), ("bfloat16", "parameters")]})
    findings = ComputePriorsDetector().evaluate(_window(rows))
    assert [f.resource["module_group"] for f in findings] == ["norm"]


def test_only_the_newest_config_version_is_judged() -> None:
    """SYNTHETIC: v1 had ffn in fp32; v2 moved it to bf16, so only attention remains. A job
    that already steps under v3, not yet profiled, gets no finding at all."""
    v1 = _frames({"ffn": [0.7], "attention": [0.2]}, speedups=GPU, version=1)
    v2 = _frames({"ffn": [0.5], "attention": [0.35]}, speedups=GPU, version=2, t0=120 * S,
                 dtypes={"ffn": [("bfloat16", "parameters")]})
    findings = ComputePriorsDetector().evaluate(_window(_merge(v1, v2)))
    assert [f.resource["module_group"] for f in findings] == ["attention"]
    assert findings[0].evidence.value("group_time_share") == pytest.approx(0.35)
    step = {"seedance.train.step": [{"time": 200 * S, "value": 80.0, **BASE,
                                     "seedance.config.version": "3"}]}
    assert ComputePriorsDetector().evaluate(_window(_merge(v1, v2, step))) == []


def test_missing_data_is_no_finding() -> None:
    """SYNTHETIC: without speedups, or without the group's dtypes, nothing can be judged."""
    rows = _frames({"ffn": [0.8]}, speedups=GPU)
    assert ComputePriorsDetector().evaluate(_window({SHARE: rows[SHARE], DTYPE: rows[DTYPE]})) \
        == []
    assert ComputePriorsDetector().evaluate(
        _window({SHARE: rows[SHARE], SPEEDUP: rows[SPEEDUP]})) == []
    assert ComputePriorsDetector().evaluate(_window({})) == []


def test_the_sidecar_runs_it_with_the_other_detectors() -> None:
    # seedancectl's all_detectors() builds every Detector class policies.detectors exports.
    exported = [getattr(policies.detectors, n) for n in policies.detectors.__all__]
    built = [c() for c in exported if isinstance(c, type) and issubclass(c, Detector)
             and not inspect.isabstract(c)]
    assert "compute_priors" in {d.name for d in built}


# ---- the real profiler ------------------------------------------------------------------------

@dataclass
class Job:
    """A real model whose profiler points the real OTel set-up exports into ``points``."""

    model: torch.nn.Module
    telemetry: Telemetry
    points: list[Point]

    def profiler(self, **kwargs: Any) -> ModuleGroupProfiler:
        return ModuleGroupProfiler(self.model, owner_groups(self.model),
                                   self.telemetry.meter("test"),
                                   config=ProfilerConfig(every_n_steps=2), **kwargs)

    def train(self, profiler: ModuleGroupProfiler, steps: int) -> None:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        x = torch.randn(256, 8)
        for i in range(steps):
            with profiler.step(i):
                self.model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            assert self.telemetry.force_flush()
        profiler.close()

    def window(self) -> StoreWindow:
        return StoreWindow(FrameStore.from_points(self.points), job=JOB, since_ns=0,
                           until_ns=2**62)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the box is shared; one thread keeps shares steadier
    torch.manual_seed(0)
    points: list[Point] = []
    config = TelemetryConfig(job=JOB, export_interval_s=3600.0)
    try:
        with setup_telemetry(config, store_sink=lambda d: points.extend(d.points)) as telemetry:
            yield Job(model=Stack(d=64, hidden=2048), telemetry=telemetry, points=points)
    finally:
        torch.set_num_threads(threads)


def test_real_profile_feeds_the_detector(job: Job) -> None:
    # The device's speedups are SYNTHETIC here (this CPU has no fast bf16); the profile is real.
    job.train(job.profiler(speedups={"fp32": 1.0, "bf16": 2.0, "fp16": 0.5}), 10)
    findings = ComputePriorsDetector().evaluate(job.window())
    assert findings
    top = findings[0]
    assert top.resource == {"module_group": "ffn"}
    assert [(c.knob, c.value) for c in top.suggested_changes] == [("precision.ffn", "bf16")]
    assert top.evidence.value("samples") == 5  # steps 0, 2, 4, 6, 8
    share = top.evidence.value("group_time_share")
    assert top.evidence.value(EXPECTED_GAIN) == pytest.approx(amdahl_speedup(share, 2.0) - 1)
    gains = [f.evidence.value(EXPECTED_GAIN) for f in findings]
    assert gains == sorted(gains, reverse=True)


def test_this_devices_own_speedups_decide(job: Job) -> None:
    profiler = job.profiler()  # dtype_speedups measured on this CPU
    job.train(profiler, 2)
    window = job.window()
    assert not window.query(SHARE).empty
    findings = ComputePriorsDetector().evaluate(window)
    if profiler.speedups["bf16"] <= 1.0:  # most CPUs, this box's too: bf16 is 50x slower
        assert findings == []
    else:
        assert findings[0].resource == {"module_group": "ffn"}
