"""OTLP metrics -> Points: the wire formats (protobuf, JSON) and the conversion rules.

Kept apart from the HTTP receiver so anything holding an ``ExportMetricsServiceRequest`` (a test,
a replay, a gRPC endpoint later) turns it into the same Points. This sits on the hot path: work
per data point is building its attributes and its Point, nothing else.

docs/internals.md, 'OTLP metrics to Points' gives the conversion rules.
"""

from __future__ import annotations

import enum
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from prometheus_client.utils import floatToGoString

from collectors._errors import SeedanceError
from collectors._points import MetricKind, Point
from collectors.names import ATTR_HOST_NAME, ATTR_SEEDANCE_RANK, ATTR_SERVICE_NAME

RESOURCE_ATTRS: tuple[str, ...] = (
    ATTR_SERVICE_NAME,
    ATTR_HOST_NAME,
    ATTR_SEEDANCE_RANK,
    "seedance.job.kind",
)
"""Resource attributes the catalogue labels by (service.name is the job). Every other resource
attribute is kept too, except those of :func:`kept_resource_attribute`."""

_PER_PROCESS_PREFIXES = ("telemetry.", "process.")


def kept_resource_attribute(key: str) -> bool:
    """Whether a resource attribute is copied onto every Point of that resource.

    Kept: what the sender chose to say (deployment.environment, k8s.pod.name, cloud.region).
    Dropped: ``service.instance.id``, which the SDK draws at random per process, and the SDK's
    own ``telemetry.*`` and ``process.*`` (pid, command line): each would start new series at
    every restart or only repeat the SDK's version; job, host and rank already name the
    process."""
    return key != "service.instance.id" and not key.startswith(_PER_PROCESS_PREFIXES)

_NO_RECORDED_VALUE = metrics_pb2.DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK


class OtlpDecodeError(SeedanceError):
    """The body is not a valid OTLP ExportMetricsServiceRequest; the message says why."""


class Temporality(str, enum.Enum):  # noqa: UP042 (StrEnum needs 3.11; we support 3.10)
    """OTLP AggregationTemporality of a sum or histogram (gauges and summaries: unspecified)."""

    UNSPECIFIED = "unspecified"
    DELTA = "delta"
    CUMULATIVE = "cumulative"


_TEMPORALITY = {
    metrics_pb2.AGGREGATION_TEMPORALITY_UNSPECIFIED: Temporality.UNSPECIFIED,
    metrics_pb2.AGGREGATION_TEMPORALITY_DELTA: Temporality.DELTA,
    metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE: Temporality.CUMULATIVE,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricInfo:
    """What the sender said about one metric name.

    ``kind`` is HISTOGRAM for histograms, exponential histograms and summaries (all arrive as
    several series); ``otlp_type`` keeps the exact OTLP data type.
    """

    name: str
    kind: MetricKind
    otlp_type: str  # gauge | sum | histogram | exponential_histogram | summary
    unit: str
    description: str
    monotonic: bool
    temporality: Temporality


class Shape:
    """The names and attributes of a repeat export's Points, in order: the same objects for
    every body of that shape (``collectors/_otlp_templates.py``).

    A consumer derives its per-series work (store keys, limiter keys, label sets) once per shape
    and keeps it in ``derived`` under a key of its own; what it keeps must follow from the names
    and attributes alone, or carry a stamp of the consumer state it depends on (the series
    limiter's generation), as that state changes between requests.
    """

    __slots__ = ("attributes", "derived", "names")

    def __init__(self, names: list[str], attributes: list[Mapping[str, str]]) -> None:
        self.names = names
        self.attributes = attributes
        self.derived: dict[str, object] = {}


class DecodedMetrics:
    """The Points of one request and the metadata of every metric name they came from.

    A repeat export arrives as columns over a :class:`Shape` (``shape``, ``times``,
    ``values``): consumers that know shapes read those; ``points`` is built from them only when
    first asked for. Points of one data point may share one attributes dict, and Points of one
    shape share theirs with every other request of that shape: treat attributes as read-only.
    """

    __slots__ = ("_points", "metrics", "shape", "times", "values")

    def __init__(self, points: list[Point] | None = None,
                 metrics: dict[str, MetricInfo] | None = None, *, shape: Shape | None = None,
                 times: np.ndarray | None = None, values: np.ndarray | None = None) -> None:
        if (shape is None) != (times is None) or (shape is None) != (values is None):
            raise ValueError("DecodedMetrics: shape, times and values come together")
        if shape is not None and points is not None:
            raise ValueError("DecodedMetrics: points or a shape, not both")
        self._points = points if points is not None or shape is not None else []
        self.metrics = {} if metrics is None else metrics
        self.shape = shape
        self.times = times
        self.values = values

    @property
    def points(self) -> list[Point]:
        if self._points is None:
            assert self.shape is not None and self.times is not None and self.values is not None
            self._points = list(map(Point, self.shape.names, self.values.tolist(),
                                    self.times.tolist(), self.shape.attributes))
        return self._points

    def __len__(self) -> int:
        """How many Points (without building them)."""
        return len(self._points) if self._points is not None else len(self.shape.names)  # type: ignore[union-attr]

    def first_attributes(self) -> Mapping[str, str] | None:
        """The attributes of the first Point (None when there is none)."""
        if self._points is not None:
            return self._points[0].attributes if self._points else None
        assert self.shape is not None
        return self.shape.attributes[0] if self.shape.attributes else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DecodedMetrics):
            return NotImplemented
        return self.points == other.points and self.metrics == other.metrics

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"DecodedMetrics({len(self)} points, {len(self.metrics)} metrics)"


