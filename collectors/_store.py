"""The embedded time-series store: one local SQLite file (WAL), no server, queried into pandas.

Layout and why:

- ``series``: one row per (metric name, attributes), attributes as canonical JSON.
- ``chunks``: raw points, one row per series per chunk. A chunk never crosses a 2-hour block
  (aligned to the epoch, like Prometheus TSDB blocks). Each flush appends a chunk per series;
  a block's chunks are merged into one when 8 pile up and when the series moves on to a later
  block, so a closed block is one row of up to 7,200 one-second points and a small flush costs
  O(its own points). Values are encoded by :mod:`collectors._store_codec` (exact).
- ``times``: the encoded timestamp column of a chunk, stored once by content hash. Series
  sampled together (one NVML tick, one OpenTelemetry collection) share identical timestamps,
  so the jitter bytes of a real sampler are paid once per group instead of once per series.
- ``rollups``: per series, 1-minute buckets (blocks of a day) and 1-hour buckets (blocks of 30
  days) with min, max, sum, count, last (and the time of last, so late points merge
  correctly), merged like chunks (a query combines pieces of a block not merged yet). A week
  of 1-minute data for 100 series is ~800 small blobs to decode instead of a million rows.
- ``rollup_journal``: each flush's 1-minute buckets of every series in ONE row, written in the
  same transaction as the raw points (so a crash loses no rollup), and folded into
  ``rollups`` about once a minute, on close and before a retention pass. A flush thus encodes
  one rollup blob instead of two per series; queries add the journal's buckets not folded yet.

Concurrency: one writer process (the sidecar) buffers points in memory and commits them in one
``BEGIN IMMEDIATE`` transaction per flush (on size, every ``flush_interval_s`` from a
background thread, on :meth:`TimeSeriesStore.flush` and on close). Other processes open the
file with ``readonly=True`` (``mode=ro``): in WAL mode readers never wait for the writer, and
``busy_timeout`` plus a retry loop absorb the rare checkpoint or recovery lock, so "database is
locked" never escapes. ``synchronous=NORMAL``: a killed process (``kill -9``) loses nothing that
was committed; a power cut may lose the last flushes.

Retention: raw chunks older than ``raw_retention_s`` (default 2 days), 1-minute rollups older
than 30 days and 1-hour rollups older than a year are deleted by a pass that runs at most once
a minute during flushes (or on :meth:`TimeSeriesStore.prune`). Ages are measured against the
wall clock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import quote

import numpy as np
import pandas as pd

from collectors import _store_codec as codec
from collectors._errors import SeedanceError
from collectors._points import Point

log = logging.getLogger(__name__)

Resolution = Literal["auto", "raw", "1m", "1h"]
_T = TypeVar("_T")

AUTO_MIN_POINTS = 500
"""``resolution="auto"`` picks the coarsest rollup that still yields this many buckets."""

_NS = 1_000_000_000
_STEP_S: dict[str, int] = {"1h": 3600, "1m": 60}  # coarsest first: the order "auto" tries
_RAW_BLOCK_NS = 2 * 3600 * _NS
_ROLLUP_BLOCK_NS = {60: 86_400 * _NS, 3600: 30 * 86_400 * _NS}
_MERGE_AT_CHUNKS = 8
_MAINTENANCE_EVERY_S = 60.0
_FORMAT = "seedance-tsdb"
_FORMAT_VERSION = "2"
_READABLE_VERSIONS = ("1", "2")  # 1: no rollup_journal (every rollup already in rollups)
_FOLD_EVERY_S = 60.0
_FOLD_AT_ROWS = 120  # or sooner, when flushes come faster than one a second
_DECODED_CACHE_BYTES = 16 * 2**20
_AGG_FIELDS = ("bucket", "min", "max", "sum", "count", "last", "last_ns")
_RAW_COLUMNS = ("time", "value")
_ROLLUP_COLUMNS = ("time", "value", "min", "max", "count", "last")

_SCHEMA = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE series(id INTEGER PRIMARY KEY, name TEXT NOT NULL, attrs TEXT NOT NULL,
                    points INTEGER NOT NULL DEFAULT 0, first_ns INTEGER, last_ns INTEGER,
                    UNIQUE(name, attrs));
CREATE TABLE times(id INTEGER PRIMARY KEY, digest BLOB NOT NULL UNIQUE, data BLOB NOT NULL);
CREATE TABLE chunks(id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL,
                    block_ns INTEGER NOT NULL, t_min INTEGER NOT NULL, t_max INTEGER NOT NULL,
                    n INTEGER NOT NULL, times_id INTEGER NOT NULL, vals BLOB NOT NULL);
CREATE INDEX chunks_by_series ON chunks(series_id, block_ns);
CREATE INDEX chunks_by_times ON chunks(times_id);
CREATE TABLE rollups(id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL,
                     step_s INTEGER NOT NULL, block_ns INTEGER NOT NULL, n INTEGER NOT NULL,
                     data BLOB NOT NULL);
CREATE INDEX rollups_by_series ON rollups(series_id, step_s, block_ns);
"""
# AUTOINCREMENT: a journal row id is never reused, so decoded rows can be cached by id.
_JOURNAL_TABLE = """CREATE TABLE rollup_journal(id INTEGER PRIMARY KEY AUTOINCREMENT,
                                               n INTEGER NOT NULL, data BLOB NOT NULL)"""

