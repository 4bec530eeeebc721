"""The one shape every time-series reader has: the embedded store, a Prometheus server, a
window of either. Consumers take a :class:`StoreReader` so the same detector, measurement or
report reads from any of them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

Resolution = Literal["auto", "raw", "1m", "1h"]
"""Points as written (``raw``), 1-minute or 1-hour rollups, or ``auto``: the reader picks by
the span asked for."""


class StoreReader(Protocol):
    """Reads points of one metric into a frame.

    The frame's columns: ``time`` (datetime64[ns, UTC]) and ``value``, then (rollups only)
    ``min``, ``max``, ``count``, ``last``, then one str column per attribute key; sorted by
    time. Only points of ``name`` whose attributes include ``where``, in [since_ns, until_ns];
    a metric without points is an empty frame with the same leading columns. A reader may
    bound an open range (Prometheus reads an open start as its lookback, and nothing from its
    last scrape interval) and may refuse a name it cannot translate.
    """

    def query(self, name: str, *, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None,
              resolution: Resolution = "auto") -> pd.DataFrame:
        """Points of ``name`` (see the class docstring for the frame)."""
        ...


@dataclass(frozen=True)
class ValueBounds:
    """Bounds on a set of timed values: how many (``points``, NaNs included), how many are
    NaN, the lowest and highest of the others (``inf`` and ``-inf`` when there are none), and
    the latest time (ns) among them (None when empty).

    A reader may give the bounds of a superset of the points asked for (whole stored chunks
    that reach into the range), so they prove what cannot be there, never what is; the
    superset's latest time is the range's own when the range is open at its end.
    """

    points: int
    nans: int
    low: float
    high: float
    latest_ns: int | None

    @classmethod
    def of(cls, values: np.ndarray, times_ns: np.ndarray) -> ValueBounds:
        """The exact bounds of ``values`` taken at ``times_ns``."""
        finite = values[~np.isnan(values)]
        return cls(points=int(values.shape[0]), nans=int(values.shape[0] - finite.shape[0]),
                   low=float(finite.min()) if finite.size else math.inf,
                   high=float(finite.max()) if finite.size else -math.inf,
                   latest_ns=int(times_ns.max()) if times_ns.size else None)

    def merged(self, other: ValueBounds) -> ValueBounds:
        """The bounds of both sets together."""
        latest = [t for t in (self.latest_ns, other.latest_ns) if t is not None]
        return ValueBounds(self.points + other.points, self.nans + other.nans,
                           min(self.low, other.low), max(self.high, other.high),
                           max(latest) if latest else None)

    def could_hold(self, value: float) -> bool:
        """False when no value in the set can equal ``value``."""
        return self.low <= value <= self.high

    def spread(self) -> float:
        """The widest gap between two values that are not NaN (0 with fewer than two)."""
        return max(self.high - self.low, 0.0)

    def all_finite(self) -> bool:
        """True when no value is NaN or infinite (true of an empty set)."""
        return self.nans == 0 and (self.points == 0 or (math.isfinite(self.low)
                                                        and math.isfinite(self.high)))

    def only(self, value: float) -> bool:
        """True when every value equals ``value`` (true of an empty set)."""
        return self.nans == 0 and (self.points == 0 or self.low == self.high == value)

    def constant(self) -> bool:
        """True when every value is the same number (no NaN; true of an empty set)."""
        return self.nans == 0 and (self.points == 0 or self.low == self.high)


@runtime_checkable
class BoundsReader(Protocol):
    """A reader that can bound a metric's values without reading its points (the embedded
    store keeps each chunk's bounds): a detector that only asks "could anything be wrong
    here" then skips reading thousands of series."""

    def value_bounds(self, name: str, *, where: Mapping[str, str] | None = None,
                     keep: Callable[[Mapping[str, str]], bool], since_ns: int,
                     until_ns: int) -> ValueBounds | None:
        """Bounds on the values of the series of ``name`` whose attributes include ``where``
        and that ``keep`` accepts, in [since_ns, until_ns] (a superset may be bounded); None
        when they cannot be told without reading the points."""
        ...