def decode_protobuf(body: bytes) -> ExportMetricsServiceRequest:
    """Parse a binary protobuf request; raise OtlpDecodeError on malformed or truncated input."""
    request = ExportMetricsServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RecursionError) as e:
        raise OtlpDecodeError(f"malformed protobuf ExportMetricsServiceRequest: {e}") from e
    return request


def decode_json(body: bytes) -> ExportMetricsServiceRequest:
    """Parse an OTLP/JSON request (lowerCamelCase or proto field names, int64 as string or
    number, enums as integers, unknown fields ignored); raise OtlpDecodeError on bad input.

    Exemplar trace and span ids arrive hex-encoded in OTLP/JSON but are read as base64 here;
    exemplars are not converted to Points, so nothing downstream sees them.
    """
    request = ExportMetricsServiceRequest()
    try:
        json_format.Parse(body, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, RecursionError) as e:
        raise OtlpDecodeError(f"malformed OTLP/JSON ExportMetricsServiceRequest: {e}") from e
    return request


def _any_to_py(value: AnyValue) -> object:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_to_py(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_to_py(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, which)


def render_value(value: AnyValue) -> str:
    """Render any AnyValue as the str a Point attribute holds (rules in the module docstring)."""
    which = value.WhichOneof("value")
    if which == "string_value":
        return value.string_value
    if which == "bool_value":
        return "true" if value.bool_value else "false"
    if which == "int_value":
        return str(value.int_value)
    if which == "double_value":
        return repr(value.double_value)
    if which == "bytes_value":
        return value.bytes_value.hex()
    if which is None:
        return ""
    return json.dumps(_any_to_py(value), separators=(",", ":"))


def _attributes(base: dict[str, str], key_values: object) -> dict[str, str]:
    attrs = dict(base)
    for kv in key_values:  # type: ignore[attr-defined]
        value = kv.value
        # Nearly all attributes are non-empty strings: take those without the generic dispatch.
        attrs[kv.key] = value.string_value or render_value(value)
    return attrs


@functools.lru_cache(maxsize=4096)
def _prom_float(bound: float) -> str:
    """A float as Prometheus writes `le` and `quantile`; cached, as bounds recur every export."""
    return floatToGoString(bound)


def _pow2(exponent: float) -> float:
    try:
        return 2.0**exponent
    except OverflowError:
        return math.inf


def _exponential_buckets(dp: metrics_pb2.ExponentialHistogramDataPoint) -> list[tuple[str, int]]:
    """Cumulative (le, count) pairs of an exponential histogram data point, +Inf last."""
    step = _pow2(-dp.scale)  # log2 of the bucket base
    buckets: list[tuple[str, int]] = []
    total = 0
    negative = dp.negative
    # Negative bucket i holds [-base**(i+1), -base**i): walk from the most negative upwards.
    for i in range(len(negative.bucket_counts) - 1, -1, -1):
        total += negative.bucket_counts[i]
        buckets.append((_prom_float(-_pow2((negative.offset + i) * step)), total))
    total += dp.zero_count
    buckets.append((_prom_float(dp.zero_threshold), total))
    positive = dp.positive
    for i, count in enumerate(positive.bucket_counts):
        total += count
        buckets.append((_prom_float(_pow2((positive.offset + i + 1) * step)), total))
    buckets.append(("+Inf", dp.count))
    return buckets


def _histogram_points(
    out: list[Point], name: str, dp: metrics_pb2.HistogramDataPoint, attrs: dict[str, str]
) -> None:
    t = dp.time_unix_nano
    out.append(Point(name + ".count", float(dp.count), t, attrs))
    if dp.HasField("sum"):
        out.append(Point(name + ".sum", dp.sum, t, attrs))
    if not dp.bucket_counts:
        return
    bucket = name + ".bucket"
    total = 0
    for bound, count in zip(dp.explicit_bounds, dp.bucket_counts, strict=False):
        total += count
        out.append(Point(bucket, float(total), t, {**attrs, "le": _prom_float(bound)}))
    out.append(Point(bucket, float(dp.count), t, {**attrs, "le": "+Inf"}))


def points_from_request(request: ExportMetricsServiceRequest) -> DecodedMetrics:
    """Convert every data point of ``request`` to Points (rules in the module docstring)."""
    decoded = DecodedMetrics()
    out = decoded.points
    metrics = decoded.metrics
    for resource_metrics in request.resource_metrics:
        resource: dict[str, str] = {}
        for kv in resource_metrics.resource.attributes:
            if kept_resource_attribute(kv.key):
                resource[kv.key] = render_value(kv.value)
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                name = metric.name
                which = metric.WhichOneof("data")
                if which is None:
                    continue
                data = getattr(metric, which)
                if which == "gauge":
                    kind, monotonic, temporality = MetricKind.GAUGE, False, Temporality.UNSPECIFIED
                elif which == "summary":
                    kind, monotonic = MetricKind.HISTOGRAM, True
                    temporality = Temporality.CUMULATIVE
                else:
                    temporality = _TEMPORALITY.get(
                        data.aggregation_temporality, Temporality.UNSPECIFIED
                    )
                    if which == "sum":
                        kind, monotonic = MetricKind.SUM, data.is_monotonic
                    else:
                        kind, monotonic = MetricKind.HISTOGRAM, True
                metrics[name] = MetricInfo(
                    name=name, kind=kind, otlp_type=which, unit=metric.unit,
                    description=metric.description, monotonic=monotonic,
                    temporality=temporality,
                )
                _convert(out, name, which, data, resource)
    return decoded


def _convert(out: list[Point], name: str, which: str, data: object, resource: dict[str, str]
             ) -> None:
    """Append the Points of one metric's data points to ``out``."""
    for dp in data.data_points:  # type: ignore[attr-defined]
        if dp.flags & _NO_RECORDED_VALUE:
            continue
        attrs = _attributes(resource, dp.attributes)
        t = dp.time_unix_nano
        if which == "gauge" or which == "sum":
            value = dp.as_double if dp.WhichOneof("value") == "as_double" else float(dp.as_int)
            out.append(Point(name, value, t, attrs))
        elif which == "histogram":
            _histogram_points(out, name, dp, attrs)
        elif which == "exponential_histogram":
            out.append(Point(name + ".count", float(dp.count), t, attrs))
            if dp.HasField("sum"):
                out.append(Point(name + ".sum", dp.sum, t, attrs))
            bucket = name + ".bucket"
            for le, total in _exponential_buckets(dp):
                out.append(Point(bucket, float(total), t, {**attrs, "le": le}))
        else:  # summary
            out.append(Point(name + ".count", float(dp.count), t, attrs))
            out.append(Point(name + ".sum", dp.sum, t, attrs))
            for q in dp.quantile_values:
                out.append(
                    Point(name, q.value, t, {**attrs, "quantile": _prom_float(q.quantile)})
                )
