"""The store's SQLite file: its tables and format header, opening it, transactions, busy retries.

Tables (why each is shaped so: :mod:`collectors._store`): ``series`` (name, canonical JSON
attributes, point count and time span), ``times`` (encoded timestamp columns by content hash),
``chunks`` (raw points per series and 2-hour block), ``rollups`` (per series 1-minute and
1-hour buckets), ``rollup_journal`` (each flush's 1-minute buckets of every series, not
folded into ``rollups`` yet) and ``points_journal`` (each flush's raw points of the series
with few of them, not folded into ``chunks`` yet: :mod:`collectors._store_points_journal`).
"""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

from collectors._errors import SeedanceError

_T = TypeVar("_T")

_FORMAT = "seedance-tsdb"
_FORMAT_VERSION = "4"
_READABLE_VERSIONS = ("1", "2", "3", "4")  # 1: no journals; 2: no points_journal;
# 3: no value bounds on chunks

_SCHEMA = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE series(id INTEGER PRIMARY KEY, name TEXT NOT NULL, attrs TEXT NOT NULL,
                    points INTEGER NOT NULL DEFAULT 0, first_ns INTEGER, last_ns INTEGER,
                    UNIQUE(name, attrs));
CREATE TABLE times(id INTEGER PRIMARY KEY, digest BLOB NOT NULL UNIQUE, data BLOB NOT NULL);
CREATE TABLE chunks(id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL,
                    block_ns INTEGER NOT NULL, t_min INTEGER NOT NULL, t_max INTEGER NOT NULL,
                    n INTEGER NOT NULL, times_id INTEGER NOT NULL, vals BLOB NOT NULL,
                    v_nans INTEGER, v_min REAL, v_max REAL);
CREATE INDEX chunks_by_series ON chunks(series_id, block_ns);
CREATE INDEX chunks_by_times ON chunks(times_id);
CREATE TABLE rollups(id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL,
                     step_s INTEGER NOT NULL, block_ns INTEGER NOT NULL, n INTEGER NOT NULL,
                     data BLOB NOT NULL);
CREATE INDEX rollups_by_series ON rollups(series_id, step_s, block_ns);
"""
# AUTOINCREMENT: a journal row id is never reused, so decoded rows can be cached by id.
_JOURNAL_TABLES = {
    "rollup_journal": """CREATE TABLE rollup_journal(id INTEGER PRIMARY KEY AUTOINCREMENT,
                                                 n INTEGER NOT NULL, data BLOB NOT NULL)""",
    "points_journal": """CREATE TABLE points_journal(id INTEGER PRIMARY KEY AUTOINCREMENT,
                                                 n INTEGER NOT NULL, data BLOB NOT NULL)""",
}


# A chunk's value bounds (NaN count, lowest and highest other value; inf and -inf when all
# are NaN): NULL in chunks written before format 4.
_BOUNDS_COLUMNS = {"v_nans": "INTEGER", "v_min": "REAL", "v_max": "REAL"}


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


def canonical_attrs(attributes: Mapping[str, str]) -> str:
    """The ``series.attrs`` key of an attribute set: sorted JSON, str values only."""
    for key, value in attributes.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise StoreError(f"attribute {key!r}={value!r} must be str=str "
                             f"(got {type(key).__name__}={type(value).__name__})")
    return json.dumps(dict(sorted(attributes.items())), separators=(",", ":"))


def has_journal(conn: sqlite3.Connection) -> bool:
    """Format 2 has a rollup journal; a format-1 file opened read-only has none."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                        "name = 'rollup_journal'").fetchone() is not None


def chunk_columns(conn: sqlite3.Connection) -> set[str]:
    return {r[1] for r in conn.execute("PRAGMA table_info(chunks)")}


def has_value_bounds(conn: sqlite3.Connection) -> bool:
    """Whether chunks can carry value bounds (a format 3 file opened read-only cannot)."""
    return set(_BOUNDS_COLUMNS) <= chunk_columns(conn)


ROWS_PER_STATEMENT = 512
"""Rows a statement of :func:`execute_rows` takes at most."""


@functools.lru_cache(maxsize=64)
def _values_list(rows: int, width: int) -> str:
    return ",".join(["(" + ",".join("?" * width) + ")"] * rows)


def execute_rows(conn: sqlite3.Connection, sql: str, rows: Sequence[Sequence[object]]) -> None:
    """Run ``sql`` for ``rows``, its ``{values}`` standing for a VALUES list of them (whose
    columns SQLite names ``column1``, ``column2``...), in statements of up to
    ``ROWS_PER_STATEMENT`` rows and then of powers of two, so that few shapes of it take room
    in the connection's statement cache.

    Not ``executemany``: it gives up the interpreter lock around every row's step, and in a
    busy sidecar each row then waits for the lock to come back; a flush's 16,000-row update
    took 2.8 s instead of 19 ms beside one busy thread, and 20 ms as these statements."""
    if not rows:
        return
    width = len(rows[0])
    most = max(1, min(ROWS_PER_STATEMENT,
                      conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // width))
    done = 0
    while done < len(rows):
        left = len(rows) - done
        size = most if left >= most else 1 << (left.bit_length() - 1)
        conn.execute(sql.replace("{values}", _values_list(size, width)),
                     [field for row in rows[done:done + size] for field in row])
        done += size


def _is_busy(e: sqlite3.OperationalError) -> bool:
    text = str(e).lower()
    return "locked" in text or "busy" in text


@contextmanager
def transaction(conn: sqlite3.Connection, mode: str = "IMMEDIATE") -> Iterator[None]:
    """``BEGIN mode`` ... ``COMMIT``, rolled back when the body raises."""
    conn.execute(f"BEGIN {mode}")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    if conn.in_transaction:
        conn.execute("COMMIT")


class StoreFile:
    """One open store file: its connection, the lock that serialises it, and busy retries.

    Writers and readers of the same :class:`TimeSeriesStore` share one instance.
    """

    def __init__(self, path: Path, *, readonly: bool, config: StoreConfig) -> None:
        self.path = path
        self.readonly = readonly
        self.config = config
        self.lock = threading.RLock()  # guards the connection and the caches built on it
        self.closed = False
        self.conn = self._connect()

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
            self.retry(lambda: self._prepare(conn))
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
            with transaction(conn):
                if not conn.execute("SELECT 1 FROM sqlite_master").fetchone():
                    for statement in [*_SCHEMA.split(";"), *_JOURNAL_TABLES.values()]:
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
            if found["version"] != _FORMAT_VERSION:  # 1-3 -> 4: add what they lack, empty
                with transaction(conn):
                    for table, statement in _JOURNAL_TABLES.items():
                        if table not in tables:
                            conn.execute(statement)
                    for column, kind in _BOUNDS_COLUMNS.items():
                        if column not in chunk_columns(conn):
                            conn.execute(f"ALTER TABLE chunks ADD COLUMN {column} {kind}")
                    conn.execute("UPDATE meta SET value = ? WHERE key = 'version'",
                                 (_FORMAT_VERSION,))

    def retry(self, attempt: Callable[[], _T]) -> _T:
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

    def check_open(self) -> None:
        """Refuse to go on with a closed store."""
        if self.closed:
            raise StoreError(f"store {self.path} is closed")

    def check_writable(self) -> None:
        """Refuse to write to a store opened read-only."""
        if self.readonly:
            raise StoreError(f"store {self.path} is open read-only")

    def close(self) -> None:
        """Close the connection; later reads and writes are refused."""
        self.closed = True
        with self.lock:
            self.conn.close()
