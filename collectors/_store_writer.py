"""The store's one writer: buffers points in memory and commits them, folds the journals
into chunks and rollups, and deletes data past its retention.

Each write is buffered as one batch of columns. A flush commits every buffered point in one
``BEGIN IMMEDIATE`` transaction: a raw chunk for each series with many points in it (merged
with its block's earlier chunks at 8, or once the series moves on to a later block), ONE
points-journal row for the other series' points, and ONE rollup-journal row of every series'
1-minute buckets. About once a minute the journals are folded into per-series chunks and
rollups, and a retention pass runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import cast

import numpy as np

from collectors import _store_codec as codec
from collectors import _store_points_journal as points_journal
from collectors._generations import GenerationalMap
from collectors._otlp_decode import Shape
from collectors._points import Point
from collectors._priority import background_thread
from collectors._series_spans import SeriesSpans, SpanUpdate
from collectors._store_file import (
    StoreError,
    StoreFile,
    StoreUnavailable,
    canonical_attrs,
    execute_rows,
    transaction,
)
from collectors._store_retention import delete_expired
from collectors._store_rollups import (
    AGG_FIELDS,
    NS,
    RAW_BLOCK_NS,
    ROLLUP_BLOCK_NS,
    Agg,
    JournalView,
    by_series,
    combine,
    decode_agg,
    encode_aggs,
    encode_journal,
    hour_buckets,
    pieces_to_merge,
    points_agg,
    split_by_block,
)

log = logging.getLogger(__name__)

_MAINTENANCE_EVERY_S = 60.0
_SERIES_IDLE_S = 600.0
_BLOCK_NS = {0: RAW_BLOCK_NS, **ROLLUP_BLOCK_NS}  # by step (0: raw chunks)
_FOLD_EVERY_S = 60.0
_FOLD_AT_ROWS = 120  # or sooner, when flushes come faster than one a second
_clock = time.monotonic  # when folds and retention passes fall due; a test steps its own
_phases = random.Random()  # each writer's place in the minute; a test seeds its own


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise StoreError(f"metric name must be a non-empty str, got {name!r}")
    return name


def _as_times(times_ns: object) -> np.ndarray:
    arr = np.asarray(times_ns)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64).ravel()
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise StoreError("timestamps must be finite integers in ns; got NaN or inf")
        if (arr != np.rint(arr)).any():
            raise StoreError("timestamps must be whole nanoseconds; got a fraction")
        return arr.astype(np.int64).ravel()
    raise StoreError(f"timestamps must be integers in ns, got dtype {arr.dtype}")


def _as_values(values: object, n: int) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64).ravel()
    except (TypeError, ValueError) as e:
        raise StoreError(f"values must be numbers: {e}") from e
    if arr.shape[0] != n:
        raise StoreError(f"got {n} timestamps but {arr.shape[0]} values")
    return arr


SeriesKey = tuple[str, str]
"""(metric name, canonical attributes): one row of ``series``."""
_SHAPE_KEY = "store.series"


class _SeriesIds:
    """A shape's series ids, and the id map (one per store writer) and its generation they
    were read at.

    A repeat export's keys were looked up again at every flush: at 64 ranks x 250 series a
    flush resolved 16,000 keys. Kept per shape, they are looked up once per generation (the
    map rotates every few minutes, and the lookups then keep its entries alive)."""

    __slots__ = ("generation", "ids", "owner")

    def __init__(self) -> None:
        self.owner: Callable[[], object] = lambda: None  # a weak reference: stores close
        self.generation = -1
        self.ids = np.empty(0, dtype=np.int64)


_ShapeSeries = tuple[list[SeriesKey], np.ndarray, dict[str, dict[str, int]], _SeriesIds]
"""A shape's series keys, each point's index into them, its batches' shared counts and
series ids."""


class _Batch:
    """The points of one write waiting for the next flush: the series they belong to and
    one column per point, so a write of thousands of one-point series is a few arrays."""

    __slots__ = ("_counts", "index", "keys", "series_ids", "times", "values")

    def __init__(self, keys: list[SeriesKey], index: np.ndarray, times: np.ndarray,
                 values: np.ndarray, *, counts: dict[str, dict[str, int]] | None = None,
                 series_ids: _SeriesIds | None = None) -> None:
        self.keys = keys
        self.series_ids = series_ids  # shared by the batches of one shape
        self.index = index  # per point: its series in ``keys``
        self.times = times
        self.values = values
        # counts_by follows from keys and index alone: batches of one shape share it
        self._counts: dict[str, dict[str, int]] = {} if counts is None else counts

    def counts_by(self, attribute: str) -> dict[str, int]:
        """This batch's points by the value of ``attribute`` ("" without it); kept."""
        found = self._counts.get(attribute)
        if found is None:
            found = {}
            per_key = np.bincount(self.index, minlength=len(self.keys)).tolist()
            for (_, akey), count in zip(self.keys, per_key, strict=True):
                value = str(json.loads(akey).get(attribute, ""))
                found[value] = found.get(value, 0) + count
            self._counts[attribute] = found
        return found


