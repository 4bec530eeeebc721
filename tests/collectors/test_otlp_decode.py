"""OTLP request -> Points: every data type, attribute rendering, both wire formats."""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

from collectors._errors import SeedanceError
from collectors._otlp_decode import (
    OtlpDecodeError,
    Temporality,
    decode_json,
    decode_protobuf,
    points_from_request,
    render_value,
)
from collectors._points import MetricKind

EXAMPLE = Path(__file__).parent.parent / "data" / "otlp_opentelemetry-proto_examples_metrics.json"
T = 1_700_000_000_123_456_789


def _kv(key: str, value: str | int) -> KeyValue:
    if isinstance(value, str):
        return KeyValue(key=key, value=AnyValue(string_value=value))
    return KeyValue(key=key, value=AnyValue(int_value=value))


def _request(*metrics: m.Metric, resource: dict[str, str | int] | None = None
             ) -> ExportMetricsServiceRequest:
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    for key, value in (resource or {}).items():
        rm.resource.attributes.append(_kv(key, value))
    rm.scope_metrics.add().metrics.extend(metrics)
    return request


def test_gauge_and_sum_values_attributes_and_metadata() -> None:
    gauge = m.Metric(name="g", unit="By", description="a gauge", gauge=m.Gauge(data_points=[
        m.NumberDataPoint(time_unix_nano=T, as_double=2.5, attributes=[_kv("gpu", "0")]),
        m.NumberDataPoint(time_unix_nano=T + 1, as_int=-7, attributes=[_kv("gpu", "1")]),
    ]))
    delta = m.Metric(name="s", sum=m.Sum(
        aggregation_temporality=m.AGGREGATION_TEMPORALITY_DELTA, is_monotonic=False,
        data_points=[m.NumberDataPoint(time_unix_nano=T, as_int=3)]))
    decoded = points_from_request(_request(gauge, delta, resource={
        "service.name": "trainer", "seedance.rank": 3, "process.pid": 42}))

    got = [(p.name, p.value, p.time_ns, dict(p.attributes)) for p in decoded.points]
    res = {"service.name": "trainer", "seedance.rank": "3"}  # process.pid is not copied
    assert got == [
        ("g", 2.5, T, {**res, "gpu": "0"}),
        ("g", -7.0, T + 1, {**res, "gpu": "1"}),
        ("s", 3.0, T, res),
    ]
    g, s = decoded.metrics["g"], decoded.metrics["s"]
    assert (g.kind, g.otlp_type, g.unit, g.description) == (MetricKind.GAUGE, "gauge", "By",
                                                            "a gauge")
    assert (s.kind, s.monotonic, s.temporality) == (MetricKind.SUM, False, Temporality.DELTA)


def test_data_point_attribute_wins_over_resource_attribute() -> None:
    gauge = m.Metric(name="g", gauge=m.Gauge(data_points=[
        m.NumberDataPoint(as_double=1, attributes=[_kv("host.name", "point")])]))
    decoded = points_from_request(_request(gauge, resource={"host.name": "resource"}))
    assert decoded.points[0].attributes == {"host.name": "point"}


def test_histogram_buckets_are_cumulative_with_prometheus_le() -> None:
    bounds = [0.005, 1.0, 10.0, 1e7]
    values = [0.001, 0.5, 0.7, 3.0, 5e7, 2e7]
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    hist = m.Metric(name="h", histogram=m.Histogram(
        aggregation_temporality=m.AGGREGATION_TEMPORALITY_CUMULATIVE, data_points=[
            m.HistogramDataPoint(time_unix_nano=T, count=len(values), sum=sum(values),
                                 explicit_bounds=bounds, bucket_counts=counts,
                                 attributes=[_kv("op", "step")])]))
    points = points_from_request(_request(hist)).points

    by_name = {(p.name, p.attributes.get("le")): p.value for p in points}
    assert by_name[("h.count", None)] == len(values)
    assert by_name[("h.sum", None)] == pytest.approx(sum(values))
    buckets = [(p.attributes["le"], p.value) for p in points if p.name == "h.bucket"]
    assert buckets == [
        ("0.005", 1.0), ("1.0", 3.0), ("10.0", 4.0), ("1e+07", 4.0), ("+Inf", 6.0)]
    assert all(p.attributes["op"] == "step" for p in points)


def test_histogram_without_buckets_or_sum_gives_count_only() -> None:
    hist = m.Metric(name="h", histogram=m.Histogram(data_points=[m.HistogramDataPoint(count=4)]))
    assert [(p.name, p.value) for p in points_from_request(_request(hist)).points] == [
        ("h.count", 4.0)]


