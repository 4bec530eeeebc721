"""Training-side detectors: unit cases over hand-built frames, then real torch jobs on CPU.

Frames built here by hand are SYNTHETIC (labelled per test); the integration tests train real
models with the real instrumentation exporting through the OTel SDK into a real store file.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from collectors import Point, TimeSeriesStore
from policies import Detector, FrameStore, StoreWindow
from policies.detectors import (
    BATCH_SIZE_ATTR,
    PRECISION_ATTR,
    CollapseConfig,
    GradientCollapseDetector,
    GradientUnderflowDetector,
    InputBoundDetector,
    NonFiniteDetector,
    SmallBatchPrecisionDetector,
    UnderflowConfig,
    article_collapse_step,
    locate_cause,
)

JOB = "train-a"
S = 10**9
BASE = {"service.name": JOB, "seedance.rank": "0"}


def _window(rows: dict[str, list[dict[str, object]]]) -> StoreWindow:
    store = FrameStore({name: pd.DataFrame(r) for name, r in rows.items()})
    return StoreWindow(store, job=JOB, since_ns=0, until_ns=10**6 * S)


def _steps_frame(values: dict[str, list[float]], *, repeat: int = 1,
                 attrs: dict[str, dict[str, str]] | None = None
                 ) -> dict[str, list[dict[str, object]]]:
    """SYNTHETIC per-step gauges: ``values[name][i]`` is step i; each step exported ``repeat``
    times (as the SDK re-exports a gauge until the next step sets it)."""
    n = max(len(v) for v in values.values())
    rows: dict[str, list[dict[str, object]]] = {"seedance.train.step": []}
    for i in range(n):
        for r in range(repeat):
            t = (i * repeat + r) * S
            rows["seedance.train.step"].append({"time": t, "value": i, **BASE})
            for name, series in values.items():
                metric, _, group = name.partition("@")
                extra = {"seedance.module_group": group} if group else {}
                extra.update((attrs or {}).get(name, {}))
                if i < len(series):
                    rows.setdefault(metric, []).append(
                        {"time": t, "value": series[i], **BASE, **extra})
    return rows


# -- the seed's collapse rule ----------------------------------------------------------------

def test_seed_rule_fires_at_the_first_step_where_both_conditions_hold() -> None:
    # ratios < 0.05 from step 2 on, three in a row first at step 4; the variance of the last 5
    # norms first drops below 1e-8 at step 7 (window 1e-5 .. 1e-13): that is the step.
    norms = [1.0, 1.0, 1e-3, 1e-5, 1e-7, 1e-9, 1e-11, 1e-13, 1e-15]
    assert article_collapse_step(norms) == 7
    assert article_collapse_step(norms[:7]) is None
    assert np.var(norms[2:7]) > 1e-8 > np.var(norms[3:8])  # why not earlier: the variance


def test_seed_rule_needs_three_ratios_in_a_row_and_skips_zero_predecessors() -> None:
    assert article_collapse_step([1.0] * 20) is None
    tiny = [1e-6, 1e-6, 1e-6, 1e-6, 1e-6, 4e-8, 1e-6, 4e-8, 1e-6]  # variance tiny, ratios not
    assert article_collapse_step(tiny) is None
    flushed = [1.0, 1.0, 1e-3, 0.0, 0.0, 0.0, 0.0, 0.0]  # ratio after a zero is undefined
    assert article_collapse_step(flushed) is None
    assert article_collapse_step([5e-5, 1e-6, 1e-8, 1e-10, 1e-12]) == 4  # earliest possible step
    loose = CollapseConfig(ratio_below=0.5, consecutive=2, variance_below=1.0, variance_window=3)
    assert article_collapse_step([1.0, 0.4, 0.1], loose) == 2


@given(st.lists(st.sampled_from([1.0, 0.3, 1e-2, 1e-4, 1e-6, 1e-8, 1e-10, 1e-12, 0.0,
                                 math.inf, math.nan]), max_size=14))
def test_seed_rule_flags_no_later_and_no_earlier(norms: list[float]) -> None:
    t = article_collapse_step(norms)
    if t is None:
        assert all(article_collapse_step(norms[:k]) is None for k in range(len(norms)))
        return
    assert article_collapse_step(norms[:t + 1]) == t  # holds with only the past
    assert article_collapse_step(norms[:t]) is None  # and not before
    assert article_collapse_step(norms + [1.0, 0.0]) == t  # the future does not move it


def test_collapse_detector_counts_steps_not_exports() -> None:
    """SYNTHETIC frames: each step exported 3 times; the finding names step 7 as the seed."""
    norms = [1.0, 1.0, 1e-3, 1e-5, 1e-7, 1e-9, 1e-11, 1e-13]
    findings = GradientCollapseDetector().evaluate(
        _window(_steps_frame({"seedance.train.grad.norm": norms}, repeat=3)))
    assert len(findings) == 1
    f = findings[0]
    assert (f.severity, f.resource) == ("critical", {"seedance.rank": "0"})
    assert f.evidence.value("collapse_step") == 7
    assert f.evidence.value("norm_variance") == pytest.approx(np.var(norms[3:8]))
    assert f.evidence.value("max_norm_ratio") == pytest.approx(0.01)
    assert {c.knob for c in f.suggested_changes} == {"checkpoint.restore", "precision"}


def test_collapse_detector_is_quiet_on_healthy_and_flushed_norms() -> None:
    """SYNTHETIC frames: a slow healthy decay, and a flush to exact zero (underflow's case)."""
    healthy = list(np.linspace(2.0, 0.5, 40))
    flushed = [1.0, 1.0, 1e-3] + [0.0] * 10
    for norms in (healthy, flushed):
        assert GradientCollapseDetector().evaluate(
            _window(_steps_frame({"seedance.train.grad.norm": norms}))) == []


# -- underflow, cause, non-finite (synthetic frames) -------------------------------------------

def test_locate_cause_order_then_precision_then_ambiguous() -> None:
    assert locate_cause(["a", "b"], forward_order=("a", "b", "c"))[0] == ["b"]
    assert locate_cause(["a", "b"], precisions={"a": "fp32", "b": "fp16"})[0] == ["b"]
    causes, how = locate_cause(["b", "a"])
    assert causes == ["a", "b"] and how.startswith("ambiguous")
    assert locate_cause(["b"]) == (["b"], "the only bad group")


def test_underflow_cause_from_a_precision_attribute() -> None:
    """SYNTHETIC frames: ffn drops to fp16 at step 6 and zeroes; attention upstream starves."""
    n = 12
    frames = _steps_frame({
        "seedance.train.grad.group_norm@attention": [0.2] * 6 + [0.0] * 6,
        "seedance.train.grad.group_norm@ffn": [0.3] * 6 + [0.0] * 6,
        "seedance.train.grad.group_norm@head": [0.9] * n,
        "seedance.train.grad.norm": [0.97] * 6 + [0.9] * 6,
    }, attrs={"seedance.train.grad.group_norm@ffn": {PRECISION_ATTR: "fp16"},
              "seedance.train.grad.group_norm@attention": {PRECISION_ATTR: "fp32"},
              "seedance.train.grad.group_norm@head": {PRECISION_ATTR: "fp32"}})
    findings = GradientUnderflowDetector().evaluate(_window(frames))
    assert len(findings) == 1
    f = findings[0]
    assert f.resource == {"seedance.rank": "0", "module_group": "ffn"}
    assert "starved upstream: attention" in f.evidence.summary
    assert f.evidence.value("ffn.onset_step") == 6
    assert f.evidence.value("ffn.zero_norm_steps") == 6
    assert f.evidence.value("global_norm_after") == pytest.approx(0.9)
    assert [(c.knob, c.value) for c in f.suggested_changes] == [("precision.ffn", "fp32")]


def test_underflow_is_quiet_for_groups_without_gradients_and_healthy_groups() -> None:
    """SYNTHETIC frames: an unused group reports norm 0 and zero fraction 0 (no elements)."""
    frames = _steps_frame({
        "seedance.train.grad.group_norm@unused": [0.0] * 10,
        "seedance.train.grad.zero_fraction@unused": [0.0] * 10,
        "seedance.train.grad.group_norm@ffn": list(np.linspace(0.5, 0.2, 10)),
        "seedance.train.grad.zero_fraction@ffn": [0.001] * 10,
        "seedance.train.grad_scaler.scale": [65536.0] * 5 + [32768.0] * 5,  # one back-off
    })
    assert GradientUnderflowDetector().evaluate(_window(frames)) == []


def test_among_hundreds_of_groups_only_the_flushed_and_the_partly_flushed_are_named() -> None:
    """SYNTHETIC frames, a model of 300 module groups: g007 flushes to zero at step 5, g150's
    exactly-zero fraction rises to 0.8 while its norm stays up; g200 was zero and recovered,
    g250 is zero but was never non-zero and computes no zeros (no gradients)."""
    n = 10
    series: dict[str, list[float]] = {}
    for i in range(300):
        g = f"g{i:03d}"
        norm, fraction = [0.5] * n, [0.01] * n
        if g == "g007":
            norm = [0.5] * 5 + [0.0] * 5
        elif g == "g150":
            fraction = [0.0] * 5 + [0.8] * 5
        elif g == "g200":
            norm = [0.0] * 5 + [0.5] * 5
        elif g == "g250":
            norm, fraction = [0.0] * n, [0.0] * n
        series[f"seedance.train.grad.group_norm@{g}"] = norm
        series[f"seedance.train.grad.zero_fraction@{g}"] = fraction
    order = tuple(f"g{i:03d}" for i in range(300))
    (f,) = GradientUnderflowDetector(UnderflowConfig(forward_order=order)).evaluate(
        _window(_steps_frame(series)))
    assert f.resource["module_group"] == "g150"
    assert f.evidence.summary.count("starved upstream: g007;") == 1
    assert f.evidence.value("g150.zero_fraction_rise") == pytest.approx(0.8)


def test_a_loss_scale_backing_off_step_after_step_is_flagged() -> None:
    """SYNTHETIC frames: the scale halves 6 steps running."""
    scales = [2.0**20] * 4 + [2.0**(19 - i) for i in range(6)]
    frames = _steps_frame({"seedance.train.grad_scaler.scale": scales,
                           "seedance.train.grad.group_norm@ffn": [0.3] * 10})
    (f,) = GradientUnderflowDetector(UnderflowConfig(scale_backoffs=5)).evaluate(_window(frames))
    assert f.evidence.value("scale_backoff_streak") == 6
    assert GradientUnderflowDetector(UnderflowConfig(scale_backoffs=7)).evaluate(
        _window(frames)) == []


def test_non_finite_with_a_grad_scaler_tolerates_routine_overflows() -> None:
    """SYNTHETIC frames: with a scaler, 2 overflowing steps are routine, 3 in a row are not."""
    def frames(bad: int) -> StoreWindow:
        grads = [1.0] * 5 + [math.inf] * bad
        return _window(_steps_frame({"seedance.train.grad.norm": grads,
                                     "seedance.train.loss": [2.0] * len(grads),
                                     "seedance.train.grad_scaler.scale": [1024.0] * len(grads)}))
    assert NonFiniteDetector().evaluate(frames(2)) == []
    (f,) = NonFiniteDetector().evaluate(frames(3))
    assert f.evidence.value("nonfinite_grad_run") == 3
    assert f.evidence.value("first_nonfinite_step") == 5


def test_non_finite_elements_in_one_group_of_one_rank_name_that_rank_and_group() -> None:
    """SYNTHETIC frames, 2 ranks x 100 module groups: rank 1's g042 counts non-finite
    gradient elements from step 6; every other group of both ranks stays finite."""
    rows: dict[str, list[dict[str, object]]] = {}
    for rank in ("0", "1"):
        series: dict[str, list[float]] = {"seedance.train.loss": [2.0] * 10}
        for i in range(100):
            g = f"g{i:03d}"
            bad = rank == "1" and g == "g042"
            series[f"seedance.train.grad.group_norm@{g}"] = [0.5] * 10
            series[f"seedance.train.grad.nonfinite@{g}"] = [0.0] * 6 + [7.0 if bad else 0.0] * 4
        for name, part in _steps_frame(series).items():
            rows.setdefault(name, []).extend({**r, "seedance.rank": rank} for r in part)
    (f,) = NonFiniteDetector().evaluate(_window(rows))
    assert f.resource["seedance.rank"] == "1"
    assert "g042" in f.resource.values()
    assert f.evidence.value("nonfinite_elements_max") == 7.0




@given(ranks=st.integers(1, 2), steps=st.integers(3, 10), repeat=st.integers(1, 2),
       scaler=st.booleans(), at_rank=st.integers(0, 1), at=st.integers(0, 9),
       length=st.integers(1, 6), bad=st.sampled_from([math.nan, math.inf, -math.inf]),
       anomaly=st.sampled_from(["none", "loss", "grad_norm", "elements", "counter",
                                "scale_falls", "scale_grows"]))
@example(ranks=2, steps=6, repeat=2, scaler=False, at_rank=1, at=2, length=2, bad=math.nan,
         anomaly="loss")
@example(ranks=2, steps=6, repeat=2, scaler=False, at_rank=1, at=2, length=2, bad=math.nan,
         anomaly="grad_norm")
@example(ranks=2, steps=6, repeat=2, scaler=False, at_rank=1, at=2, length=2, bad=math.nan,
         anomaly="elements")
@example(ranks=2, steps=6, repeat=2, scaler=False, at_rank=1, at=2, length=2, bad=math.nan,
         anomaly="counter")
@example(ranks=2, steps=6, repeat=2, scaler=True, at_rank=1, at=2, length=2, bad=math.nan,
         anomaly="scale_falls")
@example(ranks=2, steps=6, repeat=2, scaler=True, at_rank=1, at=2, length=2, bad=math.nan,
         anomaly="scale_grows")
def test_the_non_finite_shortcut_skips_only_windows_with_no_finding(
        ranks: int, steps: int, repeat: int, scaler: bool, at_rank: int, at: int, length: int,
        bad: float, anomaly: str) -> None:
    """SYNTHETIC frames: healthy ranks, one of which may carry one anomaly over ``length``
    steps from ``at`` (a falling scale falls at every step from ``at`` on). Whenever the raw
    readings let ``evaluate`` skip the per-step judgement, that judgement finds nothing; and
    ``evaluate`` always agrees with it (frames and a real store: :func:`_shortcut_agrees`)."""
    from policies.detectors._nonfinite import nothing_nonfinite
    rows: dict[str, list[dict[str, object]]] = {}
    for rank in range(ranks):
        series = {"seedance.train.loss": [2.0] * steps, "seedance.train.grad.norm": [1.0] * steps,
                  "seedance.train.grad.nonfinite@ffn": [0.0] * steps,
                  "seedance.train.nonfinite_steps": [0.0] * steps}
        if scaler:
            series["seedance.train.grad_scaler.scale"] = [1024.0] * steps
        span = range(at % steps, min(at % steps + length, steps))
        for k, i in enumerate(span if rank == at_rank % ranks else ()):
            if anomaly in ("loss", "grad_norm"):
                series[f"seedance.train.{anomaly.replace('_', '.')}"][i] = bad
            elif anomaly == "elements":
                series["seedance.train.grad.nonfinite@ffn"][i] = 5.0
            elif anomaly == "counter":
                series["seedance.train.nonfinite_steps"][i:] = [float(k + 1)] * (steps - i)
            elif anomaly == "scale_grows" and scaler:
                series["seedance.train.grad_scaler.scale"][i:] = [2048.0] * (steps - i)
        if anomaly == "scale_falls" and scaler and rank == at_rank % ranks:  # to the end
            series["seedance.train.grad_scaler.scale"] = [
                1024.0 / 2 ** max(0, i - at % steps) for i in range(steps)]
        frames = _steps_frame(series, repeat=repeat, attrs={"seedance.train.nonfinite_steps": {
            "seedance.nonfinite.what": "grad_norm"}})
        for name, part in frames.items():
            rows.setdefault(name, []).extend({**r, "seedance.rank": str(rank)} for r in part)
    _shortcut_agrees(rows, NonFiniteDetector(), nothing_nonfinite, (at % steps) * repeat * S)


@given(ranks=st.integers(1, 2), steps=st.integers(3, 10), repeat=st.integers(1, 2),
       scaler=st.booleans(), at_rank=st.integers(0, 1), at=st.integers(0, 9),
       length=st.integers(1, 6), rise=st.sampled_from([0.2, 0.5, 0.9]),
       anomaly=st.sampled_from(["none", "zero_norms", "fraction_rises", "scale_falls",
                                "scale_grows", "norm_shrinks"]))
@example(ranks=2, steps=6, repeat=2, scaler=False, at_rank=1, at=2, length=4, rise=0.5,
         anomaly="zero_norms")
@example(ranks=2, steps=6, repeat=1, scaler=False, at_rank=1, at=2, length=2, rise=0.5,
         anomaly="fraction_rises")
@example(ranks=2, steps=9, repeat=1, scaler=True, at_rank=1, at=2, length=2, rise=0.5,
         anomaly="scale_falls")
@example(ranks=1, steps=6, repeat=1, scaler=True, at_rank=0, at=2, length=2, rise=0.5,
         anomaly="scale_grows")
def test_the_underflow_shortcut_skips_only_windows_with_no_finding(
        ranks: int, steps: int, repeat: int, scaler: bool, at_rank: int, at: int, length: int,
        rise: float, anomaly: str) -> None:
    """SYNTHETIC frames: healthy ranks of three module groups, one of which may carry one
    anomaly on group ``mlp`` over ``length`` steps from ``at`` (a falling scale falls at every
    step from ``at`` on, a zeroed group stays zero). Whenever the raw readings let
    ``evaluate`` skip the per-step judgement, that judgement finds nothing; and ``evaluate``
    always agrees with it. The same holds where the readings sit in a real store, half in
    folded chunks (whose value bounds the shortcut reads) and half in its journal, and a
    window that ends before the anomaly (:func:`_shortcut_agrees`)."""
    from policies.detectors._underflow import nothing_underflowing
    rows: dict[str, list[dict[str, object]]] = {}
    for rank in range(ranks):
        series = {"seedance.train.grad.norm": [1.0] * steps}
        for group in ("embed", "mlp", "head"):
            series[f"seedance.train.grad.group_norm@{group}"] = [0.5] * steps
            series[f"seedance.train.grad.zero_fraction@{group}"] = [0.1] * steps
        if scaler:
            series["seedance.train.grad_scaler.scale"] = [1024.0] * steps
        start = at % steps
        if rank == at_rank % ranks:
            span = range(start, min(start + length, steps))
            if anomaly == "zero_norms":
                series["seedance.train.grad.group_norm@mlp"][start:] = [0.0] * (steps - start)
            elif anomaly == "norm_shrinks":
                for i in span:
                    series["seedance.train.grad.group_norm@mlp"][i] = 1e-30
            elif anomaly == "fraction_rises":
                for i in span:
                    series["seedance.train.grad.zero_fraction@mlp"][i] = 0.1 + rise
            elif anomaly == "scale_grows" and scaler:
                series["seedance.train.grad_scaler.scale"][start:] = [2048.0] * (steps - start)
            elif anomaly == "scale_falls" and scaler:
                series["seedance.train.grad_scaler.scale"] = [
                    1024.0 / 2 ** max(0, i - start) for i in range(steps)]
        for name, part in _steps_frame(series, repeat=repeat).items():
            rows.setdefault(name, []).extend({**r, "seedance.rank": str(rank)} for r in part)
    detector = GradientUnderflowDetector(UnderflowConfig(zero_fraction_rise=rise))
    _shortcut_agrees(rows, detector, lambda w: nothing_underflowing(w, detector.config),
                     start * repeat * S)


def _shortcut_agrees(rows: dict[str, list[dict[str, object]]], detector: Detector,
                     shortcut: Callable[[StoreWindow], bool], early_end_ns: int) -> None:
    """Whenever ``shortcut`` lets ``evaluate`` skip ``judge``, ``judge`` finds nothing, and
    ``evaluate`` agrees with ``judge``: over frames, and over a real store (half the readings
    folded into chunks, whose value bounds the shortcut reads, half in its journal) for the
    whole window and for one that ends at ``early_end_ns``, before any anomaly."""
    with tempfile.TemporaryDirectory(prefix="shortcut-") as folder, \
            _stored(rows, Path(folder) / "metrics.db") as store:
        for window in (_window(rows), *(StoreWindow(store, job=JOB, since_ns=0, until_ns=end)
                                        for end in (10**6 * S, early_end_ns))):
            judged = detector.judge(window)  # type: ignore[attr-defined]
            if shortcut(window):
                assert judged == []
            assert len(detector.evaluate(window)) == len(judged)


def _stored(rows: dict[str, list[dict[str, object]]], path: Path) -> TimeSeriesStore:
    """A real store holding ``rows``: the first half of each metric's rows folded into
    chunks, the rest left in the journal, as a live sidecar's store holds a window."""
    store = TimeSeriesStore(path, raw_retention_s=None, rollup_1m_retention_s=None,
                            rollup_1h_retention_s=None)
    points = {name: [Point(name, float(r["value"]), int(r["time"]),  # type: ignore[arg-type, call-overload]
                           {k: str(v) for k, v in r.items() if k not in ("time", "value")})
                     for r in part] for name, part in rows.items()}
    store.write(p for part in points.values() for p in part[:len(part) // 2])
    store.flush()
    store.fold()
    store.write(p for part in points.values() for p in part[len(part) // 2:])
    store.flush()
    return store


# -- small-batch precision and input-bound (synthetic histograms) ------------------------------

def _histograms(phases: list[tuple[dict[str, str], int, float, float]]
                ) -> dict[str, list[dict[str, object]]]:
    """SYNTHETIC cumulative histograms: per phase (attributes, steps, step_s, wait_s), one
    export per step as the SDK writes them (``.sum`` and ``.count`` per series)."""
    rows: dict[str, list[dict[str, object]]] = {}
    t = 0
    for attrs, steps, step_s, wait_s in phases:
        for i in range(1, steps + 1):
            t += S
            for name, each in (("seedance.train.step.duration", step_s),
                               ("seedance.train.data_wait.duration", wait_s)):
                rows.setdefault(f"{name}.sum", []).append(
                    {"time": t, "value": each * i, **BASE, **attrs})
                rows.setdefault(f"{name}.count", []).append(
                    {"time": t, "value": float(i), **BASE, **attrs})
    return rows


def _phase(version: int, precision: str, batch: int) -> dict[str, str]:
    return {"seedance.config.version": str(version), PRECISION_ATTR: precision,
            BATCH_SIZE_ATTR: str(batch)}


def test_small_batch_precision_flags_reduced_precision_that_is_not_faster() -> None:
    """SYNTHETIC histograms: bf16 steps 0.12 s against fp32 0.10 s at batch 4."""
    window = _window(_histograms([(_phase(1, "fp32", 4), 20, 0.10, 0.0),
                                  (_phase(2, "bf16", 4), 20, 0.12, 0.0)]))
    (f,) = SmallBatchPrecisionDetector().evaluate(window)
    # each series' first export is its baseline: 19 steps of each are measured
    assert f.evidence.value("fp32_step_time") == pytest.approx(0.10)
    assert f.evidence.value("bf16_step_time") == pytest.approx(0.12)
    assert f.evidence.value("fp32_steps") == f.evidence.value("bf16_steps") == 19
    assert f.evidence.value("step_time_ratio") == pytest.approx(1.2)
    assert [(c.knob, c.value) for c in f.suggested_changes] == [("precision", "fp32")]


@pytest.mark.parametrize("phases", [
    [(_phase(1, "fp32", 4), 20, 0.10, 0.0), (_phase(2, "bf16", 4), 20, 0.07, 0.0)],  # faster
    [(_phase(1, "fp32", 32), 20, 0.10, 0.0), (_phase(2, "bf16", 32), 20, 0.12, 0.0)],  # big
    [(_phase(1, "bf16", 4), 20, 0.12, 0.0)],  # nothing to compare with
], ids=["bf16-faster", "large-batch", "no-fp32-baseline"])
def test_small_batch_precision_stays_quiet(phases: list) -> None:
    """SYNTHETIC histograms."""
    assert SmallBatchPrecisionDetector().evaluate(_window(_histograms(phases))) == []


def test_input_bound_on_synthetic_histograms() -> None:
    """SYNTHETIC histograms: 30 ms wait per 100 ms step is bound, 10 ms is not."""
    (f,) = InputBoundDetector().evaluate(_window(_histograms([({}, 20, 0.1, 0.03)])))
    assert f.evidence.value("wait_ratio") == pytest.approx(0.3)
    assert InputBoundDetector().evaluate(_window(_histograms([({}, 20, 0.1, 0.01)]))) == []


# -- real torch jobs on CPU through the real instrumentation and store ----------------------------

ALL_TRAINING = (GradientCollapseDetector, GradientUnderflowDetector, NonFiniteDetector,
                SmallBatchPrecisionDetector, InputBoundDetector)


@pytest.fixture
def torch_threads() -> object:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the box is shared; one thread keeps step times steadier
    yield torch
    torch.set_num_threads(before)
    from tests.policies.training_jobs import close_readers

    close_readers()


def _mlp_steps(tmp_path: Path, *, lower_at: int | None, steps: int = 16, lr: float = 0.01,
               scale: float = 2.0**-30) -> StoreWindow:
    """A residual-free MLP under a GradScaler with a tiny loss scale; from step ``lower_at``
    (config version 2) group "4" computes in fp16 via a local cast."""
    import torch
    from torch import nn

    from tests.policies.training_jobs import HalfLinear, mlp, store_run

    with store_run(tmp_path) as run:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**6)
        instr = run.instrument(model, opt, version=1, grad_scaler=scaler)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        for step in range(steps):
            if step == lower_at:
                model[4] = HalfLinear(model[4])
                instr.config_version = 2
            with instr.step(samples=32):
                loss = nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                instr.after_backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                instr.record_loss(loss)
            run.export()
        return run.window()


@pytest.mark.integration
def test_real_fp16_underflow_names_the_lowered_group(tmp_path: Path, torch_threads: object
                                                     ) -> None:
    from tests.policies.training_jobs import MLP_ORDER

    window = _mlp_steps(tmp_path, lower_at=8)
    (f,) = GradientUnderflowDetector(UnderflowConfig(forward_order=MLP_ORDER)).evaluate(window)
    assert f.resource == {"seedance.rank": "0", "module_group": "4"}
    assert "starved upstream: 0, 2" in f.evidence.summary
    assert "config version 2" in f.evidence.summary
    assert f.evidence.value("4.zero_norm_steps") == 8
    assert f.evidence.value("4.zero_fraction") == 1.0
    assert f.evidence.value("4.last_nonzero_norm") > 0
    assert f.evidence.value("global_norm_after") > 0  # the loss-side group still learns
    assert [(c.knob, c.value) for c in f.suggested_changes] == [("precision.4", "fp32")]
    # the seed's own rule cannot see it: the norms of the starved groups hit exactly zero
    assert GradientCollapseDetector().evaluate(window) == []
    # without the forward order the cause is honestly ambiguous among the zeroed groups
    (blind,) = GradientUnderflowDetector().evaluate(window)
    assert blind.resource["module_group"] == "0,2,4"


@pytest.mark.integration
def test_real_fp32_run_under_the_same_tiny_scale_is_healthy(tmp_path: Path,
                                                            torch_threads: object) -> None:
    window = _mlp_steps(tmp_path, lower_at=None)
    for detector in ALL_TRAINING:
        assert detector().evaluate(window) == [], detector.__name__


@pytest.mark.integration
def test_real_fp16_loss_scale_backing_off_is_flagged(tmp_path: Path, torch_threads: object
                                                     ) -> None:
    """A huge initial scale overflows the fp16 group every step: the scaler skips and halves."""
    from tests.policies.training_jobs import MLP_ORDER

    window = _mlp_steps(tmp_path, lower_at=0, steps=10, scale=2.0**60)
    (under,) = GradientUnderflowDetector(UnderflowConfig(forward_order=MLP_ORDER)
                                         ).evaluate(window)
    assert under.evidence.value("scale_backoff_streak") >= 5
    (nonfinite,) = NonFiniteDetector(forward_order_config()).evaluate(window)
    # the SDK drops the infinite norms themselves; the element counts and the scale remain
    assert nonfinite.evidence.value("scale_backoff_streak") >= 3
    assert nonfinite.evidence.value("nonfinite_elements_max") > 0
    assert nonfinite.resource.get("module_group") == "4"


def forward_order_config() -> object:
    from policies.detectors import NonFiniteConfig
    from tests.policies.training_jobs import MLP_ORDER

    return NonFiniteConfig(forward_order=MLP_ORDER)


def _blow_up(tmp_path: Path, lr: float, steps: int = 12
             ) -> tuple[StoreWindow, list[float], list[bool]]:
    """Returns the window, each step's loss and whether each step's gradients were finite."""
    import torch
    from torch import nn

    from tests.policies.training_jobs import mlp, store_run

    with store_run(tmp_path) as run:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        instr = run.instrument(model, opt, version=1)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 16, generator=g), 100 * torch.randn(32, 4, generator=g)
        losses, finite = [], []
        for _ in range(steps):
            with instr.step(samples=32):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                finite.append(all(bool(p.grad.isfinite().all()) for p in model.parameters()))
                instr.after_backward()
                opt.step()
                opt.zero_grad()
                instr.record_loss(loss)
            losses.append(float(loss))
            run.export()
        return run.window(), losses, finite


@pytest.mark.integration
def test_real_learning_rate_blow_up_is_non_finite(tmp_path: Path, torch_threads: object) -> None:
    window, losses, finite = _blow_up(tmp_path, lr=50.0)
    assert not np.isfinite(losses).all()  # the job really diverged
    (f,) = NonFiniteDetector().evaluate(window)
    assert f.severity == "critical"
    # the SDK drops the NaN loss and norms; the non-finite element counts carry it
    assert f.evidence.value("nonfinite_elements_max") > 0
    assert f.evidence.value("first_nonfinite_step") == finite.index(False)
    assert {c.knob: c.value for c in f.suggested_changes}["optimizer.lr"] == pytest.approx(5.0)
    window, losses, finite = _blow_up(tmp_path / "ok", lr=1e-3)
    assert np.isfinite(losses).all() and all(finite)
    assert NonFiniteDetector().evaluate(window) == []


def _loader_run(tmp_path: Path, sleep_s: float | None, steps: int = 12) -> StoreWindow:
    """Batches from a DataLoader whose items each sleep ``sleep_s``, or (None) from batches
    already in memory."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from tests.policies.training_jobs import mlp, store_run

    class Slow(Dataset):
        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(sleep_s)  # a real slow source: decoding, a remote read
            return torch.randn(16), torch.randn(4)

    with store_run(tmp_path) as run:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        instr = run.instrument(model, opt, version=1)
        batches = (iter(DataLoader(Slow(), batch_size=8, num_workers=0)) if sleep_s is not None
                   else iter([(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(steps)]))
        for _ in range(steps):
            with instr.data_wait():
                x, y = next(batches)
            with instr.step(samples=8):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                instr.after_backward()
                opt.step()
                opt.zero_grad()
            run.export()
        return run.window()


@pytest.mark.integration
def test_real_slow_loader_is_input_bound(tmp_path: Path, torch_threads: object) -> None:
    (f,) = InputBoundDetector().evaluate(_loader_run(tmp_path, sleep_s=0.005))
    assert f.evidence.value("wait_ratio") > 0.2
    assert f.evidence.value("mean_wait_per_batch") >= 8 * 0.005
    assert {c.knob for c in f.suggested_changes} == {"dataloader.num_workers",
                                                     "dataloader.prefetch_factor"}
    assert InputBoundDetector().evaluate(_loader_run(tmp_path / "fast", sleep_s=None)) == []


@pytest.mark.integration
def test_real_small_batch_bf16_against_fp32(tmp_path: Path, torch_threads: object) -> None:
    """Tiny GPT at batch 2 on CPU, bf16 autocast and fp32 interleaved over four config
    versions. The verdict must match what the test itself timed: on this kind of CPU the casts
    make bf16 slower at this size (measured about 1.5x); where bf16 is clearly faster the
    detector must stay quiet."""
    import torch

    from tests.policies.training_jobs import store_run
    from workloads.gpt import GPT, GPTConfig

    cfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    timed: dict[str, list[float]] = {"fp32": [], "bf16": []}
    with store_run(tmp_path) as run:
        for version, precision in enumerate(("fp32", "bf16", "fp32", "bf16"), start=1):
            instr = run.instrument(model, opt, version=version,
                                   attributes={PRECISION_ATTR: precision, BATCH_SIZE_ATTR: "2"})
            for i in range(12):
                start = time.perf_counter()
                with instr.step(tokens=x.numel(), samples=2):
                    with torch.autocast("cpu", dtype=torch.bfloat16,
                                        enabled=precision == "bf16"):
                        loss = model(x, x.roll(-1, dims=1))
                    loss.backward()
                    instr.after_backward()
                    opt.step()
                    opt.zero_grad()
                if i:  # the first export of each series is the detector's baseline
                    timed[precision].append(time.perf_counter() - start)
                run.export()
        window = run.window()
    detector = SmallBatchPrecisionDetector()
    ratio = float(np.mean(timed["bf16"]) / np.mean(timed["fp32"]))
    print(f"bf16/fp32 step time at batch 2, measured by the test: {ratio:.2f}")
    findings = detector.evaluate(window)
    bound = 1 - detector.config.min_speedup
    if ratio > bound + 0.05:
        (f,) = findings
        # the test's span holds the instrumented one (plus exporting the gauges), so the
        # detector's step times are a little shorter and its ratio a little further from 1
        for precision in ("fp32", "bf16"):
            seen = f.evidence.value(f"{precision}_step_time")
            assert 0.5 * np.mean(timed[precision]) < seen <= np.mean(timed[precision])
        assert f.evidence.value("step_time_ratio") > bound
        assert f.evidence.value("bf16_tokens_per_second") > 0
        assert f.evidence.value("fp32_steps") == len(timed["fp32"])
        assert [(c.knob, c.value) for c in f.suggested_changes] == [("precision", "fp32")]
    elif ratio < bound - 0.05:
        assert findings == []


@pytest.mark.integration
def test_real_demo_gpt_run_raises_no_training_finding(tmp_path: Path, torch_threads: object
                                                      ) -> None:
    """The demo Trainer (its GPT scaled down to fit the test's time) for 120 steps, judged
    every 20 steps over the last 40 by every training detector: nothing is wrong, nothing
    is found."""
    from policies.detectors._steps import STEP
    from tests.policies.training_jobs import store_run
    from workloads.gpt import GPTConfig
    from workloads.train import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(steps=120, global_batch=4, micro_batch=4, seq_len=32,
                                  threads=1),
                      model_config=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64))
    with store_run(tmp_path) as run:
        instr = run.instrument(trainer.model, trainer.optimizer, version=1,
                               grad_scaler=trainer.scaler)
        losses = []
        for _ in range(trainer.config.steps):
            losses.append(float(trainer.step(instr)))
            run.export()
        times = run.window().query(STEP)["time"].astype("int64").to_numpy()
        windows = [run.window(int(times[end - 40]), int(times[end - 1]))
                   for end in range(40, len(times) + 1, 20)]
    assert losses[-1] < losses[0]  # it really trained
    assert len(windows) == 5
    detectors: list[Detector] = [d() for d in ALL_TRAINING]
    for window in windows:
        for detector in detectors:
            assert detector.evaluate(window) == [], (detector.name, window.since_ns)


@pytest.mark.integration
def test_a_nan_loss_with_finite_gradients_reaches_the_detector_and_the_guardrail(
        tmp_path: Path, torch_threads: object) -> None:
    """Regression: OpenTelemetry drops NaN gauge values, so a NaN loss never reached the
    store; the job's non-finite step counter now carries it to the detector and to the
    rollout guardrail (``NonFiniteValues``, which runs the same detector on the version)."""
    import torch
    from torch import nn

    from tests.policies.training_jobs import JOB, mlp, store_run
    from tuner import Change, NonFiniteValues

    with store_run(tmp_path) as run:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        instr = run.instrument(model, opt, version=3)
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        for step in range(6):
            with instr.step(samples=8):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                instr.after_backward()
                opt.step()
                opt.zero_grad()
                instr.record_loss(float("nan") if step >= 3 else loss)
            run.export()
        window = run.window()
        run.store.flush()
        assert window.query("seedance.train.loss")["value"].notna().all()  # NaN never stored
        (finding,) = NonFiniteDetector().evaluate(window)
        assert finding.evidence.value("nonfinite_loss_steps") > 0
        change = Change(id="c", job=JOB, state="observing", source="trial", reason="r",
                        risk="low", scope="live", values={}, baseline={}, created_at_s=0.0,
                        expires_at_s=1.0)
        trip = NonFiniteValues().check(change, 3, run.store)
        assert trip is not None and trip.kind == "full" and "loss" in trip.reason
        assert NonFiniteValues().check(change, 2, run.store) is None  # another version
