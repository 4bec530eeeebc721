"""Every ``collectors.StoreReader`` the sidecar reads series from keeps one contract: the frame's
columns, only the metric, range and attributes asked for, an empty frame with the same columns
for a metric without points, and the same resolutions.

Each reader is fed the same known series the way it gets data in production: the embedded
store is written to (a real SQLite file), Prometheus scrapes the sidecar's ``/metrics``
exposition (a real server; the ``prometheus_binary`` fixture skips it when the binary is
missing). Prometheus stamps samples with its own scrape times, so the contract is checked on
values, attributes and bounds, never on exact timestamps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np
import pandas as pd
import pytest

from collectors import (
    DecodedMetrics,
    LatestValueCollector,
    MetricInfo,
    MetricKind,
    Point,
    PrometheusSource,
    Resolution,
    SeedanceError,
    StoreReader,
    Temporality,
    TimeSeriesStore,
    serve_metrics,
)
from tests.servers import free_port, start_prometheus, wait_for

NS = 1_000_000_000
JOB = "service.name"
RANK = "seedance.rank"
TOKENS = "seedance.train.tokens_per_second"
LOSS = "seedance.train.loss"
ABSENT = "hw.power"
"""A catalogued metric no reader is fed: a reader answers it with an empty frame."""
KNOWN: dict[tuple[str, str], float] = {(TOKENS, "job-a"): 100.0, (TOKENS, "job-b"): 200.0,
                                       (LOSS, "job-a"): 3.0}
"""(metric, job) -> the constant value of that series; every series has rank 0."""
RAW_COLUMNS = ["time", "value"]
ROLLUP_COLUMNS = ["time", "value", "min", "max", "count", "last"]
STEP_S = {"1m": 60, "1h": 3600}


@dataclass(frozen=True)
class Fed:
    """A reader holding the KNOWN series, all in [since_ns, until_ns], with points both before
    and after ``inside_ns``."""

    reader: StoreReader
    since_ns: int
    inside_ns: int
    until_ns: int


def _points(time_ns: int) -> list[Point]:
    return [Point(name, value, time_ns, {JOB: job, RANK: "0"})
            for (name, job), value in KNOWN.items()]


def _embedded_store(directory: Path) -> Iterator[Fed]:
    t0 = time.time_ns() // NS * NS - 10 * NS
    with TimeSeriesStore(directory / "metrics.db") as store:
        for i in range(5):
            store.write(_points(t0 + i * NS))
        yield Fed(store, since_ns=t0 - NS, inside_ns=t0 + 2 * NS, until_ns=t0 + 5 * NS)


def _prometheus(binary: str, directory: Path) -> Iterator[Fed]:
    """The sidecar's exposition of the KNOWN series, scraped every second by a real server."""
    from prometheus_client import CollectorRegistry

    collector = LatestValueCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    infos = {name: MetricInfo(name=name, kind=MetricKind.GAUGE, otlp_type="gauge", unit="1",
                              description="", monotonic=False,
                              temporality=Temporality.UNSPECIFIED)
             for name, _ in KNOWN}
    since_ns = time.time_ns() - NS
    collector.update(DecodedMetrics(points=_points(since_ns), metrics=infos))
    port = free_port()
    server = serve_metrics(registry, port)
    proc, api = start_prometheus(binary, directory, f"127.0.0.1:{port}")
    try:
        for promql in ('seedance_train_tokens_per_second{service_name="job-b"}',
                       'seedance_train_loss{service_name="job-a"}'):
            wait_for(api, promql, proc, time.monotonic() + 30, directory / "prometheus.log")
        time.sleep(3.5)  # a few more scrapes: points on both sides of inside_ns
        until_ns = time.time_ns()
        with PrometheusSource(api, timeout_s=10) as reader:
            yield Fed(reader, since_ns=since_ns, inside_ns=until_ns - 3 * NS // 2,
                      until_ns=until_ns)
    finally:
        proc.terminate()
        proc.wait(10)
        server.stop()


@pytest.fixture(scope="module", params=[
    "embedded_store", pytest.param("prometheus", marks=pytest.mark.integration)])
