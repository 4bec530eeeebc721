"""The time-series store against a real SQLite file and real second processes."""

from __future__ import annotations

import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from collectors import ValueBounds, _store_writer
from collectors import _store_codec as codec_module
from collectors._errors import SeedanceError
from collectors._otlp_decode import DecodedMetrics, Shape
from collectors._points import Point
from collectors._store import TimeSeriesStore
from collectors._store_codec import (
    decode_frame,
    decode_times,
    decode_values,
    encode_frame,
    encode_frames,
    encode_times,
    encode_values,
)
from collectors._store_file import ROWS_PER_STATEMENT, StoreError, execute_rows
from collectors._store_query import AUTO_MIN_POINTS, DecodedCache
from collectors._store_rollups import MAX_PIECES, pieces_to_merge

REPO = Path(__file__).resolve().parents[2]
NS = 1_000_000_000
T0 = 1_760_000_000 * NS  # a fixed instant; tests that prune pass their own "now"


def _store(path: Path, **kw: object) -> TimeSeriesStore:
    kw.setdefault("raw_retention_s", None)
    kw.setdefault("rollup_1m_retention_s", None)
    kw.setdefault("rollup_1h_retention_s", None)
    return TimeSeriesStore(path, **kw)  # type: ignore[arg-type]


# -- codec ---------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float64, st.integers(1, 300), elements=st.floats(allow_nan=True,
                                                                       allow_infinity=True)))
def test_values_round_trip_bit_for_bit(values: np.ndarray) -> None:
    back = decode_values(encode_values(values), values.shape[0])
    assert back.view(np.uint64).tolist() == values.view(np.uint64).tolist()


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.int64, st.integers(1, 300),
                  elements=st.integers(-(2**62), 2**62)))
def test_times_round_trip_sorted_or_not(times: np.ndarray) -> None:
    assert decode_times(encode_times(times), times.shape[0]).tolist() == times.tolist()


@st.composite
def _frames(draw: st.DrawFn) -> tuple[str, list[np.ndarray]]:
    """A kinds string and its columns, of one length; value columns of whole numbers (the
    integer transform), of any floats (XOR) or with a -0.0 among whole numbers."""
    kinds = draw(st.text(alphabet="tv", min_size=1, max_size=8))
    n = draw(st.integers(1, 40))
    columns: list[np.ndarray] = []
    for kind in kinds:
        if kind == "t":
            columns.append(draw(hnp.arrays(np.int64, n, elements=st.integers(-(2**62),
                                                                              2**62))))
        else:
            columns.append(draw(st.one_of(
                hnp.arrays(np.float64, n, elements=st.integers(-(2**40), 2**40).map(float)),
                hnp.arrays(np.float64, n, elements=st.floats(allow_nan=True,
                                                             allow_infinity=True)),
                hnp.arrays(np.float64, n, elements=st.sampled_from([0.0, -0.0, 3.0])))))
    return kinds, columns


@settings(max_examples=300, deadline=None)
@given(_frames())
def test_frames_of_mixed_columns_round_trip_each_column_bit_for_bit(
        frame: tuple[str, list[np.ndarray]]) -> None:
    """A rollup blob holds several columns, each with its own transform: a whole-number column
    beside a float one, or beside one holding -0.0, must each come back exactly."""
    kinds, columns = frame
    back = decode_frame(encode_frame(kinds, columns), kinds, columns[0].shape[0])
    for column, got in zip(columns, back, strict=True):
        assert got.view(np.uint64).tolist() == column.view(np.uint64).tolist()


@st.composite
def _batches(draw: st.DrawFn) -> tuple[str, list[list[np.ndarray]]]:
    """Frames of one kinds string and of several lengths, as a fold encodes them together."""
    kinds, first = draw(_frames())
    frames = [first]
    for _ in range(draw(st.integers(0, 6))):
        other_kinds, columns = draw(_frames())
        n = columns[0].shape[0]
        frames.append([columns[0] if k == "t" and other_kinds[0] == "t" else
                       (np.arange(n, dtype=np.int64) * 7 if k == "t" else
                        np.linspace(-1.5, 3.25, n)) for k in kinds])
    return kinds, frames


@settings(max_examples=200, deadline=None)
@given(_batches())
def test_frames_encoded_together_are_the_bytes_of_each_encoded_alone(
        batch: tuple[str, list[list[np.ndarray]]]) -> None:
    kinds, frames = batch
    blobs = encode_frames(kinds, frames)
    assert blobs == [encode_frames(kinds, [columns])[0] for columns in frames]
    for columns, blob in zip(frames, blobs, strict=True):
        back = decode_frame(blob, kinds, columns[0].shape[0])
        for column, got in zip(columns, back, strict=True):
            assert got.view(np.uint64).tolist() == column.view(np.uint64).tolist()


def test_special_values_round_trip() -> None:
    values = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 5e-324, 2.0**53, -(2.0**60)])
    back = decode_values(encode_values(values), values.shape[0])
    assert back.view(np.uint64).tolist() == values.view(np.uint64).tolist()


# -- writing and reading -------------------------------------------------------------------

