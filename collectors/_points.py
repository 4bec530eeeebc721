"""The unit of telemetry: one measured value of one series at one instant."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from collectors.names import ATTR_SEEDANCE_CONFIG_VERSION

CONFIG_VERSION_ATTR = ATTR_SEEDANCE_CONFIG_VERSION
"""Every point a job emits carries the config version in force when it was measured."""

REPLAYED_ATTR = "seedance.replayed"
"""Set to "true" on points that come from a recorded trace, never from live hardware."""


class MetricKind(enum.StrEnum):
    """How a series' values combine over time (mirrors the OTLP data types)."""

    GAUGE = "gauge"
    SUM = "sum"  # monotonic cumulative counter unless noted in the catalogue
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class Point:
    """One value of one series.

    Histograms are stored as three plain series, as Prometheus does: ``NAME.count``,
    ``NAME.sum`` and ``NAME.bucket`` (cumulative count, attribute ``le`` = upper bound,
    ``+Inf`` last), so every consumer reads numbers from one table.
    """

    name: str
    value: float
    time_ns: int
    attributes: Mapping[str, str] = field(default_factory=dict)
