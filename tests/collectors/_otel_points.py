"""Flatten what an InMemoryMetricReader collected into plain rows tests can compare."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[dict[str, Any]]]:
    """Metric name -> rows of ``attributes`` plus ``value`` or histogram ``count``/``sum``."""
    points: dict[str, list[dict[str, Any]]] = {}
    data = reader.get_metrics_data()
    if data is None:
        return points
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    row: dict[str, Any] = {"attributes": dict(point.attributes or {})}
                    if hasattr(point, "bucket_counts"):
                        row.update(count=point.count, sum=point.sum)
                    else:
                        row.update(value=point.value)
                    points.setdefault(metric.name, []).append(row)
    return points