def fed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Fed]:
    """Each reader, fed once per module (Prometheus takes seconds to start and scrape)."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "prometheus":
        yield from _prometheus(request.getfixturevalue("prometheus_binary"), directory)
    else:
        yield from _embedded_store(directory)


def _query(fed: Fed, name: str, resolution: Resolution = "raw", *,
           where: dict[str, str] | None = None, since_ns: int | None = None) -> pd.DataFrame:
    """``name`` up to ``fed.until_ns``, from ``since_ns`` (default: ``fed.since_ns``)."""
    since_ns = fed.since_ns if since_ns is None else since_ns
    return fed.reader.query(name, where=where, since_ns=since_ns, until_ns=fed.until_ns,
                            resolution=resolution)


def _times_ns(frame: pd.DataFrame) -> np.ndarray:
    return pd.DatetimeIndex(frame["time"]).asi8


def _assert_frame_shape(frame: pd.DataFrame, leading: list[str]) -> None:
    assert list(frame.columns[:len(leading)]) == leading
    assert isinstance(frame["time"].dtype, pd.DatetimeTZDtype)
    assert str(frame["time"].dtype) == "datetime64[ns, UTC]"
    assert frame["value"].dtype == np.float64
    if "count" in leading:
        assert frame["count"].dtype == np.int64
    for column in frame.columns[len(leading):]:
        assert pd.api.types.is_string_dtype(frame[column]), column
    assert (np.diff(_times_ns(frame)) >= 0).all(), "sorted by time"


def test_raw_frame_columns_and_attributes(fed: Fed) -> None:
    frame = _query(fed, TOKENS)
    _assert_frame_shape(frame, RAW_COLUMNS)
    assert set(frame.columns) == {*RAW_COLUMNS, JOB, RANK}
    assert set(frame[JOB]) == {"job-a", "job-b"} and set(frame[RANK]) == {"0"}
    assert len(frame) > 0


def test_only_the_metric_asked_for(fed: Fed) -> None:
    tokens, loss = _query(fed, TOKENS), _query(fed, LOSS)
    assert set(tokens["value"]) == {100.0, 200.0}
    assert set(loss["value"]) == {3.0} and set(loss[JOB]) == {"job-a"}


def test_only_the_attributes_asked_for(fed: Fed) -> None:
    for job in ("job-a", "job-b"):
        frame = _query(fed, TOKENS, where={JOB: job})
        assert len(frame) > 0 and set(frame[JOB]) == {job}
        assert set(frame["value"]) == {KNOWN[(TOKENS, job)]}
    both = _query(fed, TOKENS, where={JOB: "job-b", RANK: "0"})
    assert set(both["value"]) == {200.0}
    assert _query(fed, TOKENS, where={JOB: "job-c"}).empty
    assert _query(fed, TOKENS, where={JOB: "job-a", RANK: "1"}).empty


def test_only_the_time_range_asked_for(fed: Fed) -> None:
    whole = _query(fed, TOKENS, where={JOB: "job-a"})
    later = _query(fed, TOKENS, where={JOB: "job-a"}, since_ns=fed.inside_ns)
    assert 0 < len(later) < len(whole)
    assert (_times_ns(whole) >= fed.since_ns).all() and (_times_ns(whole) <= fed.until_ns).all()
    assert (_times_ns(later) >= fed.inside_ns).all()
    before = fed.reader.query(TOKENS, since_ns=fed.since_ns - 600 * NS,
                              until_ns=fed.since_ns - 300 * NS, resolution="raw")
    assert before.empty


def test_an_open_range_reads_everything_the_reader_holds(fed: Fed) -> None:
    """No bounds: the store reads all it holds, Prometheus its lookback up to now; either way
    every point of the bounded range, and only the metric and attributes asked for."""
    bounded = _query(fed, TOKENS, where={JOB: "job-a"})
    unbounded = fed.reader.query(TOKENS, where={JOB: "job-a"}, resolution="raw")
    _assert_frame_shape(unbounded, RAW_COLUMNS)
    assert set(_times_ns(bounded)) <= set(_times_ns(unbounded))
    assert set(unbounded["value"]) == {100.0} and set(unbounded[JOB]) == {"job-a"}


@pytest.mark.parametrize("resolution", ["raw", "1m", "1h", "auto"])
def test_a_metric_without_points_is_an_empty_frame_with_the_columns(
        fed: Fed, resolution: Resolution) -> None:
    frame = _query(fed, ABSENT, resolution)
    assert frame.empty
    _assert_frame_shape(frame, ROLLUP_COLUMNS if resolution in STEP_S else RAW_COLUMNS)


@pytest.mark.parametrize("resolution", ["1m", "1h"])
def test_rollups_are_buckets_overlapping_the_range(fed: Fed, resolution: Resolution) -> None:
    frame = _query(fed, TOKENS, resolution, where={JOB: "job-b"}, since_ns=fed.inside_ns)
    _assert_frame_shape(frame, ROLLUP_COLUMNS)
    assert len(frame) > 0 and set(frame[JOB]) == {"job-b"}
    for column in ("value", "min", "max", "last"):
        assert set(frame[column]) == {200.0}, column
    assert (frame["count"] >= 1).all()
    start_ns = _times_ns(frame)
    assert (start_ns + STEP_S[resolution] * NS >= fed.inside_ns).all()
    assert (start_ns <= fed.until_ns).all()


def test_the_resolutions_accepted(fed: Fed) -> None:
    """Every ``Resolution`` is answered (``auto`` over seconds reads raw points); any other
    is refused with a ``SeedanceError``. From ``inside_ns``: a Prometheus rollup bucket ends
    at an evaluation time, the first of which is the range's start."""
    for resolution in get_args(Resolution):
        frame = _query(fed, TOKENS, resolution, since_ns=fed.inside_ns)
        assert len(frame) > 0, resolution
        _assert_frame_shape(frame, ROLLUP_COLUMNS if resolution in STEP_S else RAW_COLUMNS)
    assert list(_query(fed, TOKENS, "auto").columns) == list(_query(fed, TOKENS).columns)
    with pytest.raises(SeedanceError, match="resolution"):
        _query(fed, TOKENS, "5m")  # type: ignore[arg-type]