def test_raw_query_round_trips_values_sorted_with_attribute_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    t = T0 + np.arange(1000) * NS
    a, b = rng.normal(size=1000), rng.integers(0, 100, 1000).astype(float)
    with _store(tmp_path / "s.db") as store:
        store.write_series("m", {"gpu": "0"}, t, a)
        store.write_series("m", {"gpu": "1", "host": "h"}, t + NS // 2, b)
        df = store.query("m", resolution="raw")
    assert list(df.columns) == ["time", "value", "gpu", "host"]
    assert str(df["time"].dtype) == "datetime64[ns, UTC]"
    assert df["time"].is_monotonic_increasing and len(df) == 2000
    gpu0 = df[df["gpu"] == "0"]
    assert gpu0["value"].to_numpy().view(np.uint64).tolist() == a.view(np.uint64).tolist()
    assert gpu0["host"].isna().all()
    assert (df[df["gpu"] == "1"]["host"] == "h").all()


def test_where_and_time_range_select_exactly(tmp_path: Path) -> None:
    t = T0 + np.arange(100) * NS
    with _store(tmp_path / "s.db") as store:
        for gpu in "012":
            store.write_series("m", {"gpu": gpu, "job": "x"}, t, np.full(100, float(gpu)))
        store.write_series("other", {"gpu": "1"}, t, np.zeros(100))
        df = store.query("m", where={"gpu": "1"}, since_ns=int(t[10]), until_ns=int(t[19]),
                         resolution="raw")
        assert store.query("m", where={"gpu": "9"}, resolution="raw").empty
        assert store.query("nothing").empty
    assert df["time"].astype("int64").tolist() == t[10:20].tolist()
    assert (df["value"] == 1.0).all() and (df["gpu"] == "1").all()


@pytest.mark.parametrize("key", ["seedance.config.version", 'we"ird', "back\\slash", "x y",
                                 "ünï"])
def test_where_matches_any_attribute_key_exactly(tmp_path: Path, key: str) -> None:
    """``where`` narrows series in SQL by a JSON path of the key: keys a path cannot quote
    are still matched, and a value that only looks alike ("1" against 1, "1 ") never is."""
    t = T0 + np.arange(5) * NS
    with _store(tmp_path / "s.db") as store:
        for value in ("1", "10", "1 ", "2"):
            store.write_series("m", {key: value, "job": "a"}, t, np.full(5, float(len(value))))
        store.write_series("m", {"job": "a"}, t, np.zeros(5))
        df = store.query("m", where={key: "1", "job": "a"}, resolution="raw")
        bounds = store.value_bounds("m", where={key: "1"}, keep=lambda _: True, since_ns=0,
                                    until_ns=2**62)
    assert df["value"].tolist() == [1.0] * 5 and (df[key] == "1").all()
    assert bounds == ValueBounds(5, 0, 1.0, 1.0, int(t[-1]))


def test_a_raw_read_of_many_series_is_every_point_in_time_then_series_order(
        tmp_path: Path) -> None:
    """Chunks and not-yet-folded points of many series, sharing instants, some attribute
    missing on some series: the read equals a frame built from the written points, sorted by
    time, then by series (creation order), then by write order."""
    rng = np.random.default_rng(11)
    written: list[tuple[dict[str, str], int, float]] = []
    with _store(tmp_path / "s.db") as store:
        for s in range(40):
            attrs = {"rank": str(s % 8), "group": f"g{s}"} | ({"extra": "x"} if s % 3 else {})
            t = T0 + rng.choice(60, size=30, replace=False) * NS  # out of order, shared
            v = rng.normal(size=30)
            store.write_series("m", attrs, t, v)
            written += [(attrs, int(a), float(b)) for a, b in zip(t, v, strict=True)]
        store.flush()
        store.fold()
        for _ in range(2):  # one point per series per flush: journal rows, some on an instant
            points = [Point("m", float(rng.normal()), T0 + int(rng.integers(0, 60)) * NS,
                            attrs) for attrs in ({"rank": str(s % 8), "group": f"g{s}"}
                                                 | ({"extra": "x"} if s % 3 else {})
                                                 for s in range(40))]
            store.write(points)
            store.flush()
            written += [(dict(p.attributes), p.time_ns, p.value) for p in points]
        got = store.query("m", since_ns=T0 + 10 * NS, until_ns=T0 + 49 * NS,
                          resolution="raw")
        order = [tuple(sorted(a.items())) for a in store.series("m")]
    rows = sorted((t, order.index(tuple(sorted(a.items()))), i, v, a)
                  for i, (a, t, v) in enumerate(written) if T0 + 10 * NS <= t <= T0 + 49 * NS)
    keys = ["extra", "group", "rank"]
    expected = pd.DataFrame({
        "time": pd.DatetimeIndex(np.array([r[0] for r in rows], "M8[ns]")).tz_localize("UTC"),
        "value": np.array([r[3] for r in rows])}
        | {k: pd.array([r[4].get(k) for r in rows], dtype="str") for k in keys})
    pd.testing.assert_frame_equal(got, expected)


def test_write_points_equals_write_series(tmp_path: Path) -> None:
    t = T0 + np.arange(50) * NS
    v = np.linspace(0, 1, 50)
    with _store(tmp_path / "a.db") as a, _store(tmp_path / "b.db") as b:
        a.write(Point("m", float(x), int(y), {"k": "v"}) for y, x in zip(t, v, strict=True))
        b.write_series("m", {"k": "v"}, t, v)
        pd.testing.assert_frame_equal(a.query("m", resolution="raw"),
                                      b.query("m", resolution="raw"))
        assert a.series("m") == [{"k": "v"}]


def test_a_window_reads_only_the_series_with_points_in_it(tmp_path: Path) -> None:
    """Each config version of a tuned job starts new series: a window's query and the list of
    active series must not cost more with every trial the job ever ran."""
    with _store(tmp_path / "m.db") as store:
        for version in range(30):  # 30 trials, 10 s each, one after the other
            t = T0 + (version * 10 + np.arange(10)) * NS
            store.write_series("m", {"seedance.config.version": str(version)}, t,
                               np.full(10, float(version)))
        store.flush()
        chunk_reads: list[str] = []
        store._file.conn.set_trace_callback(
            lambda sql: chunk_reads.append(sql) if "FROM chunks" in sql else None)
        window = store.query("m", since_ns=T0 + 285 * NS, until_ns=T0 + 299 * NS,
                             resolution="raw")
        store._file.conn.set_trace_callback(None)
        assert window["seedance.config.version"].tolist() == ["28"] * 5 + ["29"] * 10
        # One statement, which looks chunks up by series: the two versions in the window, not
        # a scan of all 30 versions' chunks.
        assert len(chunk_reads) == 1
        plan = " ".join(str(row[-1]) for row in store._file.conn.execute(
            "EXPLAIN QUERY PLAN " + chunk_reads[0]))
        assert "USING INDEX chunks_by_series" in plan and "SCAN c" not in plan, plan
        assert store.series("m", active_since_ns=T0 + 285 * NS) == [
            {"seedance.config.version": "28"}, {"seedance.config.version": "29"}]
        assert len(store.series("m")) == 30


def _expected_rollup(t: np.ndarray, v: np.ndarray, step_s: int) -> pd.DataFrame:
    frame = pd.DataFrame({"bucket": t // (step_s * NS) * (step_s * NS), "t": t, "v": v})
    frame = frame.sort_values(["bucket", "t"], kind="stable")
    g = frame.groupby("bucket")["v"]
    return pd.DataFrame({"mean": g.mean(), "min": g.min(), "max": g.max(),
                         "count": g.count(), "last": g.last()})


@pytest.mark.parametrize(("resolution", "step_s"), [("1m", 60), ("1h", 3600)])
def test_rollups_match_pandas_across_flushes_and_out_of_order(
        tmp_path: Path, resolution: str, step_s: int) -> None:
    rng = np.random.default_rng(7)
    t = T0 + np.sort(rng.integers(0, 3 * 3600 * NS, 5000))
    v = rng.normal(size=5000)
    pieces = np.array_split(rng.permutation(5000), 9)  # late points land in old buckets
    with _store(tmp_path / "s.db") as store:
        for idx in pieces:
            store.write_series("m", {}, t[idx], v[idx])
            store.flush()
        df = store.query("m", resolution=resolution)  # type: ignore[arg-type]
    expected = _expected_rollup(t, v, step_s)
    assert df["time"].astype("int64").tolist() == expected.index.tolist()
    np.testing.assert_allclose(df["value"], expected["mean"], rtol=1e-12, atol=1e-12)
    assert df["min"].tolist() == expected["min"].tolist()
    assert df["max"].tolist() == expected["max"].tolist()
    assert df["count"].tolist() == expected["count"].tolist()
    assert df["last"].tolist() == expected["last"].tolist()


def test_rollups_read_the_same_from_the_journal_as_once_folded(tmp_path: Path) -> None:
    """Flushes put rollup buckets in the journal; fold() moves them into per-series rollups.
    A query must see the same buckets before, between and after folds, for every series."""
    rng = np.random.default_rng(11)
    t = T0 + np.sort(rng.integers(0, 2 * 86_400 * NS, 3000))  # crosses a day block
    v = rng.normal(size=3000)
    series = rng.integers(0, 5, 3000)
    with _store(tmp_path / "s.db") as store:
        def frames() -> list[pd.DataFrame]:
            return [store.query("m", where={"s": str(k)}, resolution=r)  # type: ignore[arg-type]
                    for k in range(5) for r in ("1m", "1h")]

        for i, idx in enumerate(np.array_split(rng.permutation(3000), 12)):
            for k in range(5):
                mine = idx[series[idx] == k]
                store.write_series("m", {"s": str(k)}, t[mine], v[mine])
            store.flush()
            if i == 5:
                store.fold()
        from_journal = frames()
        store.fold()
        folded = frames()
    for a, b in zip(from_journal, folded, strict=True):
        pd.testing.assert_frame_equal(a, b)
    for k in range(5):
        mine = series == k
        expected = _expected_rollup(t[mine], v[mine], 60)
        assert folded[2 * k]["count"].tolist() == expected["count"].tolist()
        np.testing.assert_allclose(folded[2 * k]["value"], expected["mean"], rtol=1e-12)


def test_the_decoded_chunk_cache_stays_within_its_byte_budget() -> None:
    """Chunks of one-second flushes hold a point or two: a budget in points would let a
    million tiny entries through, so the budget counts each entry's bytes and overhead."""
    cache = DecodedCache(64 * 1024)
    decoded = 0

    def decode(i: int) -> np.ndarray:
        nonlocal decoded
        decoded += 1
        return np.array([float(i)])

    for i in range(10_000):
        assert cache.get(b"v1:%d" % i, lambda i=i: decode(i))[0] == i
    assert cache.bytes <= cache.max_bytes
    assert cache.get(b"v1:9999", lambda: decode(-1))[0] == 9999  # recent: still cached
    assert cache.get(b"v1:0", lambda: decode(-1))[0] == -1  # oldest: evicted, decoded again
    assert decoded == 10_001


def _rows(path: Path, table: str) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def test_flushes_of_one_point_per_series_write_one_journal_row_each_and_read_the_same_folded(
        tmp_path: Path) -> None:
    """An OTLP export carries each series once: a flush of 500 series x 1 point must cost one
    row, not 500 chunks, and every reader must see the same points before and after the fold."""
    path = tmp_path / "s.db"
    rng = np.random.default_rng(5)
    values = rng.normal(size=(6, 500))
    with _store(path) as store:
        store.write_series("first", {}, np.array([T0]), np.array([1.0]))
        store.flush()  # the first flush also runs retention, which folds: done with it
        for flush in range(6):
            store.write([Point("m", float(values[flush, s]), T0 + flush * NS + s,
                               {"s": str(s)}) for s in range(500)])
            store.flush()
            # each query extends the writer's view of the journal by the new row
            assert len(store.query("m", resolution="raw")) == 500 * (flush + 1)
        # a series with many points in one flush still goes straight to its chunks
        store.write_series("busy", {}, T0 + np.arange(100) * NS, np.arange(100.0))
        store.flush()
        assert _rows(path, "points_journal") == 6
        assert _rows(path, "chunks") == 2
        before = store.query("m", resolution="raw")
        with TimeSeriesStore(path, readonly=True) as reader:  # another reader, unfolded rows
            pd.testing.assert_frame_equal(reader.query("m", resolution="raw"), before)
        store.fold()
        assert _rows(path, "points_journal") == 0
        assert _rows(path, "chunks") == 502
        pd.testing.assert_frame_equal(store.query("m", resolution="raw"), before)
        assert store.query("busy", resolution="raw")["value"].tolist() == list(range(100))
    assert len(before) == 3000
    got = before.pivot(index="time", columns="s", values="value")
    for s in (0, 17, 499):
        assert got[str(s)].dropna().tolist() == values[:, s].tolist()


def test_journal_points_left_by_a_crash_are_read_and_folded_by_the_next_writer(
        tmp_path: Path) -> None:
    """A writer that dies between a flush and a fold leaves journal rows: nothing is lost."""
    path, copy = tmp_path / "s.db", tmp_path / "crashed.db"
    with _store(path) as store:
        store.flush()  # the first flush also runs retention, which folds: done with it
        store.write([Point("m", float(s), T0 + s, {"s": str(s)}) for s in range(50)])
        store.flush()
        with sqlite3.connect(path) as live, sqlite3.connect(copy) as dest:
            live.backup(dest)  # the file as a crash would leave it: flushed, not folded
    assert _rows(copy, "points_journal") == 1
    with _store(copy) as writer:
        assert sorted(writer.query("m", resolution="raw")["value"]) == list(range(50))
    assert _rows(copy, "points_journal") == 0
    with TimeSeriesStore(copy, readonly=True) as reader:
        assert sorted(reader.query("m", resolution="raw")["value"]) == list(range(50))


def test_a_format_1_store_is_read_and_upgraded_in_place(tmp_path: Path) -> None:
    """Stores written before the rollup journal (format 1) open read-only as they are, and a
    writer upgrades them with their rollups intact."""
    path = tmp_path / "old.db"
    path.write_bytes((REPO / "tests" / "data" / "demo_run" / "metrics.db").read_bytes())
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()[0] == "1"
    name = "seedance.train.loss"
    with TimeSeriesStore(path, readonly=True) as reader:
        before = reader.query(name, resolution="1m")
    assert len(before) > 0
    with TimeSeriesStore(path, readonly=True) as reader:  # format 1: no value bounds
        assert reader.value_bounds(name, keep=lambda _: True, since_ns=0,
                                   until_ns=2**62) is None
    with _store(path) as writer:
        assert writer.query(name, resolution="1m").equals(before)
        # upgraded, but its chunks predate bounds: the caller reads the points instead
        assert writer.value_bounds(name, keep=lambda _: True, since_ns=0,
                                   until_ns=2**62) is None
        writer.write([Point("later", 2.0, T0, {}), Point("later", 5.0, T0 + NS, {})])
        writer.fold()
        assert writer.value_bounds("later", keep=lambda _: True, since_ns=0,
                                   until_ns=2**62) == ValueBounds(2, 0, 2.0, 5.0, T0 + NS)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()[0] == "4"
        assert {"rollup_journal", "points_journal"} <= {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
    with TimeSeriesStore(path, readonly=True) as reader:
        pd.testing.assert_frame_equal(reader.query(name, resolution="1m"), before)


@settings(max_examples=40, deadline=None)
@given(values=hnp.arrays(np.float64, st.integers(4, 60), elements=st.floats(
           -1e6, 1e6) | st.just(math.nan)),
       folded=st.integers(0, 60), lo=st.integers(0, 60), span=st.integers(0, 60))
def test_value_bounds_hold_every_point_a_query_reads(values: np.ndarray, folded: int, lo: int,
                                                     span: int) -> None:
    """Bounds of a range contain every value a raw query of that range returns (the store
    may bound whole chunks, a superset); over every point they are exactly the points'.
    Series that ``keep`` leaves out never count, folded or in the journal."""
    n = values.shape[0]
    times = T0 + np.arange(n, dtype=np.int64) * NS
    with tempfile.TemporaryDirectory(prefix="bounds-") as folder, \
            _store(Path(folder) / "s.db") as store:
        for part in (slice(0, folded), slice(folded, n)):
            store.write([Point("m", float(v), int(t), {"job": "a", "s": str(i % 3)})
                         for i, (t, v) in enumerate(zip(times[part], values[part],
                                                        strict=True))])
            store.write([Point("m", -7e6, int(t), {"job": "b"}) for t in times[part]])
            store.flush()
            if part.start == 0:
                store.fold()
        keep_a = lambda attrs: attrs.get("job") == "a"  # noqa: E731
        whole = store.value_bounds("m", keep=keep_a, since_ns=T0, until_ns=T0 + n * NS)
        assert whole == ValueBounds.of(values, times)
        since, until = T0 + lo * NS, T0 + (lo + span) * NS
        bounds = store.value_bounds("m", keep=keep_a, since_ns=since, until_ns=until)
        read = store.query("m", where={"job": "a"}, since_ns=since, until_ns=until,
                           resolution="raw")["value"].to_numpy()
        assert bounds is not None and bounds.points >= read.shape[0]
        assert bounds.nans >= int(np.isnan(read).sum())
        finite = read[~np.isnan(read)]
        if finite.size:
            assert bounds.low <= finite.min() and finite.max() <= bounds.high
        if read.size:
            assert bounds.latest_ns is not None and bounds.latest_ns >= since + (
                min(lo + span, n - 1) - lo) * NS
        open_ended = store.value_bounds("m", keep=keep_a, since_ns=since, until_ns=2**62)
        assert open_ended is not None
        assert open_ended.latest_ns == (int(times[-1]) if lo < n else None)


def test_auto_resolution_follows_the_documented_rule(tmp_path: Path) -> None:
    with _store(tmp_path / "s.db") as store:
        t = T0 + np.arange(0, 40 * 86400, 30) * NS
        store.write_series("m", {}, t, np.ones(t.shape[0]))

        def step_of(span_s: int) -> str:
            df = store.query("m", since_ns=T0, until_ns=T0 + span_s * NS)
            if "count" not in df.columns:
                return "raw"
            return "1h" if df["count"].max() > 60 // 30 else "1m"

        assert step_of(AUTO_MIN_POINTS * 60 - 60) == "raw"
        assert step_of(AUTO_MIN_POINTS * 60) == "1m"
        assert step_of(7 * 86400) == "1m"
        assert step_of(AUTO_MIN_POINTS * 3600) == "1h"
        assert "count" in store.query("m").columns  # whole 40-day span: rollups


def test_many_small_flushes_are_compacted_and_intact(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    t = T0 + np.arange(300) * NS
    with _store(path) as store:
        for i in range(300):
            store.write_series("m", {}, t[i:i + 1], np.array([float(i)]))
            store.flush()
        df = store.query("m", resolution="raw")
    assert df["value"].tolist() == list(map(float, range(300)))
    with sqlite3.connect(path) as conn:
        per_block = conn.execute("SELECT max(c) FROM (SELECT count(*) c FROM chunks "
                                 "GROUP BY series_id, block_ns)").fetchone()[0]
    assert per_block < 8


def test_a_block_filled_fold_by_fold_stays_intact_in_few_pieces_encoded_a_few_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-hour block of one fold a minute: merging the whole block at every 8th piece
    re-encoded each point 11 times; tiered merges must keep that near 3, lose nothing and
    keep the rollups exact."""
    encoded = {"v": 0}
    encode_frames = codec_module.encode_frames

    def counting(kinds: str, frames: list[list[np.ndarray]]) -> list[bytes]:
        if kinds == "v":
            encoded["v"] += sum(len(f[0]) for f in frames)
        return encode_frames(kinds, frames)

    monkeypatch.setattr(codec_module, "encode_frames", counting)
    rng = np.random.default_rng(11)
    block = T0 // (7200 * NS) * (7200 * NS)
    t = block + np.arange(7200) * NS
    v = np.round(rng.normal(50, 10, 7200), 3)
    path = tmp_path / "s.db"
    with _store(path) as store:
        for minute in range(120):
            part = slice(minute * 60, minute * 60 + 60)
            store.write_series("m", {"k": "a"}, t[part], v[part])
            store.flush()
            store.fold()
        with sqlite3.connect(path) as conn:
            pieces = conn.execute("SELECT count(*) FROM chunks").fetchone()[0]
            rollup_pieces = conn.execute("SELECT max(c) FROM (SELECT count(*) c FROM rollups "
                                         "GROUP BY step_s)").fetchone()[0]
        raw = store.query("m", resolution="raw")
        minute_rollup = store.query("m", resolution="1m")
    assert raw["value"].tolist() == v.tolist()
    assert raw["time"].astype("int64").tolist() == t.tolist()
    assert encoded["v"] / 7200 <= 4.0
    assert pieces <= 2 * 7 + 1 and rollup_pieces <= 4 * 8
    expected = _expected_rollup(t, v, 60)
    assert minute_rollup["count"].tolist() == expected["count"].tolist()
    assert minute_rollup["max"].tolist() == expected["max"].tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300), st.integers(0, 299))
def test_tiered_merges_keep_every_row_and_few_pieces_whatever_the_sizes(
        sizes: list[int], seal_at: int) -> None:
    pieces: list[int] = []
    for i, size in enumerate(sizes):
        sealed = i == seal_at
        take = pieces_to_merge(pieces, size, sealed)
        assert 0 <= take <= len(pieces) and (take == len(pieces) or not sealed)
        merged = size + sum(pieces[len(pieces) - take:])
        del pieces[len(pieces) - take:]
        pieces.append(merged)
        assert len(pieces) < MAX_PIECES
    assert sum(pieces) == sum(sizes)
    if seal_at < len(sizes):
        assert len(pieces) <= len(sizes) - seal_at


def _rank_shapes(*ranks: str) -> dict[str, Shape]:
    return {r: Shape([f"m{g}" for g in range(8)], [{"rank": r, "g": str(g)} for g in range(8)])
            for r in ranks}


def _export(store: TimeSeriesStore, shape: Shape, i: int) -> None:
    store.write_decoded(DecodedMetrics(shape=shape, times=np.full(8, T0 + i * NS),
                                       values=np.arange(8.0) + 100 * i))


def _assert_series(store: TimeSeriesStore, exports: dict[str, list[int]]) -> None:
    for rank, exported in exports.items():
        got = store.query("m3", where={"rank": rank}, resolution="raw")
        assert got["value"].tolist() == [3.0 + 100 * i for i in exported], rank


def test_a_repeat_shape_is_stored_under_its_own_series_after_a_commit_that_rolled_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape's series ids are kept from flush to flush; ids read in a commit that rolled back
    (its new series rows with it) must not be: another shape's series may take those ids."""
    shapes = _rank_shapes("a", "b")
    append = _store_writer.points_journal.append
    failing = [True]

    def fail_once(*args: object) -> None:
        if failing and failing.pop():
            raise sqlite3.OperationalError("disk I/O error (injected)")
        append(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_store_writer.points_journal, "append", fail_once)
    with _store(tmp_path / "s.db") as store:
        _export(store, shapes["a"], 0)
        with pytest.raises(sqlite3.OperationalError):
            store.flush()
        _export(store, shapes["b"], 1)
        store.flush()  # a's batch again, then b's
        _export(store, shapes["a"], 2)
        store.flush()
        _assert_series(store, {"a": [0, 2], "b": [1]})


def test_one_shape_written_to_two_stores_lands_under_each_stores_own_series(
        tmp_path: Path) -> None:
    shapes = _rank_shapes("a", "c")
    with _store(tmp_path / "one.db") as one, _store(tmp_path / "two.db") as two:
        _export(one, shapes["a"], 0)
        one.flush()
        _export(two, shapes["c"], 1)  # takes, in two, the ids a has in one
        _export(two, shapes["a"], 2)
        two.flush()
        _assert_series(one, {"a": [0]})
        _assert_series(two, {"a": [2], "c": [1]})


def test_series_sampled_together_share_one_timestamp_column(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    rng = np.random.default_rng(3)
    t = T0 + np.arange(3600) * NS + rng.integers(0, 10**6, 3600)  # jittery sampler
    with _store(path) as store:
        for i in range(20):
            store.write_series(f"m{i}", {}, t, np.full(3600, float(i)))
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM times").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM chunks").fetchone()[0] == 20


def test_merging_chunks_leaves_no_orphan_timestamp_columns(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    t = T0 + np.arange(200) * NS
    with _store(path) as store:
        for i in range(20):
            part = slice(i * 10, i * 10 + 10)
            store.write_series("a", {}, t[part], np.arange(200.0)[part])
            store.write_series("b", {}, t[part] if i % 3 else t[:10], np.ones(10))
            store.flush()
        a = store.query("a", resolution="raw")
        b = store.query("b", resolution="raw")
    assert a["value"].tolist() == list(np.arange(200.0)) and len(b) == 200
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM times WHERE id NOT IN "
                            "(SELECT times_id FROM chunks)").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM times").fetchone()[0] >= 1


def test_retention_prunes_raw_then_rollups(tmp_path: Path) -> None:
    now = time.time_ns() // NS * NS  # flushes prune against the wall clock too
    t = now - np.arange(0, 3 * 86400, 60)[::-1] * NS
    with TimeSeriesStore(tmp_path / "s.db", raw_retention_s=86400,
                         rollup_1m_retention_s=2 * 86400) as store:
        store.write_series("m", {}, t, np.arange(t.shape[0], dtype=float))
        store.flush()
        store.prune(now_ns=now)
        raw = store.query("m", resolution="raw")
        one_min = store.query("m", resolution="1m")
        one_hour = store.query("m", resolution="1h")
    assert raw["time"].astype("int64").min() >= now - 86400 * NS - 2 * 3600 * NS
    assert raw["time"].astype("int64").max() == now
    assert one_min["time"].astype("int64").min() >= now - 3 * 86400 * NS
    assert one_min["time"].astype("int64").min() > t[0]
    assert one_hour["count"].sum() == t.shape[0]


def test_folds_after_a_retention_pass_reuse_what_they_know_of_each_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A retention pass (once a minute) forgot every block's pieces, so the next fold looked
    each series' pieces up again, three statements a series. It forgets only the blocks it
    may have changed; a block that lost chunks to it goes on merging without losing more."""
    monkeypatch.setattr(_store_writer, "_clock", lambda: -1e9)  # prunes and folds when called
    block = T0 // (7200 * NS) * (7200 * NS)
    minutes, series = 40, 20
    t = block + np.arange(minutes * 60) * NS
    lookups: list[str] = []
    with _store(tmp_path / "s.db", raw_retention_s=3600) as store:
        store._writer._file.conn.set_trace_callback(
            lambda sql: lookups.append(sql) if sql.startswith("SELECT n FROM") else None)
        for minute in range(minutes):
            part = slice(minute * 60, minute * 60 + 60)
            for s in range(series):
                store.write_series("m", {"s": str(s)}, t[part], np.arange(60.0) + minute * 60)
            store.flush()
            first = len(lookups)
            now = int(t[part][-1]) + 3600 * NS - 25 * 60 * NS  # keeps the last 25 minutes
            store.prune(now_ns=now)
            if 2 <= minute and now - 3600 * NS < block:  # nothing of this block expired yet
                assert len(lookups) == first, f"minute {minute}: pieces looked up again"
            elif minute > 30:  # chunks of the block expire: what it knew of it is forgotten
                assert len(lookups) - first >= series, f"minute {minute}"
        raw = store.query("m", where={"s": "7"}, resolution="raw")
        one_min = store.query("m", where={"s": "7"}, resolution="1m")
    kept = raw["value"].tolist()
    assert kept == list(np.arange(minutes * 60.0)[-len(kept):])  # a whole suffix, in order
    assert len(kept) >= 25 * 60  # everything inside the retention
    assert one_min["count"].tolist() == [60] * minutes


def test_metrics_lists_names_series_points_and_range(tmp_path: Path) -> None:
    with _store(tmp_path / "s.db") as store:
        store.write_series("a", {"g": "0"}, T0 + np.arange(5) * NS, np.zeros(5))
        store.write_series("a", {"g": "1"}, T0 + np.arange(3) * NS, np.zeros(3))
        store.write_series("b", {}, np.array([T0 + 9 * NS]), np.zeros(1))
        store.flush()
    with TimeSeriesStore(tmp_path / "s.db", readonly=True) as reader:
        m = reader.metrics()
    assert m["name"].tolist() == ["a", "b"]
    assert m["series"].tolist() == [2, 1] and m["points"].tolist() == [8, 1]
    assert m["first"].iloc[0] == pd.Timestamp(T0, unit="ns", tz="UTC")
    assert m["last"].iloc[1] == pd.Timestamp(T0 + 9 * NS, unit="ns", tz="UTC")


# -- batching and threads ------------------------------------------------------------------

def _wait_for_rows(path: Path, want: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    with TimeSeriesStore(path, readonly=True) as reader:
        while True:
            got = len(reader.query("m", resolution="raw"))
            if got >= want or time.monotonic() > deadline:
                return got
            time.sleep(0.02)


def test_a_burst_of_a_quarter_of_the_buffer_is_flushed_before_the_interval(
        tmp_path: Path) -> None:
    with _store(tmp_path / "s.db", flush_interval_s=3600, max_buffered_points=4000) as store:
        store.write_series("m", {}, T0 + np.arange(999) * NS, np.ones(999))
        time.sleep(0.5)
        assert store.buffered == 999  # under a quarter: waits for the interval
        store.write_series("m", {}, T0 + np.arange(999, 1000) * NS, np.ones(1))
        deadline = time.monotonic() + 30
        while store.buffered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.buffered == 0
        with TimeSeriesStore(tmp_path / "s.db", readonly=True) as reader:
            assert len(reader.query("m", resolution="raw")) == 1000


def test_the_committed_view_reads_what_a_flush_committed_and_commits_nothing_itself(
        tmp_path: Path) -> None:
    """The policy engine's view: the buffer waits for the flusher, and reads in between see
    the committed points with the same frames as the store's own reads."""
    with _store(tmp_path / "s.db", flush_interval_s=3600) as store:
        committed = store.committed()
        store.write_series("m", {"job": "a"}, T0 + np.arange(10) * NS, np.arange(10.0))
        store.flush()
        store.write_series("m", {"job": "b"}, T0 + np.arange(10, 20) * NS, np.arange(10.0))
        seen = committed.query("m", resolution="raw")
        assert len(seen) == 10 and set(seen["job"]) == {"a"}
        assert committed.attribute_values("job") == ["a"]
        assert store.buffered == 10  # the view's reads left the buffer to the flusher
        assert _wait_for_rows(tmp_path / "s.db", 20, timeout_s=0.2) == 10
        pd.testing.assert_frame_equal(store.query("m", resolution="raw"),
                                      committed.query("m", resolution="raw"))
        assert store.buffered == 0  # the store's own read committed it first


def test_background_thread_flushes_on_interval(tmp_path: Path) -> None:
    with _store(tmp_path / "s.db", flush_interval_s=0.05) as store:
        store.write_series("m", {}, T0 + np.arange(10) * NS, np.zeros(10))
        assert _wait_for_rows(tmp_path / "s.db", 10) == 10


def test_buffer_flushes_when_full(tmp_path: Path) -> None:
    with _store(tmp_path / "s.db", flush_interval_s=3600, max_buffered_points=100) as store:
        store.write_series("m", {}, T0 + np.arange(20) * NS, np.zeros(20))
        assert _wait_for_rows(tmp_path / "s.db", 20, timeout_s=0.2) == 0
        store.write_series("m", {}, T0 + np.arange(20, 120) * NS, np.zeros(100))
        assert store.buffered == 0  # full: the write returned once a flush took the buffer
        assert _wait_for_rows(tmp_path / "s.db", 120, timeout_s=30) == 120


def test_writers_past_the_limit_leave_the_commits_to_the_flusher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer at the buffer's limit waits for the flusher to take the buffer, then goes on
    writing while it commits: a writer that committed itself held every other writer behind
    the file lock (the receiver's decode threads, at 64 exporters)."""
    committed_on: list[str] = []
    commit = _store_writer.StoreWriter._commit

    def recording(self: _store_writer.StoreWriter, batch: list[object],
                  sync_spans: bool) -> None:
        committed_on.append(threading.current_thread().name)
        time.sleep(0.02)  # a commit that takes a while, so writers meet the limit during it
        commit(self, batch, sync_spans)  # type: ignore[arg-type]

    monkeypatch.setattr(_store_writer.StoreWriter, "_commit", recording)
    with _store(tmp_path / "s.db", flush_interval_s=3600, max_buffered_points=400) as store:

        def writer(k: int) -> None:
            for i in range(100):
                store.write_series("m", {"w": str(k)}, T0 + (i * 20 + np.arange(20)) * NS,
                                   np.full(20, float(k)))

        threads = [threading.Thread(target=writer, args=(k,), name=f"writer-{k}")
                   for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        df = store.query("m", resolution="raw")
    assert len(df) == 4 * 100 * 20
    assert sorted(df.groupby("w")["value"].sum().tolist()) == [k * 2000.0 for k in range(4)]
    writers_committing = [name for name in committed_on if name.startswith("writer-")]
    assert not writers_committing, f"{len(writers_committing)} of {len(committed_on)} commits"
    assert len(committed_on) >= 5  # the limit was met over and over


def test_a_writer_past_the_limit_commits_itself_once_the_flusher_stopped(
        tmp_path: Path) -> None:
    store = _store(tmp_path / "s.db", flush_interval_s=3600, max_buffered_points=100)
    try:
        store._writer.stop_flusher()
        store.write_series("m", {}, T0 + np.arange(150) * NS, np.zeros(150))
        assert store.buffered == 0
    finally:
        store.close()
    assert _wait_for_rows(tmp_path / "s.db", 150, timeout_s=30) == 150


def test_concurrent_writer_threads_lose_nothing(tmp_path: Path) -> None:
    with _store(tmp_path / "s.db", flush_interval_s=0.01, max_buffered_points=500) as store:

        def writer(k: int) -> None:
            for i in range(200):
                store.write([Point("m", float(i), T0 + (k * 1000 + i) * NS, {"w": str(k)})])
                if i % 50 == 0:
                    store.write_series("m", {"w": str(k)},
                                       np.array([T0 + (k * 1000 + 500 + i) * NS]),
                                       np.array([-1.0]))

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        df = store.query("m", resolution="raw")
    assert len(df) == 4 * 204
    assert df.groupby("w")["value"].sum().tolist() == [sum(range(200)) - 4] * 4


# -- errors --------------------------------------------------------------------------------

def _one_line_store_error(exc: pytest.ExceptionInfo[StoreError]) -> str:
    assert isinstance(exc.value, SeedanceError)
    text = str(exc.value)
    assert text and "\n" not in text
    return text


def test_nan_timestamp_is_rejected(tmp_path: Path) -> None:
    with _store(tmp_path / "s.db") as store:
        with pytest.raises(StoreError) as exc:
            store.write_series("m", {}, np.array([T0, np.nan]), np.zeros(2))
        assert "NaN" in _one_line_store_error(exc)
        with pytest.raises(StoreError):
            store.write([Point("m", 1.0, float("nan"))])  # type: ignore[arg-type]


def test_non_str_attribute_is_rejected(tmp_path: Path) -> None:
    with _store(tmp_path / "s.db") as store:
        with pytest.raises(StoreError) as exc:
            store.write([Point("m", 1.0, T0, {"gpu": 0})])  # type: ignore[dict-item]
        assert "gpu" in _one_line_store_error(exc)


def test_missing_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(StoreError) as exc:
        TimeSeriesStore(tmp_path / "nope" / "s.db")
    assert "does not exist" in _one_line_store_error(exc)


def test_file_that_is_not_a_store_is_rejected(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t(x)")
    for path in (junk, other):
        for readonly in (False, True):
            with pytest.raises(StoreError) as exc:
                TimeSeriesStore(path, readonly=readonly)
            assert "not a seedance store" in _one_line_store_error(exc)


def test_readonly_store_refuses_writes(tmp_path: Path) -> None:
    _store(tmp_path / "s.db").close()
    with TimeSeriesStore(tmp_path / "s.db", readonly=True) as reader:
        with pytest.raises(StoreError):
            reader.write_series("m", {}, np.array([T0]), np.zeros(1))
    with pytest.raises(StoreError):
        TimeSeriesStore(tmp_path / "absent.db", readonly=True)


def test_close_is_idempotent_and_flushes(tmp_path: Path) -> None:
    store = _store(tmp_path / "s.db", flush_interval_s=3600)
    store.write_series("m", {}, np.array([T0]), np.ones(1))
    store.close()
    store.close()
    assert _wait_for_rows(tmp_path / "s.db", 1, timeout_s=0) == 1


# -- other processes -----------------------------------------------------------------------

def test_readonly_opens_while_writer_holds_a_write_transaction(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with _store(path) as store:
        store.write_series("m", {}, np.array([T0]), np.ones(1))
        store.flush()
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("DELETE FROM series")  # uncommitted; readers must not see it
        try:
            with TimeSeriesStore(path, readonly=True, busy_timeout_s=1) as reader:
                assert len(reader.query("m", resolution="raw")) == 1
        finally:
            holder.execute("ROLLBACK")
            holder.close()


_READER = textwrap.dedent("""
    import sys, time
    from collectors._store import TimeSeriesStore
    seen = 0
    with TimeSeriesStore(sys.argv[1], readonly=True, busy_timeout_s=5) as reader:
        end = time.monotonic() + float(sys.argv[2])
        while time.monotonic() < end:
            n = len(reader.query("m", resolution="raw"))
            assert n >= seen, (n, seen)
            seen = n
            reader.metrics()
    print(seen)
""")


@pytest.mark.integration
def test_second_process_reads_while_first_writes(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with _store(path, flush_interval_s=0.01) as store:
        store.write_series("m", {}, np.array([T0]), np.zeros(1))
        store.flush()
        reader = subprocess.Popen([sys.executable, "-c", _READER, str(path), "3"], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        i = 1
        while reader.poll() is None:
            store.write_series("m", {}, T0 + np.arange(i, i + 50) * NS, np.zeros(50))
            store.flush()
            i += 50
        out, err = reader.communicate()
    assert reader.returncode == 0, err
    assert "locked" not in err
    assert 1 <= int(out) <= i


_KILLED_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from collectors._store import TimeSeriesStore
    store = TimeSeriesStore(sys.argv[1], raw_retention_s=None, rollup_1m_retention_s=None,
                           flush_interval_s=3600)
    t0, n = 1_760_000_000 * 10**9, 0
    while True:
        batch = np.arange(n, n + 997)
        for g in range(3):
            store.write_series("m", {"g": str(g)}, t0 + batch * 10**6, batch.astype(float))
        store.flush()
        n += 997
        print(n, flush=True)
""")


@pytest.mark.integration
def test_kill_9_keeps_every_committed_point(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    committed = 0
    for line in child.stdout:
        committed = int(line)
        if committed >= 40 * 997:
            break
    os.kill(child.pid, signal.SIGKILL)  # the child is already busy with its next batch
    child.wait()
    assert committed >= 40 * 997
    with TimeSeriesStore(path, readonly=True) as reader:
        df = reader.query("m", resolution="raw")
        rollup = reader.query("m", resolution="1m")  # the journal was never folded
    for g, part in df.groupby("g"):
        values = part["value"].to_numpy()
        assert values.shape[0] >= committed
        assert values.tolist() == list(map(float, range(values.shape[0])))
        assert rollup.loc[rollup["g"] == g, "count"].sum() == values.shape[0]


def test_a_batch_of_only_nan_values_is_stored_and_leaves_rollups_empty(tmp_path: Path) -> None:
    """Regression: a flush whose values were all NaN crashed building the (empty) rollups."""
    now_ns = time.time_ns()  # old timestamps would be pruned by raw retention
    with TimeSeriesStore(tmp_path / "nan.db") as store:
        store.write([Point("loss", math.nan, now_ns, {}),
                     Point("loss", math.nan, now_ns + 1_000_000_000, {})])
        store.flush()
        raw = store.query("loss", resolution="raw")
        assert len(raw) == 2 and raw["value"].isna().all()
        assert store.query("loss", resolution="1m").empty


def test_stores_opened_together_fold_once_a_minute_each_at_its_own_moment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet restarted at once must not fold in the same second of every minute: on a shared
    host those folds slow each other, and every API call waiting on them, several times over."""
    now = [1000.0]
    monkeypatch.setattr(_store_writer, "_clock", lambda: now[0])
    monkeypatch.setattr(_store_writer, "_phases", random.Random(3))
    paths = [tmp_path / f"s{i}.db" for i in range(8)]
    stores = [_store(path, flush_interval_s=3600.0) for path in paths]  # the test's flushes only
    folds: list[list[int]] = [[] for _ in paths]
    try:
        for second in range(200):
            for store, path, folded in zip(stores, paths, folds, strict=True):
                store.write_series("m", {}, np.array([T0 + second * NS]), np.array([1.0]))
                store.flush()  # one point: one journal row, none left after a fold
                if second and _rows(path, "points_journal") == 0:
                    folded.append(second)
            now[0] += 1.0
    finally:
        for store in stores:
            store.close()
    for folded in folds:
        assert np.diff(folded).tolist() == [60] * (len(folded) - 1), folds
        assert 60 <= folded[0] < 120, folds
    firsts = sorted(folded[0] for folded in folds)
    assert firsts[-1] - firsts[0] >= 30, f"folds bunch together: {firsts}"
    assert len(set(firsts)) >= 6, f"folds share their second: {firsts}"


@pytest.mark.parametrize("rows", [0, 1, 2, 7, ROWS_PER_STATEMENT - 1, ROWS_PER_STATEMENT,
                                  ROWS_PER_STATEMENT + 1, 3 * ROWS_PER_STATEMENT + 300])
@pytest.mark.parametrize("variable_limit", [None, 7])
def test_rows_in_few_statements_do_what_one_statement_a_row_does(
        rows: int, variable_limit: int | None) -> None:
    """The writer's batched statements (inserts with blobs, an update joined on its rows, a
    delete of listed ids) leave what ``executemany`` leaves, in few statements of few
    shapes, whatever SQLite's limit on variables."""
    def run(batched: bool) -> tuple[list[tuple[object, ...]], list[str]]:
        conn = sqlite3.connect(":memory:")
        if variable_limit is not None:
            conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, variable_limit)
        conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, n INTEGER, b BLOB)")
        seen: list[str] = []
        conn.set_trace_callback(seen.append)
        new = [(i, i * 3, bytes([i % 256]) * (i % 5)) for i in range(1, rows + 1)]
        change = [(i, 10 * i) for i in range(1, rows + 1, 2)]
        gone = [(i,) for i in range(1, rows + 1, 3)]
        if batched:
            execute_rows(conn, "INSERT INTO t(id, n, b) VALUES {values}", new)
            execute_rows(conn, "UPDATE t SET n = n + j.column2 FROM (VALUES {values}) AS j "
                               "WHERE t.id = j.column1", change)
            execute_rows(conn, "DELETE FROM t WHERE id IN (SELECT column1 FROM "
                               "(VALUES {values}))", gone)
        else:
            conn.executemany("INSERT INTO t(id, n, b) VALUES(?, ?, ?)", new)
            conn.executemany("UPDATE t SET n = n + ? WHERE id = ?", [(n, i) for i, n in change])
            conn.executemany("DELETE FROM t WHERE id = ?", gone)
        return conn.execute("SELECT * FROM t ORDER BY id").fetchall(), seen

    got, traced = run(batched=True)
    assert got == run(batched=False)[0]
    # each statement's verb and rows (the trace shows them with their values bound)
    statements = [(sql.split()[0], sql.count("),(") + 1) for sql in traced
                  if sql.split()[0] in ("INSERT", "UPDATE", "DELETE")]
    most = ROWS_PER_STATEMENT if variable_limit is None else max(variable_limit // 3, 1)
    assert len(statements) <= 3 * (rows // most + ROWS_PER_STATEMENT.bit_length())
    assert len(set(statements)) <= 3 * (1 + ROWS_PER_STATEMENT.bit_length())
