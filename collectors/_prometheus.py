"""Prometheus exposition of what the sidecar received: the latest value of every series.

The sidecar feeds :class:`LatestValueCollector` with decoded OTLP requests; a Prometheus server
scraping it sees the job's metrics under the names the OpenTelemetry -> Prometheus compatibility
spec gives them (the same translation ``opentelemetry-exporter-prometheus`` uses): dots become
underscores, the unit becomes a suffix (``_seconds``, ``_bytes``), monotonic sums gain
``_total``, histograms expose ``_bucket`` / ``_sum`` / ``_count`` with ``le``, and attribute keys
are sanitised into label names (``seedance.config.version`` -> ``seedance_config_version``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from collectors._errors import SeedanceError
from collectors._otel_internals import map_unit, sanitize_attribute, sanitize_full_name
from collectors._otlp_decode import DecodedMetrics, MetricInfo, Shape, Temporality
from collectors._points import MetricKind

LabelKey = tuple[tuple[str, str], ...]
"""Sorted (label name, value) pairs: one series' identity as Prometheus sees it."""

_NAN = float("nan")


class MetricsServerError(SeedanceError):
    """The /metrics endpoint could not be started (port taken, address not local...)."""


def prometheus_labels(attributes: Mapping[str, str]) -> dict[str, str]:
    """Attribute keys sanitised to label names; values of keys that collide are joined by ``;``
    in the order of their original keys, as the OTel compatibility spec says."""
    labels: dict[str, str] = {}
    for key in sorted(attributes):
        label = sanitize_attribute(key)
        labels[label] = f"{labels[label]};{attributes[key]}" if label in labels \
            else attributes[key]
    return labels


@dataclass(slots=True)
class _Series:
    """One series' latest samples: role ("value", "count", "sum", "bucket", "quantile") and its
    ``le``/``quantile`` bound (``""`` for none) -> value."""

    samples: dict[tuple[str, str], float] = field(default_factory=dict)
    updated_s: float = 0.0


@dataclass(slots=True)
class _PendingShape:
    """A shape's exports not yet folded into the series: the latest values, delta points
    summed over them. Folding happens in ``order``, the order of each shape's latest export,
    so a series in several shapes ends with the value of the export that came last."""

    order: int
    decoded: DecodedMetrics
    values: np.ndarray
    updated_s: float


@dataclass(slots=True)
class _Family:
    info: MetricInfo
    series: dict[LabelKey, _Series] = field(default_factory=dict)


def _role(name: str, metrics: Mapping[str, MetricInfo]) -> tuple[str, str] | None:
    """(metric name, role) of a Point name, or None when the request did not describe it."""
    info = metrics.get(name)
    if info is not None:
        return name, "quantile" if info.otlp_type == "summary" else "value"
    base, _, suffix = name.rpartition(".")
    info = metrics.get(base)
    if info is not None and info.kind is MetricKind.HISTOGRAM and suffix in (
            "count", "sum", "bucket"):
        return base, suffix
    return None


_UNKNOWN: tuple[str, str] = ("", "")
_SeriesOf = tuple[str, str, str, "LabelKey"]
"""(family name, role, bound, label key) of one Point."""
_SHAPE_KEY = "prometheus.latest"
_SHAPE_SUMMED = "prometheus.summed"
_PENDING_MAX_POINTS = 200_000
"""Points of shapes whose exports wait for a scrape to fold them in; past it they are folded at
once. One entry per distinct export shape, so a steady job holds a handful."""
_LABELS_MAX = 200_000
"""Attribute sets whose labels are kept computed: the same series arrive every export."""


def _labels_of(role: str, attributes: Mapping[str, str]) -> tuple[str, LabelKey]:
    """(the ``le`` or ``quantile`` bound, or ""; the other attributes as a label key)."""
    attrs = dict(attributes)
    bound = attrs.pop("le", "") if role == "bucket" else \
        attrs.pop("quantile", "") if role == "quantile" else ""
    return bound, tuple(sorted(prometheus_labels(attrs).items()))


