"""Store windows: one conformance suite over the in-memory FrameStore and the real store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from collectors import Point
from policies import FrameStore, StoreWindow, WindowSource

T0 = 1_700_000_000 * 10**9  # a recent instant: the real store prunes by wall-clock age
S = 10**9


def _points() -> list[Point]:
    points = []
    for i in range(10):
        t = T0 + i * S
        for job in ("train-a", "train-b"):
            points.append(Point("seedance.train.loss", 1.0 / (i + 1), t,
                                {"service.name": job, "seedance.rank": "0"}))
        points.append(Point("hw.gpu.utilization", 0.1 * i, t, {"gpu.index": "0"}))
    return points


@pytest.fixture(params=["frames", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    if request.param == "frames":
        yield FrameStore.from_points(_points())
        return
    from collectors._store import TimeSeriesStore

    with TimeSeriesStore(tmp_path / "ts.db", raw_retention_s=None) as real:
        real.write(_points())
        real.flush()
        yield real


def test_window_keeps_its_job_and_host_level_series(store: object) -> None:
    w = StoreWindow(store, job="train-a", since_ns=T0 + 2 * S, until_ns=T0 + 5 * S)  # type: ignore[arg-type]
    loss = w.query("seedance.train.loss")
    assert set(loss["service.name"]) == {"train-a"}
    assert loss["value"].tolist() == pytest.approx([1 / 3, 1 / 4, 1 / 5, 1 / 6])  # inclusive
    assert isinstance(loss["time"].dtype, pd.DatetimeTZDtype)
    gpu = w.query("hw.gpu.utilization")  # no job attribute: kept
    assert len(gpu) == 4


def test_query_bounds_are_clipped_to_the_window(store: object) -> None:
    w = StoreWindow(store, job="train-b", since_ns=T0 + 2 * S, until_ns=T0 + 5 * S)  # type: ignore[arg-type]
    assert len(w.query("seedance.train.loss", since_ns=T0, until_ns=T0 + 9 * S)) == 4
    assert len(w.query("seedance.train.loss", since_ns=T0 + 4 * S)) == 2
    assert w.query("seedance.train.loss", since_ns=T0 + 7 * S).empty


def test_where_and_unknown_names(store: object) -> None:
    w = StoreWindow(store, job="train-a", since_ns=T0, until_ns=T0 + 9 * S)  # type: ignore[arg-type]
    assert len(w.query("seedance.train.loss", where={"seedance.rank": "0"})) == 10
    assert w.query("seedance.train.loss", where={"seedance.rank": "1"}).empty
    assert w.query("no.such.metric").empty


def test_window_source_discovers_jobs(store: object) -> None:
    source = WindowSource(store)  # type: ignore[arg-type]
    assert source.jobs() == ["train-a", "train-b"]
    assert WindowSource(store, jobs=["x"]).jobs() == ["x"]  # type: ignore[arg-type]
    window = source.window("train-b", T0, T0 + S)
    assert (window.job, window.since_ns, window.until_ns) == ("train-b", T0, T0 + S)


def test_window_source_lists_jobs_from_its_store_and_reads_windows_from_its_reader(
        store: object) -> None:
    """A sidecar reading a fleet's Prometheus judges the jobs that report to it (its store
    lists them) on the series the reader holds; a job only the reader knows is not judged."""
    elsewhere = FrameStore.from_points([
        Point("seedance.train.loss", 7.0, T0 + i * S, {"service.name": job, "seedance.rank": "0"})
        for i in range(3) for job in ("train-a", "other-sidecars-job")])
    source = WindowSource(store, reader=elsewhere)  # type: ignore[arg-type]
    assert source.jobs() == ["train-a", "train-b"]
    window = source.window("train-a", T0, T0 + 9 * S)
    assert set(window.query("seedance.train.loss")["value"]) == {7.0}
    assert source.window("train-b", T0, T0 + 9 * S).query("seedance.train.loss").empty


@pytest.mark.parametrize("kind", ["frames", "sqlite"])
def test_window_source_lists_only_jobs_active_since_the_window_start(
        kind: str, tmp_path: Path) -> None:
    """A job gone quiet long ago is not evaluated again and again, and listing jobs does not
    cost more with every series a store ever held."""
    points = [*_points(), Point("seedance.train.loss", 1.0, T0 - 100 * S,
                                {"service.name": "gone", "seedance.rank": "0"})]
    if kind == "frames":
        store: object = FrameStore.from_points(points)
    else:
        from collectors._store import TimeSeriesStore

        store = TimeSeriesStore(tmp_path / "ts.db", raw_retention_s=None)
        store.write(points)  # type: ignore[attr-defined]
        store.flush()  # type: ignore[attr-defined]
    source = WindowSource(store)  # type: ignore[arg-type]
    assert source.jobs() == ["gone", "train-a", "train-b"]
    assert source.jobs(active_since_ns=T0) == ["train-a", "train-b"]
    assert store.series("seedance.train.loss", active_since_ns=T0 + 9 * S) == [  # type: ignore[attr-defined]
        {"service.name": "train-a", "seedance.rank": "0"},
        {"service.name": "train-b", "seedance.rank": "0"}]
    if kind == "sqlite":
        store.close()  # type: ignore[attr-defined]


def test_frame_store_accepts_datetime_frames_and_rejects_bad_ones() -> None:
    frame = pd.DataFrame({"time": pd.to_datetime([T0, T0 + S], unit="ns", utc=True),
                          "value": [1, 2], "gpu.index": ["0", "1"]})
    fs = FrameStore({"m": frame})
    assert fs.query("m", where={"gpu.index": "1"})["value"].tolist() == [2.0]
    assert fs.series("m") == [{"gpu.index": "0"}, {"gpu.index": "1"}]
    with pytest.raises(ValueError, match="value"):
        FrameStore({"m": frame.drop(columns="value")})


@pytest.mark.parametrize("kind", ["frames", "sqlite"])
def test_attribute_values_span_every_metric_once_and_skip_series_without_it(
        kind: str, tmp_path: Path) -> None:
    points = [Point("seedance.train.loss", 1.0, T0, {"service.name": "b", "seedance.rank": "0"}),
              Point("seedance.train.step", 1.0, T0, {"service.name": "b", "seedance.rank": "1"}),
              Point("gpu.util", 1.0, T0 + S, {"service.name": "a", "gpu.index": "0"}),
              Point("host.cpu", 1.0, T0 + 2 * S, {"host.name": "n1"})]
    if kind == "frames":
        store: object = FrameStore.from_points(points)
    else:
        from collectors._store import TimeSeriesStore

        store = TimeSeriesStore(tmp_path / "ts.db", raw_retention_s=None)
        store.write(points)  # type: ignore[attr-defined]
    assert store.attribute_values("service.name") == ["a", "b"]  # type: ignore[attr-defined]
    assert store.attribute_values("seedance.rank") == ["0", "1"]  # type: ignore[attr-defined]
    assert store.attribute_values(  # type: ignore[attr-defined]
        "service.name", active_since_ns=T0 + S) == ["a"]
    assert store.attribute_values("no.such") == []  # type: ignore[attr-defined]
    if kind == "sqlite":
        store.close()  # type: ignore[attr-defined]
