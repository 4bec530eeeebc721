"""Serving windows by config version: generated tokens/s, p99 and quality after warm-up, from
points shaped as the OTel SDK exports the serving instrumentation (cumulative per version)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from collectors._points import CONFIG_VERSION_ATTR, Point
from collectors._store import TimeSeriesStore
from policies import histogram_quantile
from tuner._compare import compare
from tuner._measure import measure_window
from tuner._windows import MeasureConfig, Window, windows_from_json

NS = 1_000_000_000
JOB = "serve"
BOUNDS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, math.inf)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TimeSeriesStore]:
    with TimeSeriesStore(tmp_path / "metrics.db") as s:
        yield s


def emit(store: TimeSeriesStore, version: int, exports: Sequence[tuple[float, int, int, float]],
         *, start_ns: int, quality: float | None = None) -> None:
    """``exports``: (seconds since start, requests finished, tokens generated, latency of each
    of those requests) per export interval; written as cumulative series of the version."""
    attrs = {"service.name": JOB, CONFIG_VERSION_ATTR: str(version), "seedance.rank": "0"}
    count, tokens, buckets, points = 0, 0, dict.fromkeys(BOUNDS, 0), []
    for at_s, requests, generated, latency_s in exports:
        t = start_ns + int(at_s * NS)
        count, tokens = count + requests, tokens + generated
        for le in BOUNDS:
            buckets[le] += requests if latency_s <= le else 0
        points += [Point("gen_ai.server.request.duration.count", float(count), t, attrs),
                   Point("seedance.serve.generation_tokens", float(tokens), t, attrs)]
        points += [Point("gen_ai.server.request.duration.bucket", float(n), t,
                         {**attrs, "le": "+Inf" if math.isinf(le) else repr(le)})
                   for le, n in buckets.items()]
        if quality is not None:
            points.append(Point("seedance.serve.quality.token_agreement", quality, t, attrs))
    store.write(points)
    store.flush()


def now_ns() -> int:
    return time.time_ns() - 3600 * NS


CONFIG = MeasureConfig(warmup_requests=10, min_requests=30)


def test_a_serving_window_excludes_warmup_and_measures_tokens_per_s_p99_and_quality(
        store: TimeSeriesStore) -> None:
    # warm-up: 10 slow requests in the first second; then 4 s of 20 req/s, 100 tokens/s
    exports = [(1.0, 10, 10, 2.0)] + [(1.0 + s, 20, 100, 0.05) for s in (1, 2, 3, 4)]
    emit(store, 3, exports, start_ns=now_ns(), quality=0.99)
    window = measure_window(store, JOB, 3, "candidate", CONFIG, kind="serve")
    assert window is not None
    assert window.steps == 80
    assert window.tokens_per_s == pytest.approx(100.0)
    assert window.step_s == pytest.approx(1 / 20)
    assert 0.04 < window.p99_s <= 0.08  # the warm-up's 2 s requests are not in it
    assert window.quality == pytest.approx(0.99)
    assert math.isnan(window.loss) and not window.nonfinite_loss
    # the training path does not see serving points
    assert measure_window(store, JOB, 3, "candidate", CONFIG) is None


def test_a_serving_window_waits_for_min_requests_after_warmup(store: TimeSeriesStore) -> None:
    emit(store, 4, [(1.0, 10, 10, 0.05), (2.0, 20, 100, 0.05)], start_ns=now_ns())
    assert measure_window(store, JOB, 4, "baseline", CONFIG, kind="serve") is None


def test_serving_windows_compare_by_tokens_per_s_and_round_trip_json(
        store: TimeSeriesStore) -> None:
    t0, windows = now_ns(), []
    for i, (version, rate) in enumerate([(10, 100), (11, 150), (12, 100), (13, 160),
                                         (14, 100)]):
        emit(store, version, [(1.0, 10, 10, 0.05)] + [(1.0 + s, 20, rate, 0.05)
                                                       for s in (1, 2, 3)],
             start_ns=t0 + i * 10 * NS)
        w = measure_window(store, JOB, version, "baseline" if i % 2 == 0
                           else "candidate", CONFIG, kind="serve")
        assert w is not None
        windows.append(w)
    result = compare(windows, CONFIG)
    # the geometric mean of the paired ratios 1.5 and 1.6
    assert result.pairs == 2 and result.gain == pytest.approx(math.sqrt(1.5 * 1.6) - 1)
    assert result.loss_ok
    again = windows_from_json([w.to_json() for w in windows])
    assert [w.p99_s for w in again] == [w.p99_s for w in windows]
    assert all(math.isnan(w.quality) for w in again)
    old = {k: v for k, v in windows[0].to_json().items() if k not in ("p99_s", "quality")}
    (legacy,) = windows_from_json([old])  # a window journaled before serving windows existed
    assert isinstance(legacy, Window) and math.isnan(legacy.p99_s)


def test_histogram_quantile_is_linear_within_the_bucket() -> None:
    buckets = {0.1: 50.0, 0.2: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.99, {0.1: 0.0, math.inf: 10.0}) == math.inf
    assert np.isnan(histogram_quantile(0.5, {}))


def test_a_serving_windows_quality_is_its_versions_counted_tokens(
        store: TimeSeriesStore) -> None:
    """The counters (synthetic, as the workload exports them) outrank the gauge's mean."""
    t0 = now_ns()
    exports = [(1.0, 10, 10, 0.05)] + [(1.0 + s, 20, 100, 0.05) for s in (1, 2, 3)]
    emit(store, 7, exports, start_ns=t0, quality=0.5)
    attrs = {"service.name": JOB, CONFIG_VERSION_ATTR: "7", "seedance.rank": "0"}
    store.write([Point("seedance.serve.quality.checked_tokens", n, t0 + i * NS, attrs)
                 for i, n in enumerate((100.0, 250.0, 400.0), start=1)]
                + [Point("seedance.serve.quality.agreeing_tokens", n, t0 + i * NS, attrs)
                   for i, n in enumerate((99.0, 247.0, 396.0), start=1)])
    store.flush()
    window = measure_window(store, JOB, 7, "candidate", CONFIG, kind="serve")
    assert window is not None
    assert (window.quality, window.quality_tokens) == (pytest.approx(0.99), 400)
    (again,) = windows_from_json([window.to_json()])
    assert again.quality_tokens == 400
