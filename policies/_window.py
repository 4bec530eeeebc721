"""Read-only views of the time-series store that detectors evaluate: one job, one time range.

One adapter, :class:`StoreWindow`, sits over any :class:`collectors.StoreReader`: the real
:class:`collectors.TimeSeriesStore`, or :class:`FrameStore`, an in-memory stand-in built from
DataFrames for tests and replays. So detectors see the same frames in both. Finding the jobs
(:class:`WindowSource`) also needs a store that lists what it holds (:class:`ListableStore`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np
import pandas as pd

from collectors import BoundsReader, Point, Resolution, StoreReader, ValueBounds
from collectors.names import ATTR_SERVICE_NAME

JOB_ATTRIBUTE = ATTR_SERVICE_NAME
"""The attribute that names the job a point belongs to (OpenTelemetry resource attribute)."""


class ListableStore(StoreReader, Protocol):
    """A reader that also lists the values an attribute takes, so jobs can be discovered from
    it (``collectors.TimeSeriesStore`` and :class:`FrameStore` are)."""

    def attribute_values(self, attribute: str, *, active_since_ns: int | None = None
                         ) -> list[str]:
        """The distinct values of ``attribute`` over every series (those with a point at or
        after ``active_since_ns``), sorted."""
        ...


def _empty_frame() -> pd.DataFrame:
    return pd.DataFrame({"time": pd.to_datetime(np.empty(0, dtype=np.int64), unit="ns", utc=True),
                         "value": np.empty(0, dtype=np.float64)})


class StoreWindow:
    """The store as one detector evaluation sees it: bound to ``job`` and [since_ns, until_ns].

    :meth:`query` narrows, never widens: its own bounds are clipped to the window's, and rows of
    other jobs are dropped. Series that carry no job attribute (host-level: GPU, NVML, scrape)
    are kept, because the sidecar watches the host its job runs on. Read-only and cheap to make;
    not shared between threads. Each distinct query is read once: the detectors of one policy
    pass share a window, and several read the same series (a job's thousands of module norms
    were read once per detector). So a window is a snapshot, not a live view.
    """

    def __init__(self, store: StoreReader, *, job: str, since_ns: int, until_ns: int,
                 job_attribute: str = JOB_ATTRIBUTE) -> None:
        if since_ns > until_ns:
            raise ValueError(f"since_ns ({since_ns}) must not be after until_ns ({until_ns})")
        self._store = store
        self.job = job
        self.since_ns = since_ns
        self.until_ns = until_ns
        self.job_attribute = job_attribute
        self._read: dict[tuple[object, ...], pd.DataFrame] = {}
        self._bounds: dict[str, ValueBounds] = {}

    def query(self, name: str, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None, *,
              resolution: Resolution = "raw") -> pd.DataFrame:
        """Points of ``name`` in this window (columns as ``TimeSeriesStore.query`` returns)."""
        lo = self.since_ns if since_ns is None else max(since_ns, self.since_ns)
        hi = self.until_ns if until_ns is None else min(until_ns, self.until_ns)
        if lo > hi:
            return _empty_frame()
        key = (name, tuple(sorted((where or {}).items())), lo, hi, resolution)
        frame = self._read.get(key)
        if frame is None:
            frame = self._store.query(name, where=where, since_ns=lo, until_ns=hi,
                                      resolution=resolution)
            if self.job_attribute in frame.columns:
                column = frame[self.job_attribute]
                frame = frame[column.isna() | (column == self.job)].reset_index(drop=True)
            self._read[key] = frame
        # A shallow copy (copy-on-write): a caller that adds a column changes only its own.
        return frame.copy(deep=False)

    def value_bounds(self, name: str) -> ValueBounds:
        """Bounds on the values of ``name`` in this window: the store's own when it keeps them
        (of a superset: whole chunks), else those of the window's points. For a detector
        that first asks whether anything could be wrong: a job's thousands of module norms
        then cost one aggregate instead of a frame. Read once per window, as queries are."""
        found = self._bounds.get(name)
        if found is None and isinstance(self._store, BoundsReader):
            found = self._store.value_bounds(name, keep=self._keeps, since_ns=self.since_ns,
                                             until_ns=self.until_ns)
        if found is None:
            frame = self.query(name)
            found = ValueBounds.of(frame["value"].to_numpy(np.float64),
                                   frame["time"].to_numpy(np.int64))
        self._bounds[name] = found
        return found

    def _keeps(self, attributes: Mapping[str, str]) -> bool:
        """Whether this window reads a series with these attributes (as :meth:`query`)."""
        job = attributes.get(self.job_attribute)
        return job is None or job == self.job


class FrameStore:
    """An in-memory, read-only store built from DataFrames, with the real store's query API.

    ``frames`` maps a metric name to a frame with ``time`` (datetime64 or int ns), ``value`` and
    one column per attribute. Only raw resolution exists here: every ``resolution`` returns raw
    points. For tests and for replaying recorded data through the same detectors.
    """

    def __init__(self, frames: Mapping[str, pd.DataFrame]) -> None:
        self._frames = {name: self._normalise(frame) for name, frame in frames.items()}

    @staticmethod
    def _normalise(frame: pd.DataFrame) -> pd.DataFrame:
        for column in ("time", "value"):
            if column not in frame.columns:
                raise ValueError(f"frame needs a {column!r} column, has {list(frame.columns)}")
        out = frame.copy()
        time = out["time"]
        if pd.api.types.is_integer_dtype(time):
            out["time"] = pd.to_datetime(time, unit="ns", utc=True)
        else:
            out["time"] = pd.to_datetime(time, utc=True).astype("datetime64[ns, UTC]")
        out["value"] = out["value"].astype(np.float64)
        for column in out.columns.difference(["time", "value"]):
            out[column] = out[column].astype("str")
        return out.sort_values("time", kind="stable").reset_index(drop=True)

    @classmethod
    def from_points(cls, points: Iterable[Point]) -> FrameStore:
        """A store holding these points (attributes become columns)."""
        rows: dict[str, list[dict[str, object]]] = {}
        for p in points:
            rows.setdefault(p.name, []).append(
                {"time": p.time_ns, "value": p.value, **p.attributes})
        return cls({name: pd.DataFrame(r) for name, r in rows.items()})

    def query(self, name: str, *, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None,
              resolution: Resolution = "auto") -> pd.DataFrame:
        """Raw points of ``name`` whose attributes include ``where``, in [since_ns, until_ns]."""
        frame = self._frames.get(name)
        if frame is None:
            return _empty_frame()
        keep = np.ones(len(frame), dtype=bool)
        t = frame["time"].to_numpy(dtype=np.int64)
        if since_ns is not None:
            keep &= t >= since_ns
        if until_ns is not None:
            keep &= t <= until_ns
        for key, value in (where or {}).items():
            if key not in frame.columns:
                return frame.iloc[0:0].reset_index(drop=True)
            keep &= (frame[key] == value).fillna(False).to_numpy(dtype=bool)
        return frame[keep].reset_index(drop=True)

    def metrics(self) -> pd.DataFrame:
        """One row per metric name (name, series, points, first, last)."""
        return pd.DataFrame({
            "name": list(self._frames),
            "series": [len(self.series(n)) for n in self._frames],
            "points": [len(f) for f in self._frames.values()],
            "first": [f["time"].min() for f in self._frames.values()],
            "last": [f["time"].max() for f in self._frames.values()],
        })

    def attribute_values(self, attribute: str, *, active_since_ns: int | None = None
                         ) -> list[str]:
        """The distinct values of ``attribute`` over every frame (of points at or after
        ``active_since_ns`` when given), sorted."""
        found: set[str] = set()
        for frame in self._frames.values():
            if attribute not in frame.columns:
                continue
            if active_since_ns is not None:
                frame = frame[frame["time"].to_numpy(dtype=np.int64) >= active_since_ns]
            found.update(v for v in frame[attribute].unique() if isinstance(v, str))
        return sorted(found)

    def series(self, name: str, *, active_since_ns: int | None = None
               ) -> list[dict[str, str]]:
        """The distinct attribute sets of ``name`` (of its points at or after
        ``active_since_ns`` when given)."""
        frame = self._frames.get(name)
        if frame is None:
            return []
        if active_since_ns is not None:
            frame = frame[frame["time"].to_numpy(dtype=np.int64) >= active_since_ns]
        attrs = frame.drop(columns=["time", "value"]).drop_duplicates()
        return [{k: v for k, v in row.items() if isinstance(v, str)}
                for row in attrs.to_dict("records")]


class WindowSource:
    """Hands the engine the jobs a store knows and a window per job.

    ``jobs`` fixes the job list; otherwise jobs are discovered from the ``job_attribute`` values
    of every series in the store. Windows read ``reader`` (default: the store itself): a
    sidecar that reads a fleet's Prometheus still judges only the jobs that report to it, which
    its own store lists (Prometheus lists every sidecar's jobs).
    """

    def __init__(self, store: ListableStore, *, jobs: Iterable[str] | None = None,
                 job_attribute: str = JOB_ATTRIBUTE, reader: StoreReader | None = None) -> None:
        self.store = store
        self.reader: StoreReader = store if reader is None else reader
        self._jobs = None if jobs is None else sorted(set(jobs))
        self.job_attribute = job_attribute

    def jobs(self, *, active_since_ns: int | None = None) -> list[str]:
        """The jobs to evaluate, sorted: those with a series that has a point at or after
        ``active_since_ns`` (every job the store knows when None)."""
        if self._jobs is not None:
            return list(self._jobs)
        return self.store.attribute_values(self.job_attribute, active_since_ns=active_since_ns)

    def window(self, job: str, since_ns: int, until_ns: int) -> StoreWindow:
        """A window of ``job`` over [since_ns, until_ns], read from ``reader``."""
        return StoreWindow(self.reader, job=job, since_ns=since_ns, until_ns=until_ns,
                           job_attribute=self.job_attribute)
