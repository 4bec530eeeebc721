"""The non-finite guardrail on a real store across many rollout ticks: a long trial's checks
read only what is new, and still judge every reading, a late one included."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pandas as pd

from collectors import Point, TimeSeriesStore
from collectors.names import (
    ATTR_SEEDANCE_CONFIG_VERSION,
    ATTR_SEEDANCE_NONFINITE_WHAT,
    ATTR_SEEDANCE_RANK,
    ATTR_SERVICE_NAME,
    TRAIN_LOSS,
    TRAIN_NONFINITE_STEPS,
)
from tuner import Change, NonFiniteValues

JOB, VERSION = "guarded", 3
NS = 1_000_000_000
T0 = 1_760_000_000 * NS
CHANGE = Change(id="c1", job=JOB, state="observing", source="trial", reason="r", risk="low",
                scope="live", values={}, baseline={}, created_at_s=0.0, expires_at_s=1.0)


class CountingReader:
    """The store, counting the rows each query returns: what a check costs. With
    ``bounds=False`` it hides the store's value bounds, as a reader without them (Prometheus)
    has none."""

    def __init__(self, store: TimeSeriesStore, *, bounds: bool = True) -> None:
        self.store = store
        self.rows = 0
        if not bounds:
            self.value_bounds = None

    def query(self, name: str, *, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None,
              resolution: str = "auto") -> pd.DataFrame:
        frame = self.store.query(name, where=where, since_ns=since_ns, until_ns=until_ns,
                                 resolution=resolution)  # type: ignore[arg-type]
        self.rows += len(frame)
        return frame

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def export(store: TimeSeriesStore, second: int, *, ranks: range = range(4),
           nonfinite: float = 0.0) -> None:
    """One export of the job's ``ranks`` at T0 + ``second``: the loss and the non-finite step
    counter (``nonfinite``: how many steps it counted; a NaN loss shows only there, as
    OpenTelemetry drops the NaN itself)."""
    t = T0 + second * NS
    store.write([p for rank in ranks for p in (
        Point(TRAIN_LOSS, 2.0, t, {ATTR_SERVICE_NAME: JOB, ATTR_SEEDANCE_RANK: str(rank),
                                   ATTR_SEEDANCE_CONFIG_VERSION: str(VERSION)}),
        Point(TRAIN_NONFINITE_STEPS, nonfinite, t,
              {ATTR_SERVICE_NAME: JOB, ATTR_SEEDANCE_RANK: str(rank),
               ATTR_SEEDANCE_CONFIG_VERSION: str(VERSION),
               ATTR_SEEDANCE_NONFINITE_WHAT: "loss"}))])
    store.flush()


def test_later_checks_read_only_recent_readings_and_a_new_nan_trips_at_once(
        tmp_path: Path) -> None:
    with TimeSeriesStore(tmp_path / "m.db") as store:
        reader = CountingReader(store, bounds=False)
        guard = NonFiniteValues(overlap_s=10.0, full_every=1000)
        for second in range(0, 600, 5):  # ten minutes of healthy readings
            export(store, second)
        assert guard.check(CHANGE, VERSION, reader) is None  # the first check reads it all
        whole = reader.rows
        for second in range(600, 630, 5):
            export(store, second)
            reader.rows = 0
            assert guard.check(CHANGE, VERSION, reader) is None
            assert reader.rows < whole / 10  # the last overlap and the new export only
        export(store, 630, nonfinite=1.0)
        trip = guard.check(CHANGE, VERSION, reader)
    assert trip is not None and trip.kind == "full" and "non-finite loss" in trip.reason


def test_on_the_store_a_healthy_check_reads_no_points_and_a_new_nan_trips_at_once(
        tmp_path: Path) -> None:
    """The store's value bounds answer every check of a healthy version (one aggregate per
    metric, whatever the version's length); the first doubtful reading is judged point by
    point."""
    with TimeSeriesStore(tmp_path / "m.db") as store:
        reader = CountingReader(store)
        guard = NonFiniteValues(overlap_s=10.0, full_every=3)
        for second in range(0, 600, 5):
            export(store, second)
            if second % 60 == 0:
                store.fold()
        for second in range(600, 630, 5):
            export(store, second)
            assert guard.check(CHANGE, VERSION, reader) is None
        assert reader.rows == 0
        export(store, 630, nonfinite=1.0)
        trip = guard.check(CHANGE, VERSION, reader)
    assert trip is not None and trip.kind == "full" and "non-finite loss" in trip.reason
    assert reader.rows > 0


def test_a_reading_later_than_the_overlap_is_judged_by_the_next_full_check(
        tmp_path: Path) -> None:
    with TimeSeriesStore(tmp_path / "m.db") as store:
        guard = NonFiniteValues(overlap_s=10.0, full_every=4)
        for second in range(0, 300, 5):
            export(store, second)
        assert guard.check(CHANGE, VERSION, store) is None
        export(store, 100, ranks=range(4, 5), nonfinite=1.0)  # a rank held back for minutes
        trips = [guard.check(CHANGE, VERSION, store) for _ in range(4)]
    assert trips[:3] == [None, None, None]  # the recent checks do not reach back that far
    assert trips[3] is not None and "non-finite loss" in trips[3].reason


def test_each_change_and_version_is_checked_whole_first(tmp_path: Path) -> None:
    with TimeSeriesStore(tmp_path / "m.db") as store:
        guard = NonFiniteValues(overlap_s=10.0, full_every=1000)
        for second in range(0, 300, 5):
            export(store, second)
        assert guard.check(CHANGE, VERSION, store) is None
        export(store, 100, ranks=range(4, 5), nonfinite=1.0)
        assert guard.check(CHANGE, VERSION, store) is None  # recent only: not reached yet
        assert guard.check(CHANGE, VERSION - 1, store) is None  # nothing of v2 stored
        trip = guard.check(replace(CHANGE, id="c2"), VERSION, store)
    assert trip is not None and "non-finite loss" in trip.reason
