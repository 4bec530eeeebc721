"""The sidecar's sink keeps one source from taking what all share: the series limit and the
store buffer's fair share, on a real store."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from collectors._cardinality import CardinalityLimit, SeriesLimiter
from collectors._otlp_decode import DecodedMetrics
from collectors._points import Point
from collectors._store import TimeSeriesStore
from seedancectl._config import SidecarConfig
from seedancectl._sidecar import IngestBackpressure, Sidecar


def _points(job: str, n: int, *, metric: str = "m", start: int = 0) -> list[Point]:
    return [Point(metric, float(i), 10**18 + i, {"service.name": job, "id": str(start + i)})
            for i in range(n)]


def test_the_series_limit_keeps_known_series_and_counts_the_rest() -> None:
    limiter = SeriesLimiter(CardinalityLimit(max_per_metric=3, max_per_job=5))
    assert len(limiter.admit(_points("a", 5))) == 3  # per metric
    assert limiter.dropped["metric"] == 2
    assert len(limiter.admit(_points("a", 3))) == 3  # known series always get through
    assert len(limiter.admit(_points("a", 3, metric="other"))) == 2  # per job: 5 in all
    assert limiter.dropped["job"] == 1 and limiter.series() == 5
    assert len(limiter.admit(_points("b", 3, metric="other"))) == 3  # another job: its own room


def test_series_that_went_idle_free_their_room_and_active_ones_keep_theirs() -> None:
    """Each config version of a tuned job starts new series: the limit counts active ones,
    or after enough trials the next trial's telemetry would be refused."""
    now = [0.0]
    limiter = SeriesLimiter(CardinalityLimit(max_per_metric=3, max_per_job=100, idle_s=60.0),
                            clock=lambda: now[0])
    assert len(limiter.admit(_points("a", 3))) == 3  # version 1's series fill the room
    assert limiter.admit(_points("a", 1, start=3)) == []  # version 2: refused, room is full
    kept = _points("a", 1)  # series 0 goes on (a baseline that stays); 1 and 2 stop
    for _ in range(4):  # two whole generations pass with series 0 arriving every 30 s
        now[0] += 30.0
        assert limiter.admit(kept) == kept
    assert limiter.series() == 1
    assert len(limiter.admit(_points("a", 2, start=3))) == 2  # the idle ones' room is free
    assert limiter.admit(_points("a", 1, start=5)) == []  # and the limit still holds
    assert limiter.series() == 3


def test_a_job_over_half_the_buffer_waits_and_the_others_go_on(tmp_path: Path) -> None:
    sidecar = Sidecar(SidecarConfig(store=tmp_path / "m.db", nvml="off"))
    with TimeSeriesStore(tmp_path / "m.db", max_buffered_points=1000,
                         flush_interval_s=3600) as store:
        # no flush runs, so the buffer only grows (a store whose commits cannot keep up):
        # the flusher would otherwise wake at a quarter of the buffer and empty it
        store._writer.stop_flusher()
        sidecar.store = store
        for start in range(0, 700, 100):  # alone, past half: no one to be fair to
            sidecar.sink(DecodedMetrics(points=_points("greedy", 100, start=start)))
        sidecar.sink(DecodedMetrics(points=_points("polite", 10)))
        with pytest.raises(IngestBackpressure, match="greedy"):
            sidecar.sink(DecodedMetrics(points=_points("greedy", 100, start=700)))
        sidecar.sink(DecodedMetrics(points=_points("polite", 10, start=10)))
        assert store.buffered_by("service.name") == {"greedy": 700, "polite": 20}
        store.flush()  # the counts follow the buffer as it empties and fills again
        assert store.buffered_by("service.name") == {}
        sidecar.sink(DecodedMetrics(points=_points("greedy", 100, start=700)))
        assert store.buffered_by("service.name") == {"greedy": 100}
        assert store.buffered_by("seedance.rank") == {"": 100}  # counted when first asked


def test_a_job_over_its_share_is_turned_away_before_its_decode(tmp_path: Path) -> None:
    """The same fair share, judged by a body's first resource before the decode: the resource
    is only read while the buffer is over half full, and one that names no job is left to the
    check after the decode (where it counts as the unnamed job)."""
    sidecar = Sidecar(SidecarConfig(store=tmp_path / "m.db", nvml="off"))
    looks: list[str] = []

    def resource(attributes: dict[str, str] | None) -> Callable[[], dict[str, str] | None]:
        def read() -> dict[str, str] | None:
            looks.append(str(attributes))
            return attributes
        return read

    with TimeSeriesStore(tmp_path / "m.db", max_buffered_points=1000,
                         flush_interval_s=3600) as store:
        store._writer.stop_flusher()
        sidecar.store = store
        sidecar.admit(resource({"service.name": "greedy"}))
        assert looks == []  # an empty buffer: nothing to judge, nothing read
        for start in range(0, 600, 100):
            sidecar.sink(DecodedMetrics(points=_points("greedy", 100, start=start)))
        sidecar.sink(DecodedMetrics(points=_points("polite", 10)))
        with pytest.raises(IngestBackpressure, match="greedy"):
            sidecar.admit(resource({"service.name": "greedy", "seedance.rank": "3"}))
        sidecar.admit(resource({"service.name": "polite"}))
        sidecar.admit(resource({"seedance.rank": "0"}))
        sidecar.admit(resource(None))
        assert len(looks) == 4
        unnamed = [Point("m", 1.0, 10**18 + i, {"id": str(i)}) for i in range(600)]
        store.flush()
        sidecar.sink(DecodedMetrics(points=unnamed))  # the unnamed job: under half before
        sidecar.sink(DecodedMetrics(points=_points("polite", 10)))
        sidecar.admit(resource({"seedance.rank": "0"}))  # not judged before the decode...
        with pytest.raises(IngestBackpressure, match="''"):  # ...but after it
            sidecar.sink(DecodedMetrics(points=unnamed[:1]))


def test_a_job_alone_in_the_buffer_fills_it_and_its_write_at_the_limit_flushes_it(
        tmp_path: Path) -> None:
    """One sidecar per job is the usual case: refusing that job at half the buffer would idle
    all its exporters for a Retry-After while the store sits empty; at the limit the writing
    request commits the buffer itself, so memory stays bounded and nothing is refused."""
    sidecar = Sidecar(SidecarConfig(store=tmp_path / "m.db", nvml="off"))
    with TimeSeriesStore(tmp_path / "m.db", max_buffered_points=1000,
                         flush_interval_s=3600) as store:
        store._writer.stop_flusher()
        sidecar.store = store
        most, now = 0, time.time_ns()  # (recent: retention keeps every point)
        for start in range(0, 2500, 100):  # 100 series, a point each per export
            # the sidecar's own telemetry waits beside it: not a job to be fair to
            sidecar.sink(DecodedMetrics(points=_points(sidecar.config.telemetry_job, 1,
                                                      metric="own")))
            sidecar.sink(DecodedMetrics(points=[
                Point("m", 1.0, now + start + i, {"service.name": "alone", "id": str(i)})
                for i in range(100)]))
            most = max(most, store.buffered)
        assert most < 1000  # flushed at the limit, by the write that reached it
        store.flush()
        assert len(store.query("m")) == 2500
