"""Rollup arithmetic of the store: bucketing points, merging buckets, their blob encoding, and
the decoded view of the rollup journal that folds and queries share.

A bucket row holds min, max, sum, count, last and the time of last (``last_ns``), so pieces of
the same bucket written by different flushes, late points included, merge exactly.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence

import numpy as np

from collectors import _store_codec as codec
from collectors._store_file import has_journal

NS = 1_000_000_000
RAW_BLOCK_NS = 2 * 3600 * NS
"""Raw chunks never cross a 2-hour block (aligned to the epoch, like Prometheus TSDB blocks)."""
ROLLUP_BLOCK_NS = {60: 86_400 * NS, 3600: 30 * 86_400 * NS}
"""Rollup pieces never cross a block: a day of 1-minute buckets, 30 days of 1-hour ones."""
MERGE_AT_CHUNKS = 8
"""A block's pieces of about one size are merged into one row when this many pile up."""
MAX_PIECES = 4 * MERGE_AT_CHUNKS
"""A block's pieces are all merged when this many pile up (sizes too uneven to tier)."""
_SAME_TIER = 4  # a piece at most this many times the size of the newer ones is of their tier
AGG_FIELDS = ("bucket", "min", "max", "sum", "count", "last", "last_ns")
_AGG_KINDS = "tvvvvvt"  # codec kind of each AGG_FIELDS column
_JOURNAL_FIELDS = ("series", *AGG_FIELDS)
_JOURNAL_KINDS = "t" + _AGG_KINDS  # the series id is an int64 column like a timestamp

Agg = dict[str, np.ndarray]
"""Bucket rows as columns (``AGG_FIELDS``, and "series" when rows of many series mix)."""


def points_agg(times_ns: np.ndarray, values: np.ndarray, step_ns: int,
               series: np.ndarray | None = None) -> Agg:
    """Rollup buckets of points (NaN values are left out of rollups); with ``series`` (one
    series id per point) the buckets of many series at once, with a "series" column."""
    keep = ~np.isnan(values)
    t, v = times_ns[keep], values[keep]
    agg = {"bucket": t // step_ns * step_ns, "min": v, "max": v, "sum": v,
           "count": np.ones(t.shape[0]), "last": v, "last_ns": t}
    if series is not None:
        agg["series"] = series[keep]
    return combine(agg, presorted=series is None)


def combine(agg: Agg, *, presorted: bool) -> Agg:
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


def pieces_to_merge(sizes: Sequence[int], new: int, sealed: bool) -> int:
    """How many of a block's newest pieces (``sizes``: their rows, oldest first) to merge
    with a new piece of ``new`` rows: all of them once the block is sealed, else tiered, as an
    LSM tree compacts: MERGE_AT_CHUNKS pieces of about one size become one piece of the next
    tier, which may complete that tier in turn.

    Merging every piece at each MERGE_AT_CHUNKS re-encoded the whole block so far every 7
    folds: over a 2-hour block of one fold a minute a point was encoded 11 times, and folds
    cost more as the block filled. Tiered, 3.3 times, and a block holds at most 7 pieces per
    tier (14 at a fold a minute)."""
    if sealed or len(sizes) + 1 >= MAX_PIECES:
        return len(sizes)
    take, merged = 0, new
    while True:
        run = 0
        for size in reversed(sizes[:len(sizes) - take]):
            if size > _SAME_TIER * merged:
                break
            run += 1
        if run + 1 < MERGE_AT_CHUNKS:
            return take
        take += run
        merged = new + sum(sizes[len(sizes) - take:])


def encode_aggs(aggs: list[Agg]) -> list[bytes]:
    """Series' bucket rows as ``rollups.data`` blobs, one each (encoded together)."""
    return codec.encode_frames(_AGG_KINDS, [[agg[k] for k in AGG_FIELDS] for agg in aggs])


def decode_agg(blob: bytes, n: int) -> Agg:
    """The ``n`` bucket rows of a ``rollups.data`` blob."""
    return dict(zip(AGG_FIELDS, codec.decode_frame(blob, _AGG_KINDS, n), strict=True))


def encode_journal(agg: Agg) -> bytes:
    """Bucket rows of many series (with their "series" column) as a ``rollup_journal`` blob."""
    return codec.encode_frame(_JOURNAL_KINDS, [agg[k] for k in _JOURNAL_FIELDS])


def hour_buckets(agg: Agg) -> Agg:
    """1-minute buckets (sorted by series, bucket) regrouped into 1-hour buckets."""
    return combine(dict(agg, bucket=agg["bucket"] // (3600 * NS) * (3600 * NS)),
                   presorted=True)


def by_series(agg: Agg) -> Iterator[tuple[int, Agg]]:
    """(series id, its rows without the series column) of rows sorted by series."""
    series = agg["series"]
    if series.shape[0] == 0:
        return
    starts = np.flatnonzero(np.r_[True, series[1:] != series[:-1]])
    for start, stop in zip(starts, np.r_[starts[1:], series.shape[0]], strict=True):
        yield int(series[start]), {k: agg[k][start:stop] for k in AGG_FIELDS}


def split_by_block(times_ns: np.ndarray, block_ns: int) -> Iterator[tuple[int, slice, bool]]:
    """Yield (block start, slice, sealed) runs of sorted timestamps.

    A block is sealed when the same batch already reaches a later block: the series has moved
    on, so the block's pieces can be merged into their final single row.
    """
    if times_ns.size == 0:  # e.g. the rollup of a batch whose values are all NaN
        return
    blocks = times_ns // block_ns * block_ns
    if blocks[0] == blocks[-1]:  # one block: nearly every piece a fold writes
        yield int(blocks[0]), slice(0, int(blocks.shape[0])), False
        return
    starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]])
    for i, start in enumerate(starts):
        last = i + 1 == len(starts)
        stop = blocks.shape[0] if last else starts[i + 1]
        yield int(blocks[start]), slice(int(start), int(stop)), not last


class JournalView:
    """The rollup journal's buckets, decoded once per row: a fold reads them all and every
    rollup query adds those of its series, so rows are cached by id (never reused) until
    they are folded away. Used under the store file's lock."""

    def __init__(self) -> None:
        self._decoded: dict[int, Agg] = {}  # journal row id -> its buckets
        self._series: tuple[tuple[int, ...], dict[int, Agg]] = ((), {})

    def agg(self, conn: sqlite3.Connection) -> Agg:
        """The journal's 1-minute buckets of every series, combined, sorted by series and
        bucket (empty on a format-1 file, which has no journal)."""
        rows = conn.execute("SELECT id, n, data FROM rollup_journal ORDER BY id").fetchall(
        ) if has_journal(conn) else []
        decoded = {i: self._decoded.get(i) or dict(zip(
            _JOURNAL_FIELDS, codec.decode_frame(data, _JOURNAL_KINDS, n), strict=True))
            for i, n, data in rows}
        self._decoded = decoded
        return combine({k: np.concatenate([d[k] for d in decoded.values()]) if decoded
                        else np.empty(0, np.int64) for k in _JOURNAL_FIELDS}, presorted=False)

    def of_series(self, conn: sqlite3.Connection) -> dict[int, Agg]:
        """:meth:`agg` split by series, cached until the journal's rows change."""
        ids = tuple(r[0] for r in conn.execute(
            "SELECT id FROM rollup_journal ORDER BY id")) if has_journal(conn) else ()
        if ids != self._series[0]:
            self._series = (ids, dict(by_series(self.agg(conn))))
        return self._series[1]