def chunk_bounds(chunks: list[np.ndarray]) -> list[tuple[int, float, float]]:
    """Each chunk's NaN count and lowest and highest other value (inf and -inf when all are
    NaN: SQLite stores a NaN as NULL), in one pass over all of them: a fold writes a chunk
    for each of thousands of series."""
    values = np.concatenate(chunks)
    starts = np.cumsum([0] + [c.shape[0] for c in chunks[:-1]])
    nan = np.isnan(values)
    nans = np.add.reduceat(nan, starts)
    low = np.minimum.reduceat(np.where(nan, np.inf, values), starts)
    high = np.maximum.reduceat(np.where(nan, -np.inf, values), starts)
    return list(zip(nans.tolist(), low.tolist(), high.tolist(), strict=True))


class _Writes:
    """The chunks and rollup pieces one commit or fold adds, encoded together at its end: a
    fold adds a few small blobs for each of thousands of series, and encoding them one at a
    time cost more than the bytes in them."""

    def __init__(self) -> None:
        self.chunks: list[tuple[tuple[int, int, int, int, int, int], np.ndarray]] = []
        """(series, block, t_min, t_max, n, times id) and the values of each new chunk."""
        self.rollups: list[tuple[tuple[int, int, int, int], Agg]] = []
        """(series, step, block, n) and the buckets of each new rollup piece."""
        self.times_ids: dict[bytes, int] = {}
        """Timestamp columns this commit stored or found, by digest."""
        self.times_unused: set[int] = set()
        """Timestamp columns of merged-away chunks: dropped unless a chunk still uses them."""
        self.merged_away: dict[str, list[int]] = {"chunks": [], "rollups": []}
        """Rows of each table whose points a new row holds now."""

    def execute(self, conn: sqlite3.Connection) -> None:
        for table, ids in self.merged_away.items():
            execute_rows(conn, f"DELETE FROM {table} WHERE id IN "
                         "(SELECT column1 FROM (VALUES {values}))", [(i,) for i in ids])
        if self.chunks:
            values = [v for _, v in self.chunks]
            blobs = codec.encode_frames("v", [[v] for v in values])
            execute_rows(
                conn, "INSERT INTO chunks(series_id, block_ns, t_min, t_max, n, times_id, vals, "
                "v_nans, v_min, v_max) VALUES {values}",
                [(*row, blob, *bounds) for (row, _), blob, bounds
                 in zip(self.chunks, blobs, chunk_bounds(values), strict=True)])
        if self.rollups:
            blobs = encode_aggs([agg for _, agg in self.rollups])
            execute_rows(
                conn, "INSERT INTO rollups(series_id, step_s, block_ns, n, data) VALUES {values}",
                [(*row, blob) for (row, _), blob in zip(self.rollups, blobs, strict=True)])
        # Ids in times_ids stay valid until here: nothing was dropped before the new chunks
        # that use them went in.
        execute_rows(conn, "DELETE FROM times WHERE id IN (SELECT column1 FROM (VALUES {values})) "
                     "AND NOT EXISTS (SELECT 1 FROM chunks WHERE times_id = times.id)",
                     [(i,) for i in sorted(self.times_unused)])
        self.chunks, self.rollups, self.times_unused = [], [], set()
        self.merged_away = {"chunks": [], "rollups": []}


