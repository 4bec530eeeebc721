"""The points journal: each flush's few-points-per-series raw points in ONE row, until a fold.

An OTLP exporter sends every series once per export, so a flush held one or two points of
each of thousands of series, and writing each its own chunk (a statement, a timestamp column,
a merge every eighth flush) cost the sidecar about a millisecond per point. A flush now writes
the points of those series as one ``points_journal`` row (series id, time, value columns); the
fold that already runs about once a minute moves them into per-series chunks, a minute's
points at once. Series with many points in one flush still go straight to their chunks.

Queries add the journal's points of the series they read, so nothing is invisible between a
flush and a fold; a crash leaves the rows for the next writer's fold.
"""

from __future__ import annotations

import sqlite3

import numpy as np

from collectors import _store_codec as codec

_KINDS = "ttv"  # series id and time as int64 columns, value as float64
DIRECT_AT_POINTS = 64
"""A series with at least this many points in one flush gets its own chunk right away."""

Columns = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(series ids, times, values), grouped by series (arrival order within one)."""

_EMPTY: Columns = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))


def has_points_journal(conn: sqlite3.Connection) -> bool:
    """Format 3 has a points journal; an older file opened read-only has none."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                        "name = 'points_journal'").fetchone() is not None


def append(conn: sqlite3.Connection, series: np.ndarray, times: np.ndarray,
           values: np.ndarray) -> None:
    """Add one flush's points as one row (inside the caller's transaction)."""
    conn.execute("INSERT INTO points_journal(n, data) VALUES(?, ?)",
                 (int(series.shape[0]), codec.encode_frame(_KINDS, [series, times, values])))


def sort_columns(series: np.ndarray, times: np.ndarray, values: np.ndarray) -> Columns:
    """By series, then time (a flush's points, before they are counted and journaled)."""
    order = np.lexsort((times, series))
    return series[order], times[order], values[order]


class PointsJournalView:
    """The journal's points, grouped by series, kept across queries and extended by the rows
    each flush adds (row ids are never reused): every raw query of a flush interval reads the
    same rows, and re-sorting a minute of a busy sidecar's points each time held the file's
    lock for longer than a flush. Used under the store file's lock."""

    def __init__(self) -> None:
        self._combined: tuple[tuple[int, ...], Columns] = ((), _EMPTY)

    def columns(self, conn: sqlite3.Connection) -> Columns:
        """Every journal point, grouped by series (empty without a journal)."""
        if not has_points_journal(conn):
            return _EMPTY
        ids = tuple(r[0] for r in conn.execute("SELECT id FROM points_journal ORDER BY id"))
        known, combined = self._combined
        if ids == known:
            return combined
        if known and ids[:len(known)] == known:  # rows were only added: merge the new ones
            parts, after = [combined], known[-1]
        else:
            parts, after = [], -1
        for _, n, data in conn.execute(
                "SELECT id, n, data FROM points_journal WHERE id > ? ORDER BY id", (after,)):
            parts.append(tuple(codec.decode_frame(data, _KINDS, n)))  # type: ignore[arg-type]
        series, times, values = (np.concatenate([p[k] for p in parts]) if parts
                                 else _EMPTY[k] for k in range(3))
        # stable: a series' older points stay first; the parts are runs already grouped
        order = np.argsort(series, kind="stable")
        combined = (series[order], times[order], values[order])
        self._combined = (ids, combined)
        return combined

    def of_series(self, conn: sqlite3.Connection, sids: list[int]
                  ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """(times, values) of the journal's points of each of ``sids`` that has any."""
        series, times, values = self.columns(conn)
        if series.shape[0] == 0:
            return {}
        wanted = np.asarray(sids, dtype=np.int64)
        starts = np.searchsorted(series, wanted, side="left")
        stops = np.searchsorted(series, wanted, side="right")
        return {sid: (times[a:b], values[a:b])
                for sid, a, b in zip(sids, starts.tolist(), stops.tolist(), strict=True)
                if b > a}
