"""Export only what changed: keeps a job's export cost flat however many config versions it saw.

Every point a job emits carries its config version, so each version is a new stream of every
instrument. OpenTelemetry's SDK keeps every stream it ever saw and, with cumulative temporality,
re-exports each one at every collection, so a job that went through 50 config versions exports
50 copies of every series, 49 of them frozen. The export, the sidecar's decode and its store
then cost O(versions x series) per interval, and a frozen synchronous gauge even repeats its last
value with a fresh timestamp, as if the old version were still running.

Two measures, both on the exporting side:

- synchronous gauges are collected with DELTA temporality (``GAUGE_TEMPORALITY``): a gauge point
  is exported only when the job set a value since the last collection (every value it set is
  still exported, repeats included);
- :class:`ChangedPointsExporter` drops a cumulative sum or histogram point identical (same start
  time, same value or count and sum) to the one last exported for its stream. It remembers a
  point as exported only after the wrapped exporter succeeded, so a failed export is retried
  whole at the next collection. Delta points, gauges and the rest pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    Sum,
)

from collectors._otel_internals import SyncGauge

GAUGE_TEMPORALITY: dict[type, AggregationTemporality] = {SyncGauge: AggregationTemporality.DELTA}
"""``preferred_temporality`` for exporters: synchronous gauges export only fresh values."""

_StreamKey = tuple[Hashable, ...]


def _signature(point: Any) -> Hashable:
    if isinstance(point, HistogramDataPoint):
        return point.start_time_unix_nano, point.count, point.sum
    assert isinstance(point, NumberDataPoint)
    return point.start_time_unix_nano, point.value


class ChangedPointsExporter(MetricExporter):
    """Wraps ``inner``; passes a cumulative sum or histogram point on only when it changed."""

    def __init__(self, inner: MetricExporter) -> None:
        # the reader asks the exporter it holds (this one) how to collect: as ``inner`` would
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner = inner
        self._exported: dict[_StreamKey, Hashable] = {}

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        pending: dict[_StreamKey, Hashable] = {}
        resource_metrics = []
        for rm in metrics_data.resource_metrics:
            resource = tuple(sorted((rm.resource.attributes or {}).items()))
            scope_metrics = []
            for sm in rm.scope_metrics:
                metrics = [m for m in (self._changed((resource, sm.scope.name), m, pending)
                                       for m in sm.metrics) if m]
                if metrics:
                    scope_metrics.append(replace(sm, metrics=metrics))
            if scope_metrics:
                resource_metrics.append(replace(rm, scope_metrics=scope_metrics))
        if not resource_metrics:
            return MetricExportResult.SUCCESS
        result = self.inner.export(MetricsData(resource_metrics=resource_metrics),
                                   timeout_millis=timeout_millis, **kwargs)
        if result == MetricExportResult.SUCCESS:
            self._exported.update(pending)
        return result

    def _changed(self, origin: Hashable, metric: Metric,
                 pending: dict[_StreamKey, Hashable]) -> Metric | None:
        data = metric.data
        if not (isinstance(data, Sum | Histogram)
                and data.aggregation_temporality == AggregationTemporality.CUMULATIVE):
            return metric
        points = []
        for point in data.data_points:
            key = (origin, metric.name, tuple(sorted((point.attributes or {}).items())))
            signature = _signature(point)
            if self._exported.get(key) != signature:
                points.append(point)
                pending[key] = signature
        if not points:
            return None
        return replace(metric, data=replace(data, data_points=points))  # type: ignore[arg-type]

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)
