"""OTLP/JSON metrics -> Points in one pass over orjson's objects: the fast path.

``json_format.Parse`` builds a protobuf message field by field in Python and was most of a JSON
request's cost. This walks the parsed JSON straight to columns of Points' fields (Points are
built when asked for; a repeat shape is handed on as columns, `collectors._otlp_json_shapes`)
for the shapes exporters send:
gauges, sums and explicit histograms with string attributes. Anything else, or anything it
cannot read exactly as ``json_format`` would (an integer attribute, an exemplar, a summary, a
field of the wrong type, both spellings of one field), sends the whole body down the reference
path (:func:`collectors._otlp_decode.decode_json`), which also decides what is malformed. The
tests hold both paths to the same Points.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
from opentelemetry.proto.metrics.v1 import metrics_pb2

from collectors._otlp_decode import (
    _NO_RECORDED_VALUE,
    _TEMPORALITY,
    DecodedMetrics,
    MetricInfo,
    Shape,
    Temporality,
    _prom_float,
    decode_json,
    kept_resource_attribute,
    points_from_request,
)
from collectors._points import MetricKind, Point


class _Unsupported(Exception):
    """The fast path does not read this body exactly: the reference path will."""


_UINT64_MAX = 2**64 - 1
_INT64_END = 2**63
_SPECIAL_DOUBLES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_TEMPORALITY_NAMES = {name: number for name, number in
                      metrics_pb2.AggregationTemporality.items()}
_TEMPORALITY_OF: dict[int, Temporality] = {int(k): v for k, v in _TEMPORALITY.items()}
_DATA_KINDS = ("gauge", "sum", "histogram")
_OTHER_DATA = ("exponentialHistogram", "exponential_histogram", "summary")


class JsonColumns:
    """What the fast path read from one body: each Point's name, value, time and attributes, as
    lists, and the metadata of every metric name; Points are built only when asked for."""

    __slots__ = ("attributes", "metrics", "names", "times", "values")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.values: list[float] = []
        self.times: list[int] = []
        self.attributes: list[dict[str, str]] = []
        self.metrics: dict[str, MetricInfo] = {}

    def add(self, name: str, value: float, time_ns: int, attributes: dict[str, str]) -> None:
        self.names.append(name)
        self.values.append(value)
        self.times.append(time_ns)
        self.attributes.append(attributes)

    def decoded(self, shape: Shape | None = None) -> DecodedMetrics:
        """As Points, or as columns over ``shape`` (the Points' names and attributes, which
        the caller vouches for); Points whenever a time is past int64 (2262), as the
        reference path keeps the exact int for the store to refuse."""
        if shape is not None and (not self.times or max(self.times) < _INT64_END):
            return DecodedMetrics(metrics=self.metrics, shape=shape,
                                  times=np.array(self.times, dtype=np.int64),
                                  values=np.array(self.values, dtype=np.float64))
        return DecodedMetrics(points=list(map(Point, self.names, self.values, self.times,
                                              self.attributes)), metrics=self.metrics)


def json_columns(body: bytes) -> JsonColumns | DecodedMetrics:
    """The fast path's columns of an OTLP/JSON request; for a body it does not read exactly,
    the reference path's Points. Raises OtlpDecodeError on bad input (through the reference
    path)."""
    try:
        return _walk(orjson.loads(body))
    except (_Unsupported, orjson.JSONDecodeError, KeyError, TypeError, ValueError,
            AttributeError, OverflowError):
        return points_from_request(decode_json(body))


def points_from_json(body: bytes) -> DecodedMetrics:
    """The Points of an OTLP/JSON request, as ``points_from_request(decode_json(body))``
    gives them; raises OtlpDecodeError on bad input (through the reference path)."""
    found = json_columns(body)
    return found if isinstance(found, DecodedMetrics) else found.decoded()


def _field(obj: dict[str, Any], camel: str, snake: str) -> Any:
    """A field by its JSON or proto name (None when absent); both at once is not read here."""
    if camel in obj:
        if snake != camel and snake in obj:
            raise _Unsupported(camel)
        return obj[camel]
    return obj.get(snake)


def _obj(value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _Unsupported("object")
    return value


def _list(value: Any) -> list[Any]:
    if value is None:
        return []
    if type(value) is not list:
        raise _Unsupported("list")
    return value


def _str(value: Any) -> str:
    if value is None:
        return ""
    if type(value) is not str:
        raise _Unsupported("string")
    return value


def _uint(value: Any) -> int:
    if value is None:
        return 0
    if type(value) is str and value.isascii() and value.isdigit():
        value = int(value)
    if type(value) is not int or not 0 <= value <= _UINT64_MAX:
        raise _Unsupported("uint64")
    return value


def _sint(value: Any) -> int:
    if type(value) is str and value.isascii() and value.lstrip("-").isdigit():
        value = int(value)
    if type(value) is not int or not -(2**63) <= value < 2**63:
        raise _Unsupported("int64")
    return value


def _double(value: Any) -> float:
    if type(value) is float or type(value) is int:
        return float(value)
    if type(value) is str and value in _SPECIAL_DOUBLES:
        return _SPECIAL_DOUBLES[value]
    raise _Unsupported("double")


def _attributes(base: dict[str, str], key_values: Any) -> dict[str, str]:
    attrs = dict(base)
    for kv in _list(key_values):
        kv = _obj(kv)
        value = _obj(kv["value"])
        if len(value) != 1:
            raise _Unsupported("attribute value")
        text = _field(value, "stringValue", "string_value")
        if type(text) is not str:
            raise _Unsupported("attribute value")
        attrs[_str(kv["key"])] = text
    return attrs


def _check_unread(dp: dict[str, Any]) -> None:
    """Fields the Points do not use must still be what ``json_format`` accepts."""
    _uint(_field(dp, "startTimeUnixNano", "start_time_unix_nano"))
    if _list(dp.get("exemplars")):
        raise _Unsupported("exemplars")
    for bound in ("min", "max"):
        if dp.get(bound) is not None:
            _double(dp[bound])


def _walk(doc: Any) -> JsonColumns:
    out = JsonColumns()
    for rm in _list(_field(_obj(doc), "resourceMetrics", "resource_metrics")):
        rm = _obj(rm)
        _str(_field(rm, "schemaUrl", "schema_url"))
        resource = {} if rm.get("resource") is None else _obj(rm["resource"])
        resource_attrs = {k: v for k, v in
                          _attributes({}, resource.get("attributes")).items()
                          if kept_resource_attribute(k)}
        for sm in _list(_field(rm, "scopeMetrics", "scope_metrics")):
            sm = _obj(sm)
            scope = {} if sm.get("scope") is None else _obj(sm["scope"])
            _str(scope.get("name"))
            _str(scope.get("version"))
            _attributes({}, scope.get("attributes"))
            for metric in _list(sm.get("metrics")):
                _metric(out, _obj(metric), resource_attrs)
    return out


def _metric(out: JsonColumns, metric: dict[str, Any], resource: dict[str, str]) -> None:
    if any(metric.get(k) is not None for k in _OTHER_DATA) or metric.get("metadata"):
        raise _Unsupported("data kind")
    present = [k for k in _DATA_KINDS if metric.get(k) is not None]
    if len(present) > 1:
        raise _Unsupported("two data kinds")
    name = _str(metric.get("name"))
    unit, description = _str(metric.get("unit")), _str(metric.get("description"))
    if not present:
        return
    which = present[0]
    data = _obj(metric[which])
    if which == "gauge":
        kind, monotonic, temporality = MetricKind.GAUGE, False, Temporality.UNSPECIFIED
    else:
        raw = _field(data, "aggregationTemporality", "aggregation_temporality")
        number: int = (0 if raw is None else _TEMPORALITY_NAMES[raw] if type(raw) is str
                  else _sint(raw))
        temporality = _TEMPORALITY_OF.get(number, Temporality.UNSPECIFIED)
        if which == "sum":
            flag = _field(data, "isMonotonic", "is_monotonic")
            if flag is not None and type(flag) is not bool:
                raise _Unsupported("isMonotonic")
            kind, monotonic = MetricKind.SUM, bool(flag)
        else:
            kind, monotonic = MetricKind.HISTOGRAM, True
    out.metrics[name] = MetricInfo(name=name, kind=kind, otlp_type=which, unit=unit,
                                       description=description, monotonic=monotonic,
                                       temporality=temporality)
    for dp in _list(_field(data, "dataPoints", "data_points")):
        dp = _obj(dp)
        _check_unread(dp)
        if _uint(dp.get("flags")) & _NO_RECORDED_VALUE:
            continue
        attrs = _attributes(resource, dp.get("attributes"))
        t = _uint(_field(dp, "timeUnixNano", "time_unix_nano"))
        if which != "histogram":
            as_double = _field(dp, "asDouble", "as_double")
            as_int = _field(dp, "asInt", "as_int")
            if as_double is not None and as_int is not None:
                raise _Unsupported("two values")
            value = (_double(as_double) if as_double is not None
                     else float(_sint(as_int)) if as_int is not None else 0.0)
            out.add(name, value, t, attrs)
            continue
        count = _uint(dp.get("count"))
        out.add(name + ".count", float(count), t, attrs)
        if dp.get("sum") is not None:
            out.add(name + ".sum", _double(dp["sum"]), t, attrs)
        counts = [_uint(c) for c in _list(_field(dp, "bucketCounts", "bucket_counts"))]
        bounds = [_double(b) for b in _list(_field(dp, "explicitBounds", "explicit_bounds"))]
        if not counts:
            continue
        bucket, total = name + ".bucket", 0
        for bound, n in zip(bounds, counts, strict=False):
            total += n
            out.add(bucket, float(total), t, {**attrs, "le": _prom_float(bound)})
        out.add(bucket, float(count), t, {**attrs, "le": "+Inf"})
