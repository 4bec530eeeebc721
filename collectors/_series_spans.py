"""Each series row's points count and time span (``series.points``, ``first_ns``,
``last_ns``), written to the store lazily.

Every flush used to add its points to every series it touched: at 64 ranks x 250 series the
sidecar flushes about ten times a second, and updating 16,000 rows each time cost about a
third of the ingest rate (bench/results/otlp_ingest_spans_ab.json). Now a flush writes a
series' row only when a reader could otherwise miss its points: the first time the series is
seen since the last sync, when its points reach before the row's ``first_ns``, or when they
reach more than :data:`SPAN_SLACK_NS` past the row's ``last_ns``. The rest waits for the next
sync, at most :data:`SYNC_EVERY_S` later (and at every explicit flush), which writes every
pending row at once. So a row's ``first_ns`` is always exact, its ``last_ns`` trails the
newest committed point by at most :data:`SPAN_SLACK_NS` (readers of a window widen their
series filter by that much), and its count trails by at most one sync interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from collectors._store_rollups import NS

SPAN_SLACK_NS = 10 * NS
"""How far a series row's ``last_ns`` may trail its newest committed point."""
SYNC_EVERY_S = 5.0
"""How long a row's count may wait (wall clock) before a flush writes it anyway."""

_NONE_FIRST = np.iinfo(np.int64).max  # no point yet: any point is before it
_NONE_LAST = np.iinfo(np.int64).min


@dataclass(frozen=True, slots=True)
class _Rows:
    """Series by id (ascending), each with what its row holds at least (``first`` at most,
    ``last`` at least: rows written before this sync began hold more) and what waits."""

    sid: np.ndarray
    first: np.ndarray
    last: np.ndarray
    count: np.ndarray
    pending_first: np.ndarray
    pending_last: np.ndarray

    @classmethod
    def none(cls) -> _Rows:
        return cls(*([np.empty(0, dtype=np.int64)] * len(fields(cls))))

    def select(self, keep: np.ndarray) -> _Rows:
        return _Rows(self.sid[keep], self.first[keep], self.last[keep], self.count[keep],
                     self.pending_first[keep], self.pending_last[keep])


@dataclass(frozen=True, slots=True)
class SpanUpdate:
    """What one flush writes: rows of (series id, points to add, first, last), and the state
    to keep once its transaction commits (a rolled-back flush keeps the state it found)."""

    rows: list[tuple[int, int, int, int]]
    after: _Rows
    synced: bool


class SeriesSpans:
    """The pending counts and spans of the series seen since the last sync (one per writer;
    the writer's file lock serialises its calls)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._rows = _Rows.none()
        self._next_sync = clock() + SYNC_EVERY_S

    def update(self, sids: np.ndarray, counts: np.ndarray, firsts: np.ndarray,
               lasts: np.ndarray, *, sync: bool = False) -> SpanUpdate:
        """The rows a flush of these series (ids ascending and unique, with their points'
        count, first and last time) must write; every waiting row when ``sync`` or the sync
        interval has passed. Call :meth:`committed` with it once the flush commits."""
        old = self._rows
        pos = np.searchsorted(old.sid, sids)
        at = np.minimum(pos, max(old.sid.shape[0] - 1, 0))
        found = (pos < old.sid.shape[0]) & (old.sid[at] == sids) if old.sid.shape[0] \
            else np.zeros(sids.shape[0], dtype=bool)
        hit = at[found]
        count = counts.astype(np.int64, copy=True)
        first = firsts.astype(np.int64, copy=True)
        last = lasts.astype(np.int64, copy=True)
        count[found] += old.count[hit]
        first[found] = np.minimum(first[found], old.pending_first[hit])
        last[found] = np.maximum(last[found], old.pending_last[hit])
        row_first = np.full(sids.shape[0], _NONE_FIRST)
        row_last = np.full(sids.shape[0], _NONE_LAST)
        row_first[found], row_last[found] = old.first[hit], old.last[hit]
        untouched = np.ones(old.sid.shape[0], dtype=bool)
        untouched[hit] = False
        rest = old.select(untouched)
        syncing = sync or self.due
        if syncing:
            # every waiting row; a row with nothing waiting has been idle since the last
            # sync or longer, and is forgotten (seen again, it is written at once)
            waiting = rest.count > 0
            sid, count, first, last, row_first, row_last = (
                np.concatenate([a, b[waiting]]) for a, b in (
                    (sids, rest.sid), (count, rest.count), (first, rest.pending_first),
                    (last, rest.pending_last), (row_first, rest.first), (row_last, rest.last)))
            due = np.ones(sid.shape[0], dtype=bool)
        else:
            sid = sids
            due = ~found | (firsts < row_first) | (lasts > row_last + SPAN_SLACK_NS)
        touched = _Rows(sid, np.where(due, np.minimum(row_first, first), row_first),
                        np.where(due, np.maximum(row_last, last), row_last),
                        np.where(due, 0, count), np.where(due, _NONE_FIRST, first),
                        np.where(due, _NONE_LAST, last))
        after = touched if syncing else _concat(rest, touched)
        return SpanUpdate(rows=_row_list(sid[due], count[due], first[due], last[due]),
                          after=after.select(np.argsort(after.sid, kind="stable")),
                          synced=syncing)

    @property
    def waiting(self) -> bool:
        """Whether some row's count waits for the next sync."""
        return bool((self._rows.count > 0).any())

    @property
    def due(self) -> bool:
        """Whether the sync interval has passed: a flush with nothing to commit syncs then,
        so a store whose writers went quiet does not keep its last counts waiting."""
        return self._clock() >= self._next_sync

    def committed(self, update: SpanUpdate) -> None:
        """The flush that wrote ``update.rows`` committed: keep its state."""
        self._rows = update.after
        if update.synced:
            self._next_sync = self._clock() + SYNC_EVERY_S


def _concat(a: _Rows, b: _Rows) -> _Rows:
    return _Rows(*(np.concatenate([getattr(a, f.name), getattr(b, f.name)])
                   for f in fields(_Rows)))


def _row_list(sid: np.ndarray, count: np.ndarray, first: np.ndarray, last: np.ndarray
              ) -> list[tuple[int, int, int, int]]:
    return list(zip(sid.tolist(), count.tolist(), first.tolist(), last.tolist(), strict=True))