Agg = dict[str, np.ndarray]


class StoreError(SeedanceError):
    """The store cannot do what was asked: bad input, a file that is not a store, I/O trouble."""


class StoreUnavailable(StoreError):
    """The store cannot commit (disk full, read-only) and its buffer is full: the writer should
    try again later; nothing of this write was taken."""

    retry_after_s = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """Knobs of a :class:`TimeSeriesStore`; a retention of ``None`` keeps data forever."""

    flush_interval_s: float = 1.0
    max_buffered_points: int = 200_000
    raw_retention_s: float | None = 2 * 86_400.0
    rollup_1m_retention_s: float | None = 30 * 86_400.0
    rollup_1h_retention_s: float | None = 365 * 86_400.0
    busy_timeout_s: float = 10.0
    max_bytes: int | None = None
    """The most disk the file may take (SQLite's max_page_count); past it commits fail as on a
    full disk, and the store says so (``write_error``) until retention frees pages."""

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes < 64 * 1024:
            raise StoreError(f"StoreConfig.max_bytes must be >= 65536, got {self.max_bytes!r}")
        for field in ("flush_interval_s", "busy_timeout_s", "raw_retention_s",
                      "rollup_1m_retention_s", "rollup_1h_retention_s"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise StoreError(f"StoreConfig.{field} must be > 0, got {value!r}")
        if self.max_buffered_points < 1:
            raise StoreError("StoreConfig.max_buffered_points must be >= 1, "
                             f"got {self.max_buffered_points!r}")


def _canonical_attrs(attributes: Mapping[str, str]) -> str:
    for key, value in attributes.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise StoreError(f"attribute {key!r}={value!r} must be str=str "
                             f"(got {type(key).__name__}={type(value).__name__})")
    return json.dumps(dict(sorted(attributes.items())), separators=(",", ":"))


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


def _points_agg(times_ns: np.ndarray, values: np.ndarray, step_ns: int,
                series: np.ndarray | None = None) -> Agg:
    """Rollup buckets of points (NaN values are left out of rollups); with ``series`` (one
    series id per point) the buckets of many series at once, with a "series" column."""
    keep = ~np.isnan(values)
    t, v = times_ns[keep], values[keep]
    agg = {"bucket": t // step_ns * step_ns, "min": v, "max": v, "sum": v,
           "count": np.ones(t.shape[0]), "last": v, "last_ns": t}
    if series is not None:
        agg["series"] = series[keep]
    return _combine(agg, presorted=series is None)


def _combine(agg: Agg, *, presorted: bool) -> Agg:
    """Merge rows that share a bucket (and series, when there is a "series" column); ``last``
    is the value with the latest ``last_ns``. ``presorted``: by (series,) bucket, last_ns."""
    if agg["bucket"].shape[0] == 0:
        return agg
    keys = [agg["bucket"]] + ([agg["series"]] if "series" in agg else [])
    if not presorted:
        order = np.lexsort((agg["last_ns"], *keys))
        agg = {k: a[order] for k, a in agg.items()}
        keys = [agg["bucket"]] + ([agg["series"]] if "series" in agg else [])
    new = np.zeros(agg["bucket"].shape[0], dtype=bool)
    new[0] = True
    for key in keys:
        new[1:] |= key[1:] != key[:-1]
    starts = np.flatnonzero(new)
    ends = np.r_[starts[1:], new.shape[0]] - 1
    out = {"bucket": agg["bucket"][starts], "min": np.minimum.reduceat(agg["min"], starts),
           "max": np.maximum.reduceat(agg["max"], starts),
           "sum": np.add.reduceat(agg["sum"], starts),
           "count": np.add.reduceat(agg["count"], starts),
           "last": agg["last"][ends], "last_ns": agg["last_ns"][ends]}
    if "series" in agg:
        out["series"] = agg["series"][starts]
    return out


_AGG_KINDS = "tvvvvvt"  # codec kind of each _AGG_FIELDS column


def _encode_agg(agg: Agg) -> bytes:
    return codec.encode_frame(_AGG_KINDS, [agg[k] for k in _AGG_FIELDS])


def _decode_agg(blob: bytes, n: int) -> Agg:
    return dict(zip(_AGG_FIELDS, codec.decode_frame(blob, _AGG_KINDS, n), strict=True))


_JOURNAL_FIELDS = ("series", *_AGG_FIELDS)
_JOURNAL_KINDS = "t" + _AGG_KINDS  # the series id is an int64 column like a timestamp


def _hour_buckets(agg: Agg) -> Agg:
    """1-minute buckets (sorted by series, bucket) regrouped into 1-hour buckets."""
    return _combine(dict(agg, bucket=agg["bucket"] // (3600 * _NS) * (3600 * _NS)),
                    presorted=True)


def _by_series(agg: Agg) -> Iterator[tuple[int, Agg]]:
    """(series id, its rows without the series column) of rows sorted by series."""
    series = agg["series"]
    if series.shape[0] == 0:
        return
    starts = np.flatnonzero(np.r_[True, series[1:] != series[:-1]])
    for start, stop in zip(starts, np.r_[starts[1:], series.shape[0]], strict=True):
        yield int(series[start]), {k: agg[k][start:stop] for k in _AGG_FIELDS}


def _split_by_block(times_ns: np.ndarray, block_ns: int
                    ) -> Iterator[tuple[int, slice, bool]]:
    """Yield (block start, slice, sealed) runs of sorted timestamps.

    A block is sealed when the same batch already reaches a later block: the series has moved
    on, so the block's pieces can be merged into their final single row.
    """
    if times_ns.size == 0:  # e.g. the rollup of a batch whose values are all NaN
        return
    blocks = times_ns // block_ns * block_ns
    starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]])
    for i, start in enumerate(starts):
        last = i + 1 == len(starts)
        stop = blocks.shape[0] if last else starts[i + 1]
        yield int(blocks[start]), slice(int(start), int(stop)), not last


