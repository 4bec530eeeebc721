"""Catalogue names as the sidecar's /metrics spells them, found by asking the sidecar's code.

Each catalogue entry is fed, as one decoded OTLP request, to a real
:class:`LatestValueCollector` (the object behind the sidecar's /metrics), and the sample and
label names it exposes are read back. Whoever names a series in Prometheus (the Grafana panels,
:class:`collectors.PrometheusSource`) therefore names it only if the exposition would really
contain it: a renamed metric, a changed unit or a new translation rule changes the PromQL or
fails at once, never silently reads nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from collectors._catalogue import BY_NAME, MetricSpec
from collectors._errors import SeedanceError
from collectors._otel_internals import sanitize_attribute
from collectors._otlp_decode import RESOURCE_ATTRS, DecodedMetrics, MetricInfo, Temporality
from collectors._points import MetricKind, Point
from collectors._prometheus import LatestValueCollector

_OTLP_TYPE = {MetricKind.GAUGE: "gauge", MetricKind.SUM: "sum",
              MetricKind.HISTOGRAM: "histogram"}


class PrometheusNameError(SeedanceError):
    """A metric, sample or attribute the sidecar's /metrics would not expose."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PromMetric:
    """One catalogue metric as Prometheus sees it after scraping the sidecar."""

    spec: MetricSpec
    samples: frozenset[str]
    labels: Mapping[str, str]
    """Catalogue attribute -> Prometheus label name."""

    def _sample(self, wanted: MetricKind, suffix: str) -> str:
        if self.spec.kind is not wanted:
            raise PrometheusNameError(
                f"{self.spec.name} is a {self.spec.kind.value}, not a {wanted.value}")
        names = [s for s in self.samples if s.endswith(suffix)]
        if len(names) != 1:
            raise PrometheusNameError(f"{self.spec.name} exposes no single *{suffix} sample: "
                                     f"{sorted(self.samples)}")
        return names[0]

    @property
    def gauge(self) -> str:
        """The series name of a gauge."""
        return self._sample(MetricKind.GAUGE, "")

    @property
    def total(self) -> str:
        """The ``_total`` series of a monotonic sum (use it inside ``rate()``)."""
        return self._sample(MetricKind.SUM, "_total")

    @property
    def bucket(self) -> str:
        """The ``_bucket`` series of a histogram (labelled ``le``)."""
        return self._sample(MetricKind.HISTOGRAM, "_bucket")

    @property
    def sum(self) -> str:
        """The ``_sum`` series of a histogram."""
        return self._sample(MetricKind.HISTOGRAM, "_sum")

    @property
    def count(self) -> str:
        """The ``_count`` series of a histogram."""
        return self._sample(MetricKind.HISTOGRAM, "_count")

    @property
    def series(self) -> str:
        """The series present once per label set: the gauge, the ``_total`` or the ``_count``."""
        suffix = {MetricKind.GAUGE: "", MetricKind.SUM: "_total",
                  MetricKind.HISTOGRAM: "_count"}[self.spec.kind]
        return self._sample(self.spec.kind, suffix)

    def label(self, attribute: str) -> str:
        """The label an attribute of this metric becomes."""
        try:
            return self.labels[attribute]
        except KeyError:
            raise PrometheusNameError(
                f"{self.spec.name} has no attribute {attribute!r}; it has "
                f"{sorted(self.labels)}") from None

    def label_of(self, attribute: str) -> str:
        """The label any attribute key becomes: this metric's own, else the exporter's
        sanitising (a key the catalogue does not list can still be on a point)."""
        return self.labels.get(attribute) or sanitize_attribute(attribute)


def _points(spec: MetricSpec, attributes: dict[str, str]) -> list[Point]:
    if spec.kind is not MetricKind.HISTOGRAM:
        return [Point(spec.name, 1.0, 1, attributes)]
    return [Point(f"{spec.name}.bucket", 1.0, 1, {**attributes, "le": "+Inf"}),
            Point(f"{spec.name}.count", 1.0, 1, attributes),
            Point(f"{spec.name}.sum", 1.0, 1, attributes)]


@functools.cache
def prom_metric(name: str) -> PromMetric:
    """The Prometheus names of catalogue metric ``name``, as the sidecar would expose them."""
    spec = BY_NAME.get(name)
    if spec is None:
        raise PrometheusNameError(f"{name!r} is not in the metric catalogue")
    # Each attribute's value is its own key, so the exposed label values say which is which.
    # The receiver copies the sender's resource attributes (service.name, ...) onto every point.
    attributes = {key: key for key in (*spec.attributes, *RESOURCE_ATTRS)}
    info = MetricInfo(
        name=spec.name, kind=spec.kind, otlp_type=_OTLP_TYPE[spec.kind], unit=spec.unit,
        description=spec.description, monotonic=spec.kind is MetricKind.SUM,
        temporality=Temporality.UNSPECIFIED if spec.kind is MetricKind.GAUGE
        else Temporality.CUMULATIVE)
    collector = LatestValueCollector()
    collector.update(DecodedMetrics(points=_points(spec, attributes), metrics={name: info}))
    (family,) = collector.collect()
    samples = frozenset(s.name for s in family.samples)
    labels = {value: label for s in family.samples for label, value in s.labels.items()
              if value in attributes}
    return PromMetric(spec=spec, samples=samples, labels=MappingProxyType(labels))
