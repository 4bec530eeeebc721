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

Modules, one job each: the file, its tables and transactions (:mod:`collectors._store_file`),
rollup arithmetic and the journal's decoded view (:mod:`collectors._store_rollups`), buffering,
commits and folds (:mod:`collectors._store_writer`), retention
(:mod:`collectors._store_retention`), queries into pandas (:mod:`collectors._store_query`);
this one puts them together as :class:`TimeSeriesStore`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from collectors._points import Point
from collectors._store_file import StoreConfig, StoreFile
from collectors._store_query import StoreQueries
from collectors._store_reader import Resolution
from collectors._store_rollups import JournalView
from collectors._store_writer import StoreWriter


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
        self._file = StoreFile(self.path, readonly=readonly, config=self.config)
        journal = JournalView()
        self._writer = StoreWriter(self._file, journal)
        self._queries = StoreQueries(self._file, journal, self._writer.flush)
        if not readonly:
            self._writer.start_flusher()

    # -- writing -------------------------------------------------------------------------

    def write(self, points: Iterable[Point]) -> None:
        """Buffer points; they are committed by the next flush."""
        self._writer.write(points)

    def write_series(self, name: str, attributes: Mapping[str, str], times_ns: np.ndarray,
                     values: np.ndarray) -> None:
        """Buffer one series' points given as columns (the fast path)."""
        self._writer.write_series(name, attributes, times_ns, values)

    @property
    def buffered(self) -> int:
        """Points waiting for the next flush."""
        return self._writer.buffered

    def buffered_by(self, attribute: str) -> dict[str, int]:
        """Points waiting for the next flush, by the value of ``attribute`` ("" without it)."""
        return self._writer.buffered_by(attribute)

    @property
    def write_error(self) -> str | None:
        """Why the last flush failed (None: it committed); buffered points wait for the next."""
        return self._writer.write_error

    def flush(self) -> None:
        """Commit every buffered point in one transaction (a no-op on a read-only store)."""
        self._writer.flush()

    def fold(self) -> None:
        """Move the rollup journal's buckets into each series' rollups (a no-op on a
        read-only store); flushes do it about once a minute, and close does."""
        self._writer.fold()

    def prune(self, *, now_ns: int | None = None) -> None:
        """Delete data past its retention, relative to ``now_ns`` (default: the wall clock)."""
        self._writer.prune(now_ns=now_ns)

    # -- reading -------------------------------------------------------------------------

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
        return self._queries.query(name, where=where, since_ns=since_ns, until_ns=until_ns,
                                   resolution=resolution)

    def metrics(self) -> pd.DataFrame:
        """One row per metric name: series count, points written, first and last timestamp."""
        return self._queries.metrics()

    def series(self, name: str) -> list[dict[str, str]]:
        """The attribute sets of every series of ``name``, in creation order."""
        return self._queries.series(name)

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the flusher, commit what is buffered, close the file; a second call is a no-op."""
        if self._file.closed:
            return
        self._writer.stop_flusher()
        try:
            self._writer.flush()
            self._writer.fold()
        finally:
            self._file.close()

    def __enter__(self) -> TimeSeriesStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
