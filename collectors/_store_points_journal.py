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


def _merged(parts: list[Columns]) -> Columns:
    """One run of ``parts`` (each grouped by series, oldest first), grouped by series with a
    series' older points first."""
    series, times, values = (np.concatenate([p[k] for p in parts]) for k in range(3))
    order = np.argsort(series, kind="stable")  # merges runs: a series' older points stay first
    return series[order], times[order], values[order]


class PointsJournalView:
    """The journal's points, grouped by series, kept across queries and extended by the rows
    each flush adds (row ids are never reused): every raw query of a flush interval reads the
    same rows. Used under the store file's lock.

    Kept as a few runs, oldest first, each grouped by series, merged as a binary counter does
    (a run merges with the one before it once that one is no larger): a flush adds a run and
    never re-sorts the whole journal, which at 500k points/s is millions of points re-sorted
    for each policy pass; each point is merged about log2(flushes) times until the fold, and
    a query reads at most that many runs."""

    def __init__(self) -> None:
        self._ids: tuple[int, ...] = ()
        self._runs: list[Columns] = []

    def runs(self, conn: sqlite3.Connection) -> list[Columns]:
        """The journal's points as runs, oldest first, each grouped by series (none without a
        journal)."""
        if not has_points_journal(conn):
            return []
        ids = tuple(r[0] for r in conn.execute("SELECT id FROM points_journal ORDER BY id"))
        if ids == self._ids:
            return self._runs
        if self._ids and ids[:len(self._ids)] == self._ids:  # rows were only added
            runs, after = list(self._runs), self._ids[-1]
        else:
            runs, after = [], -1
        for _, n, data in conn.execute(
                "SELECT id, n, data FROM points_journal WHERE id > ? ORDER BY id", (after,)):
            runs.append(tuple(codec.decode_frame(data, _KINDS, n)))  # type: ignore[arg-type]
            while len(runs) > 1 and runs[-2][0].shape[0] <= runs[-1][0].shape[0]:
                runs[-2:] = [_merged(runs[-2:])]
        self._ids, self._runs = ids, runs
        return runs

    def columns(self, conn: sqlite3.Connection) -> Columns:
        """Every journal point, grouped by series (empty without a journal): for the fold."""
        runs = self.runs(conn)
        return _EMPTY if not runs else runs[0] if len(runs) == 1 else _merged(runs)

    def of_series(self, conn: sqlite3.Connection, sids: list[int]
                  ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """(times, values) of the journal's points of each of ``sids`` that has any."""
        wanted = np.asarray(sids, dtype=np.int64)
        found: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for series, times, values in self.runs(conn):
            starts = np.searchsorted(series, wanted, side="left")
            stops = np.searchsorted(series, wanted, side="right")
            for i in np.flatnonzero(stops > starts).tolist():
                a, b = int(starts[i]), int(stops[i])
                ts, vs = found.setdefault(sids[i], ([], []))
                ts.append(times[a:b])
                vs.append(values[a:b])
        return {sid: (ts[0], vs[0]) if len(ts) == 1 else (np.concatenate(ts), np.concatenate(vs))
                for sid, (ts, vs) in found.items()}
