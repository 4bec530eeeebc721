"""Reading the store into pandas: raw points or rollups, chosen by span for ``auto``.

Queries read inside one deferred transaction, so a read sees one commit's state; in WAL mode
a reader never waits for the writer. Decoded chunk columns are cached by content, because
the policy pass and the rollout re-read the same chunks every few seconds.
"""

from __future__ import annotations

import copy
import json
import math
import sqlite3
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial

import numpy as np
import pandas as pd

from collectors import _store_codec as codec
from collectors._series_spans import SPAN_SLACK_NS
from collectors._store_file import StoreError, StoreFile, canonical_attrs, has_value_bounds
from collectors._store_points_journal import PointsJournalView
from collectors._store_reader import Resolution, ValueBounds
from collectors._store_rollups import (
    AGG_FIELDS,
    NS,
    RAW_BLOCK_NS,
    ROLLUP_BLOCK_NS,
    JournalView,
    combine,
    decode_agg,
    hour_buckets,
)

AUTO_MIN_POINTS = 500
"""``resolution="auto"`` picks the coarsest rollup that still yields this many buckets."""

_STEP_S: dict[str, int] = {"1h": 3600, "1m": 60}  # coarsest first: the order "auto" tries
_DECODED_CACHE_BYTES = 16 * 2**20
_PARSED_ATTRS_MAX = 200_000  # distinct attribute texts kept parsed (tens of MiB at most)
# Resolved once: parsing "str" again for each column was a third of a small query's time.
_STR = pd.api.types.pandas_dtype("str")
_ROLLUP_COLUMNS = ("time", "value", "min", "max", "count", "last")

_INT64_MIN = -(2**63)  # the earliest time a range may start at


class DecodedCache:
    """Decoded columns by content (a times digest, a values blob), least recently used out
    first past ``max_bytes``: the policy pass and the rollout re-read the same chunks every
    few seconds, and decoding them again was most of a query's cost. Content keys stay right
    when SQLite reuses a deleted row's id. Cached arrays are read-only. An entry costs its
    array, its key and a fixed overhead: a chunk of one flush may hold a single point."""

    ENTRY_OVERHEAD_BYTES = 256

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def _cost(self, key: bytes, found: np.ndarray) -> int:
        return found.nbytes + len(key) + self.ENTRY_OVERHEAD_BYTES

    def get(self, key: bytes, decode: Callable[[], np.ndarray]) -> np.ndarray:
        """The array cached under ``key``, decoded (and cached) on a miss."""
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
            return found
        found = decode()
        found.setflags(write=False)
        self._items[key] = found
        self.bytes += self._cost(key, found)
        while self.bytes > self.max_bytes and len(self._items) > 1:
            self.bytes -= self._cost(*self._items.popitem(last=False))
        return found


