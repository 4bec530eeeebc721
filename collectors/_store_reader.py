"""The one shape every time-series reader has: the embedded store, a Prometheus server, a
window of either. Consumers take a :class:`StoreReader` so the same detector, measurement or
report reads from any of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, Protocol

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