def _has_journal(conn: sqlite3.Connection) -> bool:
    """Format 2 has a rollup journal; a format-1 file opened read-only has none."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                        "name = 'rollup_journal'").fetchone() is not None


def _is_busy(e: sqlite3.OperationalError) -> bool:
    text = str(e).lower()
    return "locked" in text or "busy" in text


class _DecodedCache:
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


class _Pending:
    """Points of one series waiting for the next flush."""

    __slots__ = ("attrs", "times", "values")

    def __init__(self, attrs: dict[str, str]) -> None:
        self.attrs = attrs
        self.times: list[np.ndarray] = []
        self.values: list[np.ndarray] = []


class TimeSeriesStore:
    """A crash-safe embedded time-series store in one SQLite file.

    Thread-safe: any number of threads may call ``write``/``write_series``; flushes are
    serialised; queries on a writer first flush so they read their own writes. One process
    writes a file; any number of others read it with ``readonly=True``.
    """

    def __init__(self, path: str | os.PathLike[str], *, readonly: bool = False,
                 flush_interval_s: float = 1.0, max_buffered_points: int = 200_000,
                 raw_retention_s: float | None = 2 * 86_400.0,
                 rollup_1m_retention_s: float | None = 30 * 86_400.0,
                 rollup_1h_retention_s: float | None = 365 * 86_400.0,
                 busy_timeout_s: float = 10.0, max_bytes: int | None = None) -> None:
        self.config = StoreConfig(
            flush_interval_s=flush_interval_s, max_buffered_points=max_buffered_points,
            raw_retention_s=raw_retention_s, rollup_1m_retention_s=rollup_1m_retention_s,
            rollup_1h_retention_s=rollup_1h_retention_s, busy_timeout_s=busy_timeout_s,
            max_bytes=max_bytes)
        self.path = Path(path)
        self.readonly = readonly
        self._lock = threading.Lock()  # guards the pending buffer
        self._db_lock = threading.RLock()  # guards the connection and the caches
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._buffered = 0
        self._attr_keys: dict[tuple[str, tuple[tuple[object, object], ...]], str] = {}
        self._series_ids: dict[tuple[str, str], int] = {}
        self._chunk_counts: dict[tuple[int, int, int], int] = {}  # (step_s or 0, sid, block)
        self._last_maintenance = 0.0
        self._last_fold = time.monotonic()
        self._decoded = _DecodedCache(_DECODED_CACHE_BYTES)
        self._journal_rows = 0  # rows the writer added since it last folded (or opened)
        self._journal_decoded: dict[int, Agg] = {}  # journal row id -> its buckets
        self._journal_series: tuple[tuple[int, ...], dict[int, Agg]] = ((), {})
        self._closed = False
        self.write_error: str | None = None
        """Why the last flush failed (None: it committed); buffered points wait for the next."""
        self._conn = self._connect()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if not readonly:
            self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                             name=f"store-flush:{self.path.name}")
            self._flusher.start()

    # -- opening -------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if not self.path.parent.is_dir():
            raise StoreError(f"cannot open store {self.path}: directory "
                             f"{self.path.parent} does not exist")
        if self.readonly and not self.path.is_file():
            raise StoreError(f"cannot open store {self.path} read-only: no such file")
        uri = f"file:{quote(str(self.path.resolve()))}?mode={'ro' if self.readonly else 'rwc'}"
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None,
                                   check_same_thread=False,
                                   timeout=self.config.busy_timeout_s)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open store {self.path}: {e}") from e
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self.config.busy_timeout_s * 1000)}")
            self._retry(lambda: self._prepare(conn))
            if self.config.max_bytes is not None and not self.readonly:
                page = int(conn.execute("PRAGMA page_size").fetchone()[0])
                conn.execute(f"PRAGMA max_page_count={self.config.max_bytes // page}")
        except sqlite3.DatabaseError as e:
            conn.close()
            raise StoreError(f"{self.path} is not a seedance store: {e}") from e
        except StoreError:
            conn.close()
            raise
        return conn

    def _prepare(self, conn: sqlite3.Connection) -> None:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables and not self.readonly:
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            conn.execute("PRAGMA journal_mode=WAL")
            with self._transaction(conn):
                if not conn.execute("SELECT 1 FROM sqlite_master").fetchone():
                    for statement in [*_SCHEMA.split(";"), _JOURNAL_TABLE]:
                        if statement.strip():
                            conn.execute(statement)
                    conn.executemany("INSERT INTO meta VALUES(?, ?)",
                                     [("format", _FORMAT), ("version", _FORMAT_VERSION)])
            tables = {"meta"}
        found = (dict(conn.execute("SELECT key, value FROM meta").fetchall())
                 if "meta" in tables else {})
        if found.get("format") != _FORMAT:
            raise StoreError(f"{self.path} is not a seedance store (no '{_FORMAT}' header)")
        if found.get("version") not in _READABLE_VERSIONS:
            raise StoreError(f"{self.path} has store format {found.get('version')!r}, "
                             f"this code reads {' and '.join(_READABLE_VERSIONS)}")
        if not self.readonly:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            if found["version"] != _FORMAT_VERSION:  # 1 -> 2: add the (empty) journal
                with self._transaction(conn):
                    conn.execute(_JOURNAL_TABLE)
                    conn.execute("UPDATE meta SET value = ? WHERE key = 'version'",
                                 (_FORMAT_VERSION,))

    @staticmethod
    @contextmanager
    def _transaction(conn: sqlite3.Connection, mode: str = "IMMEDIATE") -> Iterator[None]:
        conn.execute(f"BEGIN {mode}")
        try:
            yield
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if conn.in_transaction:
            conn.execute("COMMIT")

    def _retry(self, attempt: Callable[[], _T]) -> _T:
        """Run ``attempt`` again while SQLite says busy, until ``busy_timeout_s`` runs out."""
        deadline = time.monotonic() + self.config.busy_timeout_s
        delay_s = 0.005
        while True:
            try:
                return attempt()
            except sqlite3.OperationalError as e:
                if not _is_busy(e):
                    raise
                if time.monotonic() >= deadline:
                    raise StoreError(f"store {self.path} stayed busy for "
                                     f"{self.config.busy_timeout_s} s: {e}") from e
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 0.2)

    # -- writing -------------------------------------------------------------------------

    def write(self, points: Iterable[Point]) -> None:
        """Buffer points; they are committed by the next flush."""
        groups: dict[tuple[str, str], tuple[list[object], list[float]]] = {}
        attr_keys = self._attr_keys
        for p in points:
            cache_key = (p.name, tuple(p.attributes.items()))
            akey = attr_keys.get(cache_key)
            if akey is None:
                _check_name(p.name)
                akey = attr_keys[cache_key] = _canonical_attrs(p.attributes)
            group = groups.get((p.name, akey))
            if group is None:
                group = groups[(p.name, akey)] = ([], [])
            group[0].append(p.time_ns)
            group[1].append(p.value)
        for (name, akey), (times, values) in groups.items():
            t = _as_times(times)
            self._add(name, akey, t, _as_values(values, t.shape[0]))
        self._flush_if_full()

    def write_series(self, name: str, attributes: Mapping[str, str], times_ns: np.ndarray,
                     values: np.ndarray) -> None:
        """Buffer one series' points given as columns (the fast path)."""
        _check_name(name)
        akey = _canonical_attrs(attributes)
        t = _as_times(times_ns)
        self._add(name, akey, t.copy(), _as_values(values, t.shape[0]).copy())
        self._flush_if_full()

    def _add(self, name: str, akey: str, times_ns: np.ndarray, values: np.ndarray) -> None:
        if self.readonly:
            raise StoreError(f"store {self.path} is open read-only")
        if self._closed:
            raise StoreError(f"store {self.path} is closed")
        if times_ns.shape[0] == 0:
            return
        with self._lock:
            if self.write_error is not None and self._buffered >= self.config.max_buffered_points:
                raise StoreUnavailable(
                    f"store {self.path} cannot commit ({self.write_error}); "
                    f"{self._buffered} points wait: retry later")
            pending = self._pending.get((name, akey))
            if pending is None:
                pending = self._pending[(name, akey)] = _Pending(json.loads(akey))
            pending.times.append(times_ns)
            pending.values.append(values)
            self._buffered += times_ns.shape[0]

    @property
    def buffered(self) -> int:
        """Points waiting for the next flush."""
        return self._buffered

    def buffered_by(self, attribute: str) -> dict[str, int]:
        """Points waiting for the next flush, by the value of ``attribute`` ("" without it)."""
        out: dict[str, int] = {}
        with self._lock:
            for pending in self._pending.values():
                key = str(pending.attrs.get(attribute, ""))
                out[key] = out.get(key, 0) + sum(t.shape[0] for t in pending.times)
        return out

    def _flush_if_full(self) -> None:
        if self._buffered >= self.config.max_buffered_points and self.write_error is None:
            self.flush()  # while commits fail, the flush loop retries; writers are refused

    def flush(self) -> None:
        """Commit every buffered point in one transaction (a no-op on a read-only store)."""
        if self.readonly:
            return
        with self._db_lock:
            with self._lock:
                batch, self._pending, self._buffered = self._pending, {}, 0
            if batch:
                try:
                    self._retry(lambda: self._commit(batch))
                except BaseException as e:
                    self._series_ids.clear()
                    self._chunk_counts.clear()
                    self._requeue(batch)
                    self.write_error = f"{type(e).__name__}: {e}"
                    raise
                self.write_error = None
            if (time.monotonic() - self._last_fold >= _FOLD_EVERY_S
                    or self._journal_rows >= _FOLD_AT_ROWS):
                try:
                    self.fold()
                except BaseException as e:  # the journal keeps the buckets: nothing is lost
                    self.write_error = f"{type(e).__name__}: {e}"
                    raise
            if time.monotonic() - self._last_maintenance >= _MAINTENANCE_EVERY_S:
                self.prune()

    def _requeue(self, batch: dict[tuple[str, str], _Pending]) -> None:
        with self._lock:
            for key, old in batch.items():
                pending = self._pending.setdefault(key, _Pending(old.attrs))
                pending.times[:0] = old.times
                pending.values[:0] = old.values
                self._buffered += sum(t.shape[0] for t in old.times)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.config.flush_interval_s):
            try:
                self.flush()
            except Exception:  # the loop never dies; the batch stays queued for the next try
                log.exception("store %s: background flush failed", self.path)

    def _commit(self, batch: dict[tuple[str, str], _Pending]) -> None:
        conn = self._conn
        with self._transaction(conn):
            times_ids: dict[bytes, int] = {}
            sids, all_t, all_v = [], [], []
            for (name, akey), pending in batch.items():
                sid = self._series_id(name, akey)
                t = np.concatenate(pending.times)
                v = np.concatenate(pending.values)
                if (t[1:] < t[:-1]).any():
                    order = np.argsort(t, kind="stable")
                    t, v = t[order], v[order]
                for block, part, sealed in _split_by_block(t, _RAW_BLOCK_NS):
                    self._append_chunk(sid, block, t[part], v[part], times_ids, sealed)
                sids.append(np.full(t.shape[0], sid, dtype=np.int64))
                all_t.append(t)
                all_v.append(v)
                conn.execute(
                    "UPDATE series SET points = points + ?, first_ns = min(coalesce(first_ns, ?),"
                    " ?), last_ns = max(coalesce(last_ns, ?), ?) WHERE id = ?",
                    (int(t.shape[0]), int(t[0]), int(t[0]), int(t[-1]), int(t[-1]), sid))
            agg = _points_agg(np.concatenate(all_t), np.concatenate(all_v), 60 * _NS,
                              np.concatenate(sids))
            if agg["bucket"].shape[0]:
                conn.execute("INSERT INTO rollup_journal(n, data) VALUES(?, ?)",
                             (int(agg["bucket"].shape[0]), codec.encode_frame(
                                 _JOURNAL_KINDS, [agg[k] for k in _JOURNAL_FIELDS])))
                self._journal_rows += 1

    def _series_id(self, name: str, akey: str) -> int:
        sid = self._series_ids.get((name, akey))
        if sid is None:
            self._conn.execute("INSERT OR IGNORE INTO series(name, attrs) VALUES(?, ?)",
                               (name, akey))
            sid = self._conn.execute("SELECT id FROM series WHERE name = ? AND attrs = ?",
                                     (name, akey)).fetchone()[0]
            self._series_ids[(name, akey)] = sid
        return sid

    def _times_id(self, times_ns: np.ndarray, cache: dict[bytes, int]) -> int:
        """The id of this timestamp column, stored (encoded) only if no series has it yet."""
        digest = hashlib.blake2b(times_ns.tobytes(), digest_size=16).digest()
        tid = cache.get(digest)
        if tid is None:
            row = self._conn.execute("SELECT id FROM times WHERE digest = ?",
                                     (digest,)).fetchone()
            if row is None:
                row = self._conn.execute(
                    "INSERT INTO times(digest, data) VALUES(?, ?) RETURNING id",
                    (digest, codec.encode_times(times_ns))).fetchone()
            tid = cache[digest] = int(row[0])
        return tid

    def _append_chunk(self, sid: int, block: int, t: np.ndarray, v: np.ndarray,
                      times_ids: dict[bytes, int], sealed: bool) -> None:
        conn = self._conn
        count = self._rows_in_block(0, sid, block)
        if count + 1 >= _MERGE_AT_CHUNKS or (sealed and count):
            rows = conn.execute(
                "SELECT c.id, c.n, t.data, c.vals, c.times_id FROM chunks c JOIN times t "
                "ON t.id = c.times_id WHERE c.series_id = ? AND c.block_ns = ?",
                (sid, block)).fetchall()
            t = np.concatenate([codec.decode_times(r[2], r[1]) for r in rows] + [t])
            v = np.concatenate([codec.decode_values(r[3], r[1]) for r in rows] + [v])
            order = np.argsort(t, kind="stable")
            t, v = t[order], v[order]
            conn.executemany("DELETE FROM chunks WHERE id = ?", [(r[0],) for r in rows])
            # Drop timestamp columns no chunk uses any more. Ids cached in times_ids stay valid:
            # each is used by a chunk inserted in this commit, and those are not merged again
            # before it ends (a commit appends to each series' block once).
            conn.executemany("DELETE FROM times WHERE id = ? AND NOT EXISTS "
                             "(SELECT 1 FROM chunks WHERE times_id = times.id)",
                             [(i,) for i in {r[4] for r in rows}])
            count = 0
        conn.execute(
            "INSERT INTO chunks(series_id, block_ns, t_min, t_max, n, times_id, vals) "
            "VALUES(?, ?, ?, ?, ?, ?, ?)",
            (sid, block, int(t[0]), int(t[-1]), int(t.shape[0]),
             self._times_id(t, times_ids), codec.encode_values(v)))
        self._chunk_counts[(0, sid, block)] = count + 1

    def _rows_in_block(self, step_s: int, sid: int, block: int) -> int:
        """Rows (raw chunks for step 0, else rollup pieces) that hold this series' block."""
        count = self._chunk_counts.get((step_s, sid, block))
        if count is None:
            count = self._conn.execute(
                "SELECT count(*) FROM chunks WHERE series_id = ? AND block_ns = ?"
                if step_s == 0 else "SELECT count(*) FROM rollups WHERE series_id = ? AND "
                "block_ns = ? AND step_s = ?", (sid, block) + ((step_s,) if step_s else ())
            ).fetchone()[0]
        return count

    def _merge_rollup(self, sid: int, step_s: int, agg: Agg) -> None:
        """Append this flush's buckets as a piece; merge a block's pieces at 8 or once sealed."""
        conn = self._conn
        for block, part, sealed in _split_by_block(agg["bucket"], _ROLLUP_BLOCK_NS[step_s]):
            new = {k: a[part] for k, a in agg.items()}
            count = self._rows_in_block(step_s, sid, block)
            if count + 1 >= _MERGE_AT_CHUNKS or (sealed and count):
                rows = conn.execute("SELECT id, n, data FROM rollups WHERE series_id = ? AND "
                                    "step_s = ? AND block_ns = ?", (sid, step_s, block)
                                    ).fetchall()
                olds = [_decode_agg(r[2], r[1]) for r in rows] + [new]
                new = _combine({k: np.concatenate([o[k] for o in olds]) for k in _AGG_FIELDS},
                               presorted=False)
                conn.executemany("DELETE FROM rollups WHERE id = ?", [(r[0],) for r in rows])
                count = 0
            conn.execute("INSERT INTO rollups(series_id, step_s, block_ns, n, data) "
                         "VALUES(?, ?, ?, ?, ?)",
                         (sid, step_s, block, int(new["bucket"].shape[0]), _encode_agg(new)))
            self._chunk_counts[(step_s, sid, block)] = count + 1

    def fold(self) -> None:
        """Move the journal's buckets into each series' rollups, in one transaction (a
        no-op on a read-only store). Runs about once a minute from flushes, on close and
        before a retention pass, so retention never meets a bucket still in the journal."""
        if self.readonly:
            return
        conn = self._conn

        def attempt() -> None:
            with self._transaction(conn):
                minute = self._journal_agg(conn)
                for sid, part in _by_series(minute):
                    self._merge_rollup(sid, 60, part)
                if minute["bucket"].shape[0]:
                    for sid, part in _by_series(_hour_buckets(minute)):
                        self._merge_rollup(sid, 3600, part)
                conn.execute("DELETE FROM rollup_journal")

        with self._db_lock:
            try:
                self._retry(attempt)
            except BaseException:
                self._chunk_counts.clear()  # counts cached inside the rolled-back transaction
                raise
            self._journal_rows = 0
            self._last_fold = time.monotonic()

    def prune(self, *, now_ns: int | None = None) -> None:
        """Delete data past its retention, relative to ``now_ns`` (default: the wall clock)."""
        if self.readonly:
            raise StoreError(f"store {self.path} is open read-only")
        now = time.time_ns() if now_ns is None else int(now_ns)
        cfg = self.config
        conn = self._conn

        def attempt() -> None:
            with self._transaction(conn):
                if cfg.raw_retention_s is not None:
                    conn.execute("DELETE FROM chunks WHERE t_max < ?",
                                 (now - int(cfg.raw_retention_s * _NS),))
                for step_s, keep_s in ((60, cfg.rollup_1m_retention_s),
                                       (3600, cfg.rollup_1h_retention_s)):
                    if keep_s is not None:
                        conn.execute("DELETE FROM rollups WHERE step_s = ? AND block_ns + ? <= ?",
                                     (step_s, _ROLLUP_BLOCK_NS[step_s], now - int(keep_s * _NS)))
                conn.execute("DELETE FROM times WHERE id NOT IN (SELECT times_id FROM chunks)")
            conn.execute("PRAGMA incremental_vacuum")

        with self._db_lock:
            self.fold()
            self._retry(attempt)
            self._chunk_counts.clear()
            self._last_maintenance = time.monotonic()

    # -- reading -------------------------------------------------------------------------

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """A consistent read: flush own writes, then read inside one transaction."""
        if self._closed:
            raise StoreError(f"store {self.path} is closed")
        self.flush()
        with self._db_lock:
            self._retry(lambda: self._conn.execute("BEGIN DEFERRED"))
            try:
                yield self._conn
            finally:
                self._conn.execute("ROLLBACK")

    def query(self, name: str, *, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None,
              resolution: Resolution = "auto") -> pd.DataFrame:
        """Points of ``name`` whose attributes include ``where``, in [since_ns, until_ns].

        ``raw``: columns time (datetime64[ns, UTC]), value, then one str column per attribute
        key, sorted by time. ``1m``/``1h``: one row per series and bucket overlapping the
        range, time = bucket start, value = mean, min, max, count, last, then attributes.
        ``auto``: the span is until_ns (default: the newest point) minus since_ns (default:
        the oldest point); the coarsest of 1h, 1m whose bucket count span/step is at least
        ``AUTO_MIN_POINTS`` (500) is used, raw otherwise. So a week reads 1-minute rollups
        (10,080 buckets), 500 minutes (~8 h) or less reads raw points, and ~3 weeks or more
        reads 1-hour rollups.
        """
        if resolution not in ("auto", "raw", "1m", "1h"):
            raise StoreError(f"resolution must be auto, raw, 1m or 1h, got {resolution!r}")
        wanted = {} if where is None else dict(where)
        _canonical_attrs(wanted)
        lo = np.iinfo(np.int64).min if since_ns is None else int(since_ns)
        hi = np.iinfo(np.int64).max if until_ns is None else int(until_ns)
        with self._snapshot() as conn:
            found = [(sid, attrs, first, last) for sid, attrs, first, last in (
                (r[0], json.loads(r[1]), r[2], r[3]) for r in conn.execute(
                    "SELECT id, attrs, first_ns, last_ns FROM series WHERE name = ? "
                    "ORDER BY id", (name,)))
                if all(attrs.get(k) == v for k, v in wanted.items())]
            chosen = (_pick_resolution(found, since_ns, until_ns) if resolution == "auto"
                      else resolution)
            parts = [(attrs, self._read_raw(sid, lo, hi) if chosen == "raw"
                      else self._read_rollup(sid, _STEP_S[chosen], lo, hi))
                     for sid, attrs, _, _ in found]
        return _frame(parts, _RAW_COLUMNS if chosen == "raw" else _ROLLUP_COLUMNS)

    def _read_raw(self, sid: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        rows = self._conn.execute(
            "SELECT c.n, t.digest, t.data, c.vals FROM chunks c JOIN times t "
            "ON t.id = c.times_id WHERE c.series_id = ? AND c.block_ns > ? AND c.block_ns <= ? "
            "AND c.t_max >= ? AND c.t_min <= ? ORDER BY c.t_min",
            (sid, max(lo, np.iinfo(np.int64).min + _RAW_BLOCK_NS) - _RAW_BLOCK_NS, hi, lo,
             hi)).fetchall()
        cache = self._decoded  # keyed by content and length: a blob of zeros fits any length
        t = np.concatenate([cache.get(b"t%d:" % n + digest, partial(codec.decode_times, data, n))
                            for n, digest, data, _ in rows] or [np.empty(0, "i8")])
        v = np.concatenate([cache.get(b"v%d:" % n + vals, partial(codec.decode_values, vals, n))
                            for n, _, _, vals in rows] or [np.empty(0)])
        keep = (t >= lo) & (t <= hi)
        return {"time": t[keep], "value": v[keep]}

    def _journal_agg(self, conn: sqlite3.Connection) -> Agg:
        """The journal's 1-minute buckets of every series, combined, sorted by series and
        bucket (empty on a format-1 file, which has no journal)."""
        rows = conn.execute("SELECT id, n, data FROM rollup_journal ORDER BY id").fetchall(
        ) if _has_journal(conn) else []
        decoded = {i: self._journal_decoded.get(i) or dict(zip(
            _JOURNAL_FIELDS, codec.decode_frame(data, _JOURNAL_KINDS, n), strict=True))
            for i, n, data in rows}
        self._journal_decoded = decoded
        return _combine({k: np.concatenate([d[k] for d in decoded.values()]) if decoded
                         else np.empty(0, np.int64) for k in _JOURNAL_FIELDS}, presorted=False)

    def _journal_by_series(self, conn: sqlite3.Connection) -> dict[int, Agg]:
        """:meth:`_journal_agg` split by series, cached until the journal's rows change."""
        ids = tuple(r[0] for r in conn.execute(
            "SELECT id FROM rollup_journal ORDER BY id")) if _has_journal(conn) else ()
        if ids != self._journal_series[0]:
            self._journal_series = (ids, dict(_by_series(self._journal_agg(conn))))
        return self._journal_series[1]

    def _read_rollup(self, sid: int, step_s: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        block_ns, step_ns = _ROLLUP_BLOCK_NS[step_s], step_s * _NS
        rows = self._conn.execute(
            "SELECT block_ns, n, data FROM rollups WHERE series_id = ? AND step_s = ? AND "
            "block_ns > ? AND block_ns <= ? ORDER BY block_ns, id",
            (sid, step_s, max(lo, np.iinfo(np.int64).min + block_ns) - block_ns, hi)).fetchall()
        aggs = [_decode_agg(r[2], r[1]) for r in rows]
        journal = self._journal_by_series(self._conn).get(sid)
        if journal is not None:
            aggs.append(journal if step_s == 60 else _hour_buckets(journal))
        agg = {k: np.concatenate([a[k] for a in aggs]) if aggs else np.empty(0)
               for k in _AGG_FIELDS}
        if len({r[0] for r in rows}) < len(rows) or journal is not None:  # pieces to merge
            agg = _combine(agg, presorted=False)
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

    def series(self, name: str) -> list[dict[str, str]]:
        """The attribute sets of every series of ``name``, in creation order."""
        with self._snapshot() as conn:
            return [json.loads(r[0]) for r in conn.execute(
                "SELECT attrs FROM series WHERE name = ? ORDER BY id", (name,))]

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the flusher, commit what is buffered, close the file; a second call is a no-op."""
        if self._closed:
            return
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join()
        try:
            self.flush()
            self.fold()
        finally:
            self._closed = True
            with self._db_lock:
                self._conn.close()

    def __enter__(self) -> TimeSeriesStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pick_resolution(found: list[tuple[int, dict[str, str], int | None, int | None]],
                     since_ns: int | None, until_ns: int | None) -> str:
    firsts = [f for _, _, f, _ in found if f is not None]
    lasts = [last for _, _, _, last in found if last is not None]
    if not firsts:
        return "raw"
    span_ns = (max(lasts) if until_ns is None else until_ns) - (
        min(firsts) if since_ns is None else since_ns)
    for label, step_s in _STEP_S.items():
        if span_ns / (step_s * _NS) >= AUTO_MIN_POINTS:
            return label
    return "raw"


def _frame(parts: list[tuple[dict[str, str], dict[str, np.ndarray]]],
           columns: tuple[str, ...]) -> pd.DataFrame:
    """Stack per-series columns into one frame sorted by time, attributes as str columns."""
    keys = sorted({k for attrs, _ in parts for k in attrs})
    counts = np.array([cols["time"].shape[0] for _, cols in parts], dtype=np.int64)
    data = {c: (np.concatenate([cols[c] for _, cols in parts]) if parts
                else np.empty(0, dtype=np.int64 if c in ("time", "count") else np.float64))
            for c in columns}
    order = np.argsort(data["time"], kind="stable")
    out: dict[str, object] = {
        c: (pd.to_datetime(a[order], unit="ns", utc=True) if c == "time" else a[order])
        for c, a in data.items()}
    for key in keys:
        per_series = np.array([attrs.get(key) for attrs, _ in parts], dtype=object)
        out[key] = pd.array(np.repeat(per_series, counts)[order], dtype="str")
    return pd.DataFrame(out)