def test_exponential_histogram_bounds_cover_the_recorded_values() -> None:
    scale = 1  # base = sqrt(2)
    base = 2 ** 0.5
    values = [-3.0, -1.1, 0.0, 1.5, 1.6, 5.0]
    pos: dict[int, int] = {}
    neg: dict[int, int] = {}
    for v in values:
        if v != 0:
            index = math.ceil(math.log(abs(v), base)) - 1  # bucket (base**i, base**(i+1)]
            (pos if v > 0 else neg)[index] = (pos if v > 0 else neg).get(index, 0) + 1

    def buckets(d: dict[int, int]) -> m.ExponentialHistogramDataPoint.Buckets:
        lo = min(d)
        return m.ExponentialHistogramDataPoint.Buckets(
            offset=lo, bucket_counts=[d.get(i, 0) for i in range(lo, max(d) + 1)])

    hist = m.Metric(name="e", exponential_histogram=m.ExponentialHistogram(data_points=[
        m.ExponentialHistogramDataPoint(
            time_unix_nano=T, count=len(values), sum=sum(values), scale=scale, zero_count=1,
            positive=buckets(pos), negative=buckets(neg))]))
    points = points_from_request(_request(hist)).points
    buckets_out = [(p.attributes["le"], p.value) for p in points if p.name == "e.bucket"]

    assert buckets_out[-1] == ("+Inf", len(values))
    for le, cumulative in buckets_out[:-1]:
        # Every finite bound must hold exactly the recorded values at or below it (up to the
        # rounding of base**i, which the values here stay clear of).
        assert cumulative == sum(v <= float(le) for v in values), le
    assert [v for _, v in buckets_out] == sorted(v for _, v in buckets_out)


def test_summary_gives_count_sum_and_quantiles() -> None:
    qv = m.SummaryDataPoint.ValueAtQuantile
    summary = m.Metric(name="lat", summary=m.Summary(data_points=[m.SummaryDataPoint(
        time_unix_nano=T, count=10, sum=4.5,
        quantile_values=[qv(quantile=0.5, value=0.3), qv(quantile=0.99, value=1.2)])]))
    decoded = points_from_request(_request(summary))
    got = [(p.name, p.value, dict(p.attributes)) for p in decoded.points]
    assert got == [("lat.count", 10.0, {}), ("lat.sum", 4.5, {}),
                   ("lat", 0.3, {"quantile": "0.5"}), ("lat", 1.2, {"quantile": "0.99"})]
    assert decoded.metrics["lat"].otlp_type == "summary"


def test_no_recorded_value_points_are_skipped() -> None:
    flag = m.DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK
    gauge = m.Metric(name="g", gauge=m.Gauge(data_points=[
        m.NumberDataPoint(as_double=1, flags=flag), m.NumberDataPoint(as_double=2)]))
    assert [p.value for p in points_from_request(_request(gauge)).points] == [2.0]


@pytest.mark.parametrize(("value", "text"), [
    (AnyValue(string_value="x"), "x"),
    (AnyValue(bool_value=True), "true"),
    (AnyValue(int_value=-12), "-12"),
    (AnyValue(double_value=0.25), "0.25"),
    (AnyValue(bytes_value=b"\x01\xff"), "01ff"),
    (AnyValue(), ""),
    (AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="a")])),
     '[1,"a"]'),
    (AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="k", value=AnyValue(
        bool_value=False))])), '{"k":false}'),
])
def test_render_value(value: AnyValue, text: str) -> None:
    assert render_value(value) == text


def test_json_and_protobuf_decode_to_the_same_request() -> None:
    body = EXAMPLE.read_bytes()
    request = decode_json(body)
    assert decode_protobuf(request.SerializeToString()) == request
    assert {mt.name for mt in request.resource_metrics[0].scope_metrics[0].metrics} == {
        "my.counter", "my.gauge", "my.histogram", "my.exponential.histogram"}


def test_json_accepts_int64_as_number_and_ignores_unknown_fields() -> None:
    doc = {"resourceMetrics": [{"futureField": 1, "scopeMetrics": [{"metrics": [{
        "name": "c", "sum": {"aggregationTemporality": 2, "isMonotonic": True, "dataPoints": [
            {"asInt": 41, "timeUnixNano": T, "unknown": {"a": 1}},
            {"asInt": "42", "timeUnixNano": str(T)}]}}]}]}]}
    decoded = points_from_request(decode_json(json.dumps(doc).encode()))
    assert [(p.value, p.time_ns) for p in decoded.points] == [(41.0, T), (42.0, T)]
    assert decoded.metrics["c"].temporality == Temporality.CUMULATIVE


@pytest.mark.parametrize("body", [b"\xff\xff\xff", b"\x0a\x10\x0a"])
def test_bad_protobuf_raises_project_error(body: bytes) -> None:
    with pytest.raises(OtlpDecodeError, match="protobuf"):
        decode_protobuf(body)


def test_truncated_protobuf_raises() -> None:
    body = decode_json(EXAMPLE.read_bytes()).SerializeToString()
    with pytest.raises(OtlpDecodeError):
        decode_protobuf(body[: len(body) // 2])


@pytest.mark.parametrize("body", [b"{", b"\xff", b'{"resourceMetrics": 5}', b"[1]"])
def test_bad_json_raises_project_error(body: bytes) -> None:
    with pytest.raises(SeedanceError, match="JSON"):
        decode_json(body)