class LatestValueCollector(Collector):
    """A prometheus_client collector holding the latest value of every received series.

    Thread-safe: :meth:`update` and :meth:`expire` may run on receiver threads while a scrape
    runs :meth:`collect`. Delta sums and histograms are added up into running totals, since
    Prometheus only understands cumulative counters. No timestamps are exposed, so Prometheus
    stamps samples at scrape time; series that stop arriving are removed by :meth:`expire`,
    which :meth:`update` runs itself every ``idle_s / 4`` when ``idle_s`` is given (each config
    version starts new series: without it, every trial's series would stay on /metrics, and in
    memory, for good). ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, *, idle_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        self._labels: dict[tuple[tuple[str, str], tuple[tuple[str, str], ...]], _SeriesOf] = {}
        self.idle_s = idle_s
        self._swept_s = clock()
        self._pending: dict[Shape, _PendingShape] = {}
        self._pending_points = 0
        self._order = 0

    def update(self, decoded: DecodedMetrics) -> None:
        """Take the points of one decoded request; points of undescribed names are ignored.

        A repeat export (one with a shape) is only noted: its values replace, or add to, those
        its shape left pending, and the per-series work waits for a scrape or an expiry, so
        an export costs the receiver a few array operations however many series it carries.
        """
        now = self._clock()
        if self.idle_s is not None and now - self._swept_s >= self.idle_s / 4:
            self._swept_s = now
            self.expire(self.idle_s)
        shape = decoded.shape
        with self._lock:
            self._order += 1
            if shape is None:
                self._fold_pending()
                points = decoded.points
                found = self._series_of([p.name for p in points],
                                        [p.attributes for p in points], decoded.metrics)
                self._apply(found, [p.value for p in points], decoded.metrics, now)
                return
            assert decoded.values is not None
            pending = self._pending.get(shape)
            if pending is None:
                self._pending[shape] = _PendingShape(
                    self._order, decoded, decoded.values.copy(), now)
                self._pending_points += len(shape.names)
                if self._pending_points > _PENDING_MAX_POINTS:
                    self._fold_pending()
                return
            summed = self._summed(decoded)
            pending.values = decoded.values.copy() if summed is None else \
                np.where(summed, pending.values + decoded.values, decoded.values)
            pending.order, pending.decoded, pending.updated_s = self._order, decoded, now

    def _summed(self, decoded: DecodedMetrics) -> np.ndarray | None:
        """Which points of a shape add up over exports (delta sums and histograms); None when
        none do. Worked out once per shape."""
        shape = decoded.shape
        assert shape is not None
        summed = shape.derived.get(_SHAPE_SUMMED, _UNKNOWN)
        if summed is _UNKNOWN:
            mask = np.array([
                of is not None and of[1] != "quantile"
                and decoded.metrics[of[0]].temporality is Temporality.DELTA
                for of in self._shape_series(decoded)], dtype=bool)
            summed = shape.derived[_SHAPE_SUMMED] = mask if mask.any() else None
        return summed  # type: ignore[return-value]

    def _fold_pending(self) -> None:
        """Fold every pending shape into the series, in the order of their latest exports.
        Called under the lock."""
        pending = sorted(self._pending.values(), key=lambda p: p.order)
        self._pending.clear()
        self._pending_points = 0
        for shape in pending:
            self._apply(self._shape_series(shape.decoded), shape.values.tolist(),
                        shape.decoded.metrics, shape.updated_s)

    def _apply(self, found: list[_SeriesOf | None], values: list[float],
               metrics: Mapping[str, MetricInfo], now: float) -> None:
        """Set (or, for delta points, add) each point's value on its series. Called under the
        lock."""
        families: dict[str, _Family] = {}
        for series_of, value in zip(found, values, strict=True):
            if series_of is None:
                continue
            name, role, bound, key = series_of
            family = families.get(name)
            if family is None:
                info = metrics[name]
                family = self._families.get(name)
                if family is None or family.info.otlp_type != info.otlp_type:
                    family = self._families[name] = _Family(info)
                family.info = info
                families[name] = family
            series = family.series.get(key)
            if series is None:
                series = family.series[key] = _Series()
            sample = (role, bound)
            if family.info.temporality is Temporality.DELTA and role != "quantile":
                series.samples[sample] = series.samples.get(sample, 0.0) + value
            else:
                series.samples[sample] = value
            series.updated_s = now

    def _series_of(self, names: list[str], attributes: list[Mapping[str, str]],
                   metrics: Mapping[str, MetricInfo]) -> list[_SeriesOf | None]:
        """(family name, role, bound, label key) of each Point; None for an undescribed name.
        Cached by role and attribute set: the same series arrive every export."""
        roles: dict[str, tuple[str, str] | None] = {}
        labels = self._labels
        out: list[_SeriesOf | None] = []
        for name, attrs in zip(names, attributes, strict=True):
            named = roles.get(name, _UNKNOWN)
            if named is _UNKNOWN:
                named = roles[name] = _role(name, metrics)
            if named is None:
                out.append(None)
                continue
            key = (named, tuple(attrs.items()))
            found = labels.get(key)
            if found is None:
                if len(labels) >= _LABELS_MAX:
                    labels.clear()
                found = labels[key] = (*named, *_labels_of(named[1], attrs))
            out.append(found)
        return out

    def _shape_series(self, decoded: DecodedMetrics) -> list[_SeriesOf | None]:
        """:meth:`_series_of` for the Points of a shape, worked out once per shape (it follows
        from the names, attributes and metric metadata, all fixed by the shape)."""
        shape = decoded.shape
        assert shape is not None
        found = shape.derived.get(_SHAPE_KEY)
        if found is None:
            found = shape.derived[_SHAPE_KEY] = self._series_of(
                shape.names, list(shape.attributes), decoded.metrics)
        return found  # type: ignore[return-value]

    def expire(self, max_age_s: float) -> int:
        """Drop series not updated for more than ``max_age_s``; return how many went."""
        deadline = self._clock() - max_age_s
        dropped = 0
        with self._lock:
            self._fold_pending()
            for name in list(self._families):
                series = self._families[name].series
                stale = [key for key, s in series.items() if s.updated_s < deadline]
                for key in stale:
                    del series[key]
                dropped += len(stale)
                if not series:
                    del self._families[name]
        return dropped

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._fold_pending()
            snapshot = [
                (family.info, [(key, dict(s.samples)) for key, s in family.series.items()])
                for family in self._families.values()
            ]
        for info, series in snapshot:
            yield _family_metric(info, series)


def _family_metric(info: MetricInfo,
                   series: list[tuple[LabelKey, dict[tuple[str, str], float]]]) -> Metric:
    """One Prometheus metric family; label sets that differ are padded with empty values,
    which Prometheus reads as an absent label."""
    name = sanitize_full_name(info.name)
    unit = map_unit(info.unit)
    label_names = sorted({label for key, _ in series for label, _ in key})

    def values_of(key: LabelKey) -> list[str]:
        labels = dict(key)
        return [labels.get(label, "") for label in label_names]

    if info.kind is MetricKind.HISTOGRAM and info.otlp_type == "summary":
        summary = SummaryMetricFamily(name, info.description, labels=label_names, unit=unit)
        for key, samples in series:
            values = values_of(key)
            summary.add_metric(values, int(samples.get(("count", ""), 0)),
                               samples.get(("sum", ""), _NAN))
            labels = dict(zip(label_names, values, strict=True))
            for (role, bound), value in samples.items():
                if role == "quantile":
                    summary.add_sample(summary.name, {**labels, "quantile": bound}, value)
        return summary
    if info.kind is MetricKind.HISTOGRAM:
        histogram = HistogramMetricFamily(name, info.description, labels=label_names, unit=unit)
        for key, samples in series:
            buckets = sorted(((bound, value) for (role, bound), value in samples.items()
                              if role == "bucket"), key=lambda b: float(b[0]))
            if not buckets or buckets[-1][0] != "+Inf":
                buckets.append(("+Inf", samples.get(("count", ""), 0.0)))
            histogram.add_metric(values_of(key), buckets, samples.get(("sum", ""), _NAN))
        return histogram
    family_type = CounterMetricFamily if info.kind is MetricKind.SUM and info.monotonic \
        else GaugeMetricFamily
    family = family_type(name, info.description, labels=label_names, unit=unit)
    for key, samples in series:
        family.add_metric(values_of(key), samples.get(("value", ""), _NAN))
    return family


class NullMetricsServer:
    """Stands in when no /metrics endpoint is wanted."""

    port: int | None = None

    def stop(self) -> None:
        """Nothing to stop."""


class MetricsServer:
    """A running /metrics HTTP endpoint; :meth:`stop` is idempotent."""

    def __init__(self, host: str, port: int, server: object, thread: threading.Thread) -> None:
        self.host = host
        self.port: int | None = port
        self._server = server
        self._thread = thread
        self._stopped = False

    @property
    def url(self) -> str:
        """The scrape URL."""
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]
        self._thread.join(timeout_s)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1"
                  ) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` on a daemon thread (port 0: a free
    one; the bound port is ``.port``). Raise MetricsServerError when it cannot bind."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise MetricsServerError(f"cannot serve /metrics on {host}:{port}: {e}") from e
    return MetricsServer(host, server.server_port, server, thread)
