"""The embedded time-series store: one local SQLite file (WAL), no server, queried into pandas.

One writer process (the sidecar) buffers points and commits them once per flush; other
processes open the file with ``readonly=True`` and never wait for the writer. Raw points are
kept ``raw_retention_s`` (2 days by default), 1-minute rollups 30 days, 1-hour rollups a year.
This module puts together the file (:mod:`collectors._store_file`), the rollups
(:mod:`collectors._store_rollups`), the points journal (:mod:`collectors._store_points_journal`), the writer (:mod:`collectors._store_writer`), retention
(:mod:`collectors._store_retention`) and queries (:mod:`collectors._store_query`) as
:class:`TimeSeriesStore`.

docs/internals.md, 'The time-series store' explains the tables, concurrency and retention.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from collectors._otlp_decode import DecodedMetrics
from collectors._points import Point
from collectors._store_file import StoreConfig, StoreFile
from collectors._store_points_journal import PointsJournalView
from collectors._store_query import StoreQueries
from collectors._store_reader import Resolution, ValueBounds
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
        journal, points = JournalView(), PointsJournalView()
        self._writer = StoreWriter(self._file, journal, points)
        # a read commits what is buffered first, but leaves the series rows' counts to the sync
        self._queries = StoreQueries(self._file, journal, points,
                                     partial(self._writer.flush, sync_spans=False))
        self._committed = self._queries.without_flush()
        if not readonly:
            self._writer.start_flusher()

    # -- writing -------------------------------------------------------------------------

    def write(self, points: Iterable[Point]) -> None:
        """Buffer points; they are committed by the next flush."""
        self._writer.write(points)

    def write_decoded(self, decoded: DecodedMetrics) -> None:
        """Buffer a decoded request's points: as columns when it is a repeat export (a
        :class:`Shape`), so no Point is ever built for it."""
        if decoded.shape is not None:
            assert decoded.times is not None and decoded.values is not None
            self._writer.write_shape(decoded.shape, decoded.times, decoded.values)
        else:
            self._writer.write(decoded.points)

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

    def value_bounds(self, name: str, *, where: Mapping[str, str] | None = None,
                     keep: Callable[[Mapping[str, str]], bool], since_ns: int,
                     until_ns: int) -> ValueBounds | None:
        """Bounds on the raw values of ``name``'s series whose attributes include ``where``
        and that ``keep`` accepts, in
        [since_ns, until_ns], without decoding a point of a folded chunk: the bounds of
        every chunk reaching into the range (a superset), and the journal's points in it.
        None while such a chunk was written before format 4."""
        return self._queries.value_bounds(name, where=where, keep=keep, since_ns=since_ns,
                                          until_ns=until_ns)

    def metrics(self) -> pd.DataFrame:
        """One row per metric name: series count, points written, first and last timestamp.
        While the flusher runs, the counts may leave out the last few seconds' points and
        the last timestamp trail by up to ``SPAN_SLACK_NS`` (:mod:`collectors._series_spans`);
        after :meth:`flush` or :meth:`close` both are exact."""
        return self._queries.metrics()

    def attribute_values(self, attribute: str, *, active_since_ns: int | None = None
                         ) -> list[str]:
        """The distinct values of ``attribute`` over every series (those with a point at or
        after ``active_since_ns`` when given), sorted: the jobs a store holds, in one read.
        While the flusher runs, a series whose only points since then are from the last
        ``SPAN_SLACK_NS`` may be left out (:mod:`collectors._series_spans`)."""
        return self._queries.attribute_values(attribute, active_since_ns=active_since_ns)

    def series(self, name: str, *, active_since_ns: int | None = None
               ) -> list[dict[str, str]]:
        """The attribute sets of the series of ``name``, in creation order: every one, or
        those with a point at or after ``active_since_ns`` (as in :meth:`attribute_values`,
        a running flusher may leave out a series whose only such points are that recent)."""
        return self._queries.series(name, active_since_ns=active_since_ns)

    def committed(self) -> StoreQueries:
        """The same reads of what is committed only, without the commit each of this store's
        own reads makes first: at most ``flush_interval_s`` behind while the flusher runs.
        For readers that take each pass's newest second as it comes, as they take a
        Prometheus source's scrape lag (the policy engine): at 64 OTLP exporters its reads
        made a third of the store's commits, each a transaction and a rollup-journal row of
        its own."""
        return self._committed

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
