"""The OTLP/JSON fast path against the reference (json_format) path: the same Points and
metric metadata for whatever exporters send, in both field spellings, and the same errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import orjson
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

from collectors._otlp_decode import (
    DecodedMetrics,
    OtlpDecodeError,
    decode_json,
    points_from_request,
)
from collectors._otlp_json import _walk, points_from_json

EXAMPLE = Path(__file__).parent.parent / "data" / "otlp_opentelemetry-proto_examples_metrics.json"
SPECIAL = [0.0, -0.0, 1.5, -2.25e300, 5e-324, math.inf, -math.inf, math.nan, 1e16 + 1.0]


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _random_request(seed: int) -> ExportMetricsServiceRequest:
    """Gauges, sums and histograms with random values, attributes, flags and temporalities."""
    rng = np.random.default_rng(seed)
    request = ExportMetricsServiceRequest()
    for r in range(int(rng.integers(1, 3))):
        rm = request.resource_metrics.add()
        rm.resource.attributes.extend([_kv("service.name", f"job{r}"), _kv("host.name", "h"),
                                       _kv("service.instance.id", "x"), _kv("process.pid", "9")])
        sm = rm.scope_metrics.add()
        sm.scope.name, sm.scope.version = "lib", "1.0"
        for i in range(int(rng.integers(1, 6))):
            kind = ["gauge", "sum", "histogram"][int(rng.integers(0, 3))]
            metric = sm.metrics.add(name=f"m{i % 3}.{kind}", unit=["1", "s", ""][i % 3],
                                    description="d" * int(rng.integers(0, 3)))
            data = getattr(metric, kind)
            if kind != "gauge":
                data.aggregation_temporality = int(rng.integers(0, 3))
            if kind == "sum":
                data.is_monotonic = bool(rng.integers(0, 2))
            for _ in range(int(rng.integers(0, 5))):
                dp = data.data_points.add(
                    time_unix_nano=int(rng.integers(0, 2**63)) * 2,
                    start_time_unix_nano=int(rng.integers(0, 2**40)),
                    flags=int(rng.integers(0, 2)) if rng.random() < 0.2 else 0,
                    attributes=[_kv(f"k{j}", f"v{rng.integers(0, 4)}")
                                for j in range(int(rng.integers(0, 4)))])
                if kind == "histogram":
                    buckets = int(rng.integers(0, 5))
                    dp.count = int(rng.integers(0, 2**64 - 1, dtype=np.uint64))
                    dp.bucket_counts.extend(int(c) for c in rng.integers(0, 99, buckets))
                    dp.explicit_bounds.extend(sorted(rng.normal(size=max(0, buckets - 1))))
                    if rng.random() < 0.7:
                        dp.sum = SPECIAL[int(rng.integers(0, len(SPECIAL)))]
                    if rng.random() < 0.3:
                        dp.min, dp.max = -1.0, 2.0
                elif rng.random() < 0.5:
                    dp.as_double = SPECIAL[int(rng.integers(0, len(SPECIAL)))]
                else:
                    dp.as_int = int(rng.integers(-(2**63), 2**63 - 1))
    return request


def _same(a: DecodedMetrics, b: DecodedMetrics) -> None:
    assert a.metrics == b.metrics
    assert len(a.points) == len(b.points)
    for p, q in zip(a.points, b.points, strict=True):
        assert (p.name, p.time_ns, dict(p.attributes)) == (q.name, q.time_ns, dict(q.attributes))
        assert p.value == q.value or (math.isnan(p.value) and math.isnan(q.value))
        assert math.copysign(1, p.value) == math.copysign(1, q.value)


@pytest.mark.parametrize("proto_names", [False, True], ids=["lowerCamelCase", "proto_names"])
@pytest.mark.parametrize("seed", range(40))
def test_the_fast_path_reads_what_exporters_send_exactly_as_the_reference(
        seed: int, proto_names: bool) -> None:
    request = _random_request(seed)
    body = json_format.MessageToJson(request, preserving_proto_field_name=proto_names,
                                     indent=None).encode()
    reference = points_from_request(decode_json(body))
    _same(_walk(orjson.loads(body)).decoded(), reference)  # the fast path itself, no fallback
    _same(points_from_json(body), reference)


def test_what_the_fast_path_does_not_read_goes_down_the_reference_path() -> None:
    """The specification's example has an exponential histogram; an integer attribute."""
    body = EXAMPLE.read_bytes()
    decoded = points_from_json(body)
    _same(decoded, points_from_request(decode_json(body)))
    assert "my.exponential.histogram" in decoded.metrics
    with_int = json_format.MessageToJson(ExportMetricsServiceRequest(resource_metrics=[{
        "scope_metrics": [{"metrics": [m.Metric(name="g", gauge=m.Gauge(data_points=[
            m.NumberDataPoint(as_int=3, attributes=[
                KeyValue(key="gpu", value=AnyValue(int_value=7))])]))]}]}]), indent=None)
    assert points_from_json(with_int.encode()).points[0].attributes == {"gpu": "7"}


@pytest.mark.parametrize("body", [
    b"", b"{", b"[]", b'{"resourceMetrics": 5}',
    b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "g", "gauge": '
    b'{"dataPoints": [{"timeUnixNano": "abc", "asDouble": 1}]}}]}]}]}',
    b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "g", "gauge": '
    b'{"dataPoints": [{"startTimeUnixNano": "-1", "asDouble": 1}]}}]}]}]}',
    b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "g", "gauge": '
    b'{"dataPoints": [{"asDouble": 1, "asInt": "2"}]}}]}]}]}',
    b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": 5}]}]}]}',
    b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "g", "gauge": '
    b'{"dataPoints": [{"asDouble": 1, "attributes": [{"key": "k", "value": '
    b'{"stringValue": "a", "intValue": "2"}}]}]}}]}]}]}',
    b'{"resource_metrics": [], "resourceMetrics": []}',
], ids=["empty", "truncated", "array", "not-a-list", "bad-time", "bad-start-time",
        "two-values", "name-not-a-string", "two-attribute-values", "both-spellings"])
def test_odd_and_malformed_bodies_get_what_the_reference_path_gives(body: bytes) -> None:
    try:
        reference: DecodedMetrics | None = points_from_request(decode_json(body))
    except OtlpDecodeError:
        reference = None
    if reference is None:
        with pytest.raises(OtlpDecodeError):
            points_from_json(body)
    else:
        _same(points_from_json(body), reference)