def _write_spans(conn: sqlite3.Connection, spans: SpanUpdate) -> None:
    """Add each row's points to its series' count and widen its time span, in one statement."""
    execute_rows(
        conn,
        "UPDATE series SET points = points + j.column2, "
        "first_ns = min(coalesce(first_ns, j.column3), j.column3), "
        "last_ns = max(coalesce(last_ns, j.column4), j.column4) "
        "FROM (VALUES {values}) AS j WHERE series.id = j.column1", spans.rows)


class StoreWriter:
    """Buffers, commits and maintains one store file (see the module docstring).

    Thread-safe: any number of threads may write; flushes, folds and retention passes are
    serialised on the file's lock. On a read-only file ``flush`` and ``fold`` do nothing.
    """

    def __init__(self, file: StoreFile, journal: JournalView,
                 points: points_journal.PointsJournalView) -> None:
        self._file = file
        self._journal = journal
        self._points = points
        self._lock = threading.Lock()  # guards the pending buffer
        self._taken = threading.Condition(self._lock)
        """Notified when a flush takes the buffer, fails, or the flusher stops: what a writer
        over the buffer's limit waits for."""
        self._pending: list[_Batch] = []
        self._buffered = 0
        self._buffered_by: dict[str, tuple[int, dict[str, int]]] = {}
        """For each attribute asked about, how many pending batches its counts cover and the
        pending points by its value: a sidecar over half full asks on every request, when
        hundreds of batches wait, so each batch is counted once, when next asked, not on the
        write path."""
        # per-series caches forget series idle for _SERIES_IDLE_S: each trial starts new ones
        self._attr_keys: GenerationalMap[tuple[str, tuple[tuple[object, object], ...]], str] = \
            GenerationalMap(_SERIES_IDLE_S)
        self._series_ids: GenerationalMap[tuple[str, str], int] = GenerationalMap(_SERIES_IDLE_S)
        self._spans = SeriesSpans()
        self._piece_sizes: dict[tuple[int, int, int], list[int]] = {}
        """Rows of each piece of a block, oldest first, by (step_s or 0, sid, block)."""
        self._next_maintenance = 0.0  # the first flush runs retention
        self._next_fold = _clock() + _FOLD_EVERY_S
        self._phase_s = _phases.uniform(0.0, _FOLD_EVERY_S)
        """Added once to both timers after the first retention pass. Sidecars started together
        (a rollout, a node's restart) would otherwise fold in the same second of every minute,
        and on a shared host those folds slow each other, and every API call that waits on
        them, several times over."""
        self._journal_rows = 0  # rows added since the last fold (less the phase, once)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None
        self.write_error: str | None = None
        """Why the last flush failed (None: it committed); buffered points wait for the next."""

    # -- buffering -----------------------------------------------------------------------

    def write(self, points: Iterable[Point]) -> None:
        """Buffer points; they are committed by the next flush."""
        listed = points if isinstance(points, list) else list(points)
        keys, index = self._series_of([p.name for p in listed], [p.attributes for p in listed])
        t = _as_times([p.time_ns for p in listed])
        self._add(_Batch(keys, index, t, _as_values([p.value for p in listed], t.shape[0])))
        self._flush_if_full()

    def write_shape(self, shape: Shape, times_ns: np.ndarray, values: np.ndarray) -> None:
        """Buffer the points of a repeat export: its series were resolved at the shape's
        first write, so this is two columns, whatever the number of series."""
        found = shape.derived.get(_SHAPE_KEY)
        if found is None:
            keys, index = self._series_of(shape.names, shape.attributes)
            index.setflags(write=False)
            found = shape.derived[_SHAPE_KEY] = (keys, index, {}, _SeriesIds())
        keys, index, counts, series_ids = cast(_ShapeSeries, found)
        t = _as_times(times_ns)
        self._add(_Batch(keys, index, t, _as_values(values, t.shape[0]), counts=counts,
                         series_ids=series_ids))
        self._flush_if_full()

    def _series_of(self, names: list[str], attributes: list[Mapping[str, str]]
                   ) -> tuple[list[SeriesKey], np.ndarray]:
        """The distinct series of these points, and each point's index into them."""
        slots: dict[SeriesKey, int] = {}
        keys: list[SeriesKey] = []
        index: list[int] = []
        attr_keys = self._attr_keys
        attr_keys.expire()
        for name, attrs in zip(names, attributes, strict=True):
            cache_key = (name, tuple(attrs.items()))
            akey = attr_keys.get(cache_key)
            if akey is None:
                _check_name(name)
                akey = attr_keys[cache_key] = canonical_attrs(attrs)
            slot = slots.get((name, akey))
            if slot is None:
                slot = slots[(name, akey)] = len(keys)
                keys.append((name, akey))
            index.append(slot)
        return keys, np.asarray(index, dtype=np.intp)

    def write_series(self, name: str, attributes: Mapping[str, str], times_ns: np.ndarray,
                     values: np.ndarray) -> None:
        """Buffer one series' points given as columns (the fast path)."""
        _check_name(name)
        akey = canonical_attrs(attributes)
        t = _as_times(times_ns).copy()
        self._add(_Batch([(name, akey)], np.zeros(t.shape[0], dtype=np.intp), t,
                         _as_values(values, t.shape[0]).copy()))
        self._flush_if_full()

    def _add(self, batch: _Batch) -> None:
        self._file.check_writable()
        self._file.check_open()
        if batch.times.shape[0] == 0:
            return
        with self._lock:
            if self.write_error is not None and self._buffered >= \
                    self._file.config.max_buffered_points:
                raise StoreUnavailable(
                    f"store {self._file.path} cannot commit ({self.write_error}); "
                    f"{self._buffered} points wait: retry later")
            self._pending.append(batch)
            self._buffered += batch.times.shape[0]
            if (self.write_error is None
                    and self._buffered >= self._file.config.max_buffered_points // 4):
                self._wake.set()

    @property
    def buffered(self) -> int:
        """Points waiting for the next flush."""
        return self._buffered

    def buffered_by(self, attribute: str) -> dict[str, int]:
        """Points waiting for the next flush, by the value of ``attribute`` ("" without it)."""
        with self._lock:
            counted, counts = self._buffered_by.get(attribute, (0, {}))
            for batch in self._pending[counted:]:
                for value, count in batch.counts_by(attribute).items():
                    counts[value] = counts.get(value, 0) + count
            self._buffered_by[attribute] = (len(self._pending), counts)
            return dict(counts)

    # -- flushing ------------------------------------------------------------------------

    def _over_limit(self) -> bool:
        """The buffer is at its limit and commits work (while they fail, the flush loop
        retries and writers are refused)."""
        return (self._buffered >= self._file.config.max_buffered_points
                and self.write_error is None)

    def _flush_if_full(self) -> None:
        """Past the buffer's limit a writer waits for the flusher to take the buffer, and
        commits it itself only where no flusher runs, or none took it within the busy
        timeout. A writer that committed held every other writer behind the file lock for the
        commit in progress and its own: at 64 exporters the receiver's decode threads spent
        about half their time there, and decoded nothing while the store committed."""
        if not self._over_limit():
            return
        flusher = self._flusher
        if (flusher is not None and flusher.is_alive()
                and threading.current_thread() is not flusher):
            self._wake.set()
            with self._taken:
                self._taken.wait_for(lambda: not self._over_limit() or self._stop.is_set(),
                                     timeout=self._file.config.busy_timeout_s)
        if self._over_limit():
            self.flush(sync_spans=False)

    def flush(self, *, sync_spans: bool = True) -> None:
        """Commit every buffered point in one transaction (a no-op on a read-only store), and
        every series row's count and span with it unless ``sync_spans`` is False (the
        background flushes: see :mod:`collectors._series_spans`)."""
        if self._file.readonly:
            return
        with self._file.lock:
            with self._lock:
                batch, self._pending, self._buffered = self._pending, [], 0
                self._buffered_by.clear()
                self._taken.notify_all()
            if not batch and (sync_spans or self._spans.due) and self._spans.waiting:
                self._file.retry(self._sync_spans)
            if batch:
                try:
                    self._series_ids.expire()
                    self._file.retry(lambda: self._commit(batch, sync_spans))
                except BaseException as e:
                    self._series_ids.clear()
                    self._piece_sizes.clear()
                    self._requeue(batch)
                    with self._lock:
                        self.write_error = f"{type(e).__name__}: {e}"
                        self._taken.notify_all()
                    raise
                self.write_error = None
            maintain = _clock() >= self._next_maintenance
            if maintain or _clock() >= self._next_fold or self._journal_rows >= _FOLD_AT_ROWS:
                try:
                    self.prune() if maintain else self.fold()  # a retention pass folds first
                except BaseException as e:  # the journal keeps the buckets: nothing is lost
                    self.write_error = f"{type(e).__name__}: {e}"
                    raise

    def _requeue(self, batch: list[_Batch]) -> None:
        with self._lock:
            self._pending[:0] = batch
            self._buffered_by.clear()  # counted from the start when next asked
            self._buffered += sum(b.times.shape[0] for b in batch)

    def start_flusher(self) -> None:
        """Flush every ``flush_interval_s`` from a background thread until :meth:`stop_flusher`,
        and sooner once a quarter of ``max_buffered_points`` wait: a sidecar refuses a job's
        points past half, so a burst must not sit out the interval."""
        self._flusher = background_thread(self._flush_loop,
                                           name=f"store-flush:{self._file.path.name}")
        self._flusher.start()

    def stop_flusher(self) -> None:
        """Stop the background flushes (if any) and wait for the one in progress."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._taken.notify_all()  # a writer over the limit commits for itself from now
        if self._flusher is not None:
            self._flusher.join()

    def _flush_loop(self) -> None:
        while True:
            self._wake.wait(self._file.config.flush_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush(sync_spans=False)
            except Exception:  # the loop never dies; the batch stays queued for the next try
                log.exception("store %s: background flush failed", self._file.path)

    def _commit(self, batch: list[_Batch], sync_spans: bool) -> None:
        conn = self._file.conn
        with transaction(conn):
            resolved: dict[int, np.ndarray] = {}  # batches of one shape share their keys
            generation = self._series_ids.generation
            for b in batch:
                if id(b.keys) in resolved:
                    continue
                shared = b.series_ids
                if (shared is not None and shared.owner() is self._series_ids
                        and shared.generation == generation):
                    resolved[id(b.keys)] = shared.ids
                    continue
                ids = resolved[id(b.keys)] = np.array(
                    [self._series_id(name, akey) for name, akey in b.keys], dtype=np.int64)
                if shared is not None:
                    shared.owner = weakref.ref(self._series_ids)
                    shared.generation, shared.ids = generation, ids
            series = np.concatenate([resolved[id(b.keys)][b.index] for b in batch])
            series, times, values = points_journal.sort_columns(
                series, np.concatenate([b.times for b in batch]),
                np.concatenate([b.values for b in batch]))
            starts = np.flatnonzero(np.r_[True, series[1:] != series[:-1]])
            stops = np.r_[starts[1:], series.shape[0]]
            spans = self._spans.update(series[starts], stops - starts, times[starts],
                                       times[stops - 1], sync=sync_spans)
            _write_spans(conn, spans)
            many = (stops - starts) >= points_journal.DIRECT_AT_POINTS
            if many.any():
                writes = _Writes()
                for a, b in zip(starts[many].tolist(), stops[many].tolist(), strict=True):
                    self._append_series(int(series[a]), times[a:b], values[a:b], writes)
                writes.execute(conn)
            if not many.all():
                few = np.repeat(~many, stops - starts)
                points_journal.append(conn, series[few], times[few], values[few])
                self._journal_rows += 1
            agg = points_agg(times, values, 60 * NS, series)
            if agg["bucket"].shape[0]:
                conn.execute("INSERT INTO rollup_journal(n, data) VALUES(?, ?)",
                             (int(agg["bucket"].shape[0]), encode_journal(agg)))
                self._journal_rows += 1
        self._spans.committed(spans)

    def _sync_spans(self) -> None:
        """Write every series row's waiting count and span (nothing else to commit)."""
        empty = np.empty(0, dtype=np.int64)
        spans = self._spans.update(empty, empty, empty, empty, sync=True)
        with transaction(self._file.conn):
            _write_spans(self._file.conn, spans)
        self._spans.committed(spans)

    def _append_series(self, sid: int, t: np.ndarray, v: np.ndarray, writes: _Writes) -> None:
        """Append one series' points to its chunks, a chunk per 2-hour block they reach."""
        if (t[1:] < t[:-1]).any():
            order = np.argsort(t, kind="stable")
            t, v = t[order], v[order]
        for block, part, sealed in split_by_block(t, RAW_BLOCK_NS):
            self._append_chunk(sid, block, t[part], v[part], writes, sealed)

    def _series_id(self, name: str, akey: str) -> int:
        sid = self._series_ids.get((name, akey))
        if sid is None:
            self._file.conn.execute("INSERT OR IGNORE INTO series(name, attrs) VALUES(?, ?)",
                                    (name, akey))
            sid = self._file.conn.execute("SELECT id FROM series WHERE name = ? AND attrs = ?",
                                          (name, akey)).fetchone()[0]
            self._series_ids[(name, akey)] = sid
        return sid

    def _times_id(self, times_ns: np.ndarray, cache: dict[bytes, int]) -> int:
        """The id of this timestamp column, stored (encoded) only if no series has it yet."""
        digest = hashlib.blake2b(times_ns.tobytes(), digest_size=16).digest()
        tid = cache.get(digest)
        if tid is None:
            row = self._file.conn.execute("SELECT id FROM times WHERE digest = ?",
                                          (digest,)).fetchone()
            if row is None:
                row = self._file.conn.execute(
                    "INSERT INTO times(digest, data) VALUES(?, ?) RETURNING id",
                    (digest, codec.encode_times(times_ns))).fetchone()
            tid = cache[digest] = int(row[0])
        return tid

    def _append_chunk(self, sid: int, block: int, t: np.ndarray, v: np.ndarray,
                      writes: _Writes, sealed: bool) -> None:
        sizes = self._pieces(0, sid, block)
        take = pieces_to_merge(sizes, int(t.shape[0]), sealed)
        if take:
            rows = self._file.conn.execute(
                "SELECT c.id, c.n, t.data, c.vals, c.times_id FROM chunks c JOIN times t "
                "ON t.id = c.times_id WHERE c.series_id = ? AND c.block_ns = ? "
                "ORDER BY c.id DESC LIMIT ?", (sid, block, take)).fetchall()
            t = np.concatenate([codec.decode_times(r[2], r[1]) for r in rows] + [t])
            v = np.concatenate([codec.decode_values(r[3], r[1]) for r in rows] + [v])
            order = np.argsort(t, kind="stable")
            t, v = t[order], v[order]
            writes.merged_away["chunks"].extend(r[0] for r in rows)
            # their timestamp columns go once no chunk uses them, after the new chunks are in
            writes.times_unused.update(r[4] for r in rows)
            del sizes[len(sizes) - take:]
        writes.chunks.append(((sid, block, int(t[0]), int(t[-1]), int(t.shape[0]),
                               self._times_id(t, writes.times_ids)), v))
        sizes.append(int(t.shape[0]))

    def _pieces(self, step_s: int, sid: int, block: int) -> list[int]:
        """Rows of each piece (raw chunk for step 0, else rollup piece) of this series' block,
        oldest first: the cached list, which the caller updates as it writes."""
        sizes = self._piece_sizes.get((step_s, sid, block))
        if sizes is None:
            sizes = self._piece_sizes[(step_s, sid, block)] = [row[0] for row in (
                self._file.conn.execute(
                    "SELECT n FROM chunks WHERE series_id = ? AND block_ns = ? ORDER BY id",
                    (sid, block)) if step_s == 0 else self._file.conn.execute(
                    "SELECT n FROM rollups WHERE series_id = ? AND step_s = ? AND block_ns = ? "
                    "ORDER BY id", (sid, step_s, block)))]
        return sizes

    # -- maintenance ---------------------------------------------------------------------

    def _merge_rollup(self, sid: int, step_s: int, agg: Agg, writes: _Writes) -> None:
        """Append this flush's buckets as a piece of each block they reach, merged with the
        block's newest pieces as :func:`pieces_to_merge` says."""
        for block, part, sealed in split_by_block(agg["bucket"], ROLLUP_BLOCK_NS[step_s]):
            new = {k: a[part] for k, a in agg.items()}
            sizes = self._pieces(step_s, sid, block)
            take = pieces_to_merge(sizes, int(new["bucket"].shape[0]), sealed)
            if take:
                rows = self._file.conn.execute(
                    "SELECT id, n, data FROM rollups WHERE series_id = ? AND step_s = ? AND "
                    "block_ns = ? ORDER BY id DESC LIMIT ?", (sid, step_s, block, take)
                ).fetchall()
                olds = [decode_agg(r[2], r[1]) for r in rows] + [new]
                new = combine({k: np.concatenate([o[k] for o in olds]) for k in AGG_FIELDS},
                              presorted=False)
                writes.merged_away["rollups"].extend(r[0] for r in rows)
                del sizes[len(sizes) - take:]
            writes.rollups.append(((sid, step_s, block, int(new["bucket"].shape[0])), new))
            sizes.append(int(new["bucket"].shape[0]))

    def fold(self) -> None:
        """Move the journal's buckets into each series' rollups, in one transaction (a
        no-op on a read-only store). Runs about once a minute from flushes, on close and
        before a retention pass, so retention never meets a bucket still in the journal."""
        if self._file.readonly:
            return
        conn = self._file.conn

        def attempt() -> None:
            with transaction(conn):
                writes = _Writes()
                series, times, values = self._points.columns(conn)
                if series.shape[0]:
                    starts = np.flatnonzero(np.r_[True, series[1:] != series[:-1]])
                    for start, stop in zip(starts.tolist(), [*starts[1:].tolist(),
                                                             series.shape[0]], strict=True):
                        self._append_series(int(series[start]), times[start:stop],
                                            values[start:stop], writes)
                    conn.execute("DELETE FROM points_journal")
                minute = self._journal.agg(conn)
                for sid, part in by_series(minute):
                    self._merge_rollup(sid, 60, part, writes)
                if minute["bucket"].shape[0]:
                    for sid, part in by_series(hour_buckets(minute)):
                        self._merge_rollup(sid, 3600, part, writes)
                writes.execute(conn)
                conn.execute("DELETE FROM rollup_journal")

        with self._file.lock:
            try:
                self._file.retry(attempt)
            except BaseException:
                self._piece_sizes.clear()  # sizes read or changed in the rolled-back transaction
                raise
            self._journal_rows = 0
            self._next_fold = _clock() + _FOLD_EVERY_S

    def _forget_pieces(self, untouched: dict[int, int], now_ns: int) -> None:
        """Drop the piece sizes of blocks a retention pass may have changed, and of blocks
        before the one before ``now_ns``'s (a series writes them again only with late points).
        The rest stay right: clearing them all at each pass (once a minute) made every fold
        look up every series' pieces again, three statements a series."""
        keep_from = {step: max(start, now_ns - 2 * _BLOCK_NS[step])
                     for step, start in untouched.items()}
        self._piece_sizes = {key: sizes for key, sizes in self._piece_sizes.items()
                             if key[2] >= keep_from[key[0]]}

    def prune(self, *, now_ns: int | None = None) -> None:
        """Fold, then delete data past its retention, relative to ``now_ns`` (default: the
        wall clock)."""
        self._file.check_writable()
        now = time.time_ns() if now_ns is None else int(now_ns)
        with self._file.lock:
            self.fold()
            self._forget_pieces(delete_expired(self._file, now), now)
            self._next_maintenance = _clock() + _MAINTENANCE_EVERY_S + self._phase_s
            self._next_fold += self._phase_s
            # the row trigger too: at one flush a second it falls due with the timer, not before
            self._journal_rows -= math.ceil(_FOLD_AT_ROWS * self._phase_s / _FOLD_EVERY_S)
            self._phase_s = 0.0