class StoreQueries:
    """The reads of one store file; ``flush`` is called first so a writer reads its own
    writes (on a read-only file it does nothing)."""

    def __init__(self, file: StoreFile, journal: JournalView, points: PointsJournalView,
                 flush: Callable[[], None]) -> None:
        self._file = file
        self._journal = journal
        self._points = points
        self._flush = flush
        self._decoded = DecodedCache(_DECODED_CACHE_BYTES)
        self._parsed_attrs: dict[str, dict[str, str]] = {}

    def without_flush(self) -> StoreQueries:
        """The same reads and caches, of what is committed only (``TimeSeriesStore.committed``)."""
        view = copy.copy(self)
        view._flush = _nothing
        return view

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """A consistent read: flush own writes, then read inside one transaction."""
        self._file.check_open()
        self._flush()
        with self._file.lock:
            self._file.retry(lambda: self._file.conn.execute("BEGIN DEFERRED"))
            try:
                yield self._file.conn
            finally:
                self._file.conn.execute("ROLLBACK")

    def query(self, name: str, *, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None,
              resolution: Resolution = "auto") -> pd.DataFrame:
        """Points of ``name`` (resolutions and columns: ``TimeSeriesStore.query``)."""
        if resolution not in ("auto", "raw", "1m", "1h"):
            raise StoreError(f"resolution must be auto, raw, 1m or 1h, got {resolution!r}")
        wanted = {} if where is None else dict(where)
        canonical_attrs(wanted)
        lo = np.iinfo(np.int64).min if since_ns is None else int(since_ns)
        hi = np.iinfo(np.int64).max if until_ns is None else int(until_ns)
        with self._snapshot() as conn:
            found = self._series(conn, name, lo, hi, wanted)
            chosen = (_pick_resolution(found, since_ns, until_ns) if resolution == "auto"
                      else resolution)
            if chosen == "raw":
                rows = self._read_raw(conn, [sid for sid, _, _, _ in found], lo, hi)
            else:
                rows = _stacked([self._read_rollup(sid, _STEP_S[chosen], lo, hi)
                                 for sid, _, _, _ in found], _ROLLUP_COLUMNS)
        return _frame([attrs for _, attrs, _, _ in found], *rows)

    def _series(self, conn: sqlite3.Connection, name: str, lo: int, hi: int,
                wanted: Mapping[str, str]
                ) -> list[tuple[int, dict[str, str], int | None, int | None]]:
        """(id, attributes, first_ns, last_ns) of the series of ``name`` with points in
        [lo, hi] whose attributes include ``wanted``, by id. Only those in the range: each
        config version starts new series, so a window's cost would otherwise grow with every
        trial the job ever ran; and ``wanted`` narrows them in SQL first (a version's series
        among every version's were parsed and dropped here one by one). A row's ``last_ns``
        may trail its newest point by ``SPAN_SLACK_NS`` (:mod:`collectors._series_spans`):
        the filter reaches back that much further, and a series with no point in the range
        reads as none."""
        sql = ("SELECT id, attrs, first_ns, last_ns FROM series WHERE name = ? "
               "AND last_ns >= ? AND first_ns <= ?")
        params: list[object] = [name, max(lo, _INT64_MIN + SPAN_SLACK_NS) - SPAN_SLACK_NS, hi]
        for key, value in wanted.items():
            # a path names a key as stored: plain ASCII only (the rest is escaped in attrs)
            if key.isascii() and key.isprintable() and not {'"', "\\"} & set(key):
                sql += " AND json_extract(attrs, ?) = ?"
                params += [f'$."{key}"', value]
        found = [(r[0], self._attrs(r[1]), r[2], r[3])
                 for r in conn.execute(sql + " ORDER BY id", params)]
        return [f for f in found if all(f[1].get(k) == v for k, v in wanted.items())]

    def value_bounds(self, name: str, *, where: Mapping[str, str] | None = None,
                     keep: Callable[[Mapping[str, str]], bool], since_ns: int,
                     until_ns: int) -> ValueBounds | None:
        """Bounds on the raw values of the series of ``name`` whose attributes include
        ``where`` and that ``keep`` accepts, in [since_ns, until_ns], from the bounds of each
        chunk that reaches into the range (so of a superset) and the journal's points in it;
        None if such a chunk predates bounds (format 3)."""
        wanted = {} if where is None else dict(where)
        canonical_attrs(wanted)
        lo, hi = int(since_ns), int(until_ns)
        with self._snapshot() as conn:
            if not has_value_bounds(conn):
                return None
            kept = [sid for sid, attrs, _, _ in self._series(conn, name, lo, hi, wanted)
                    if keep(attrs)]
            n, n_nan, unbounded, v_min, v_max, t_max = conn.execute(
                "SELECT sum(n), sum(v_nans), sum(v_nans IS NULL), min(v_min), max(v_max), "
                "max(t_max) FROM chunks WHERE series_id IN (SELECT value FROM json_each(?)) "
                "AND block_ns > ? AND block_ns <= ? AND t_max >= ? AND t_min <= ?",
                (json.dumps(kept), _blocks_after(lo), hi, lo, hi)).fetchone()
            if unbounded:  # SQL's min and max skip NULL: a chunk without bounds would hide
                return None
            bounds = (ValueBounds(0, 0, math.inf, -math.inf, None) if n is None  # no chunk
                      else ValueBounds(n, n_nan, v_min, v_max, t_max))
            runs = self._points.runs(conn)
        inside = [np.isin(s, kept) & (t >= lo) & (t <= hi) for s, t, _ in runs]
        times = [t[m] for (_, t, _), m in zip(runs, inside, strict=True)]
        values = [v[m] for (_, _, v), m in zip(runs, inside, strict=True)]
        return bounds.merged(ValueBounds.of(np.concatenate([np.empty(0), *values]),
                                            np.concatenate([np.empty(0, np.int64), *times])))

    def _attrs(self, text: str) -> dict[str, str]:
        """A series' attributes, parsed once per distinct text: a pass over a job of
        thousands of series parsed the same JSON on every query. Shared: never mutated."""
        found = self._parsed_attrs.get(text)
        if found is None:
            if len(self._parsed_attrs) >= _PARSED_ATTRS_MAX:
                self._parsed_attrs.clear()
            found = self._parsed_attrs[text] = json.loads(text)
        return found

    def _read_raw(self, conn: sqlite3.Connection, sids: list[int], lo: int, hi: int
                  ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The raw points in [lo, hi] of the series ``sids``, read in one statement and
        stacked in one pass: (each row's index into ``sids``, the time and value columns).
        A job of thousands of series paid more for per-series statements, and then for
        per-series array work, than for decoding."""
        rows = conn.execute(
            "SELECT c.series_id, c.n, t.digest, t.data, c.vals FROM chunks c "
            "JOIN times t ON t.id = c.times_id WHERE c.series_id IN (SELECT value FROM "
            "json_each(?)) AND c.block_ns > ? AND c.block_ns <= ? AND c.t_max >= ? "
            "AND c.t_min <= ? ORDER BY c.series_id, c.t_min",
            (json.dumps(sids), _blocks_after(lo), hi, lo, hi)).fetchall()
        position = {sid: i for i, sid in enumerate(sids)}
        cache = self._decoded  # keyed by content and length: a blob of zeros fits any length
        owners: list[int] = []
        ts: list[np.ndarray] = []
        vs: list[np.ndarray] = []
        for sid, n, digest, data, vals in rows:
            owners.append(position[sid])
            ts.append(cache.get(b"t%d:" % n + digest, partial(codec.decode_times, data, n)))
            vs.append(cache.get(b"v%d:" % n + vals, partial(codec.decode_values, vals, n)))
        # the journal's points (not folded yet) after the chunks: the frame's sort keeps a
        # series' rows of one instant in this order
        for sid, (t, v) in self._points.of_series(conn, sids).items():
            owners.append(position[sid])
            ts.append(t)
            vs.append(v)
        if not ts:
            return np.empty(0, np.int64), {"time": np.empty(0, np.int64), "value": np.empty(0)}
        t = np.concatenate(ts)
        keep = (t >= lo) & (t <= hi)
        owner = np.repeat(np.array(owners, np.int64), [a.shape[0] for a in ts])
        return owner[keep], {"time": t[keep], "value": np.concatenate(vs)[keep]}

    def _read_rollup(self, sid: int, step_s: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        block_ns, step_ns = ROLLUP_BLOCK_NS[step_s], step_s * NS
        conn = self._file.conn
        rows = conn.execute(
            "SELECT block_ns, n, data FROM rollups WHERE series_id = ? AND step_s = ? AND "
            "block_ns > ? AND block_ns <= ? ORDER BY block_ns, id",
            (sid, step_s, max(lo, np.iinfo(np.int64).min + block_ns) - block_ns, hi)).fetchall()
        aggs = [decode_agg(r[2], r[1]) for r in rows]
        journal = self._journal.of_series(conn).get(sid)
        if journal is not None:
            aggs.append(journal if step_s == 60 else hour_buckets(journal))
        agg = {k: np.concatenate([a[k] for a in aggs]) if aggs else np.empty(0)
               for k in AGG_FIELDS}
        if len({r[0] for r in rows}) < len(rows) or journal is not None:  # pieces to merge
            agg = combine(agg, presorted=False)
        bucket = agg["bucket"].astype(np.int64)
        keep = (bucket + step_ns > lo) & (bucket <= hi)
        count = agg["count"][keep]
        return {"time": bucket[keep], "value": agg["sum"][keep] / count,
                "min": agg["min"][keep], "max": agg["max"][keep],
                "count": count.astype(np.int64), "last": agg["last"][keep]}

    def metrics(self) -> pd.DataFrame:
        """One row per metric name: series count, points written, first and last timestamp."""
        with self._snapshot() as conn:
            rows = conn.execute(
                "SELECT name, count(*), sum(points), min(first_ns), max(last_ns) FROM series "
                "GROUP BY name ORDER BY name").fetchall()
        return pd.DataFrame({
            "name": pd.Series([r[0] for r in rows], dtype="str"),
            "series": np.array([r[1] for r in rows], dtype=np.int64),
            "points": np.array([r[2] for r in rows], dtype=np.int64),
            "first": pd.to_datetime([r[3] for r in rows], unit="ns", utc=True),
            "last": pd.to_datetime([r[4] for r in rows], unit="ns", utc=True)})

    def attribute_values(self, attribute: str, *, active_since_ns: int | None = None
                         ) -> list[str]:
        """The distinct values of ``attribute`` over every series (those with a point at or
        after ``active_since_ns`` when given), sorted; one read, whatever the metric count."""
        since = None if active_since_ns is None else int(active_since_ns)
        with self._snapshot() as conn:
            texts = [r[0] for r in conn.execute(
                "SELECT DISTINCT attrs FROM series WHERE (? IS NULL OR last_ns >= ?)",
                (since, since))]
        return sorted({v for v in (self._attrs(t).get(attribute) for t in texts)
                       if v is not None})

    def series(self, name: str, *, active_since_ns: int | None = None
               ) -> list[dict[str, str]]:
        """The attribute sets of the series of ``name``, in creation order: every one, or
        those with a point at or after ``active_since_ns``."""
        since = None if active_since_ns is None else int(active_since_ns)
        with self._snapshot() as conn:
            return [dict(self._attrs(r[0])) for r in conn.execute(
                "SELECT attrs FROM series WHERE name = ? AND (? IS NULL OR last_ns >= ?) "
                "ORDER BY id", (name, since, since))]


def _nothing() -> None:
    pass


def _pick_resolution(found: list[tuple[int, dict[str, str], int | None, int | None]],
                     since_ns: int | None, until_ns: int | None) -> str:
    firsts = [f for _, _, f, _ in found if f is not None]
    lasts = [last for _, _, _, last in found if last is not None]
    if not firsts:
        return "raw"
    span_ns = (max(lasts) if until_ns is None else until_ns) - (
        min(firsts) if since_ns is None else since_ns)
    for label, step_s in _STEP_S.items():
        if span_ns / (step_s * NS) >= AUTO_MIN_POINTS:
            return label
    return "raw"


def _stacked(parts: list[dict[str, np.ndarray]], columns: tuple[str, ...]
             ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per-series columns stacked: (each row's index into ``parts``, the columns)."""
    counts = [cols["time"].shape[0] for cols in parts]
    data = {c: (np.concatenate([cols[c] for cols in parts]) if parts
                else np.empty(0, dtype=np.int64 if c in ("time", "count") else np.float64))
            for c in columns}
    return np.repeat(np.arange(len(parts)), counts), data


def _blocks_after(lo: int) -> int:
    """The ``block_ns`` above which a raw chunk may hold points at or after ``lo`` (one
    block back, clamped so it cannot leave int64): both raw reads select chunks by it."""
    return max(lo, np.iinfo(np.int64).min + RAW_BLOCK_NS) - RAW_BLOCK_NS


def _frame(attrs: list[dict[str, str]], owner: np.ndarray, data: dict[str, np.ndarray]
           ) -> pd.DataFrame:
    """One frame sorted by time (ties: series order, then stacking order), the attributes
    of each row's series (``attrs[owner]``) as str columns."""
    keys = sorted({k for a in attrs for k in a})
    order = np.lexsort((owner, data["time"]))
    out: dict[str, object] = {
        c: (pd.DatetimeIndex(a[order].view("M8[ns]")).tz_localize("UTC") if c == "time"
            else a[order]) for c, a in data.items()}
    # each attribute's str array is built per series, then taken per row: building it per
    # row checked every row's object again and cost three times the take
    series_of_row = owner[order]
    for key in keys:
        out[key] = pd.array(np.array([a.get(key) for a in attrs], dtype=object),
                            dtype=_STR).take(series_of_row)
    return pd.DataFrame(out, copy=False)  # every column is a new array already
