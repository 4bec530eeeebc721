"""The per-process OTel set-up: store sink, OTLP (HTTP and gRPC), Prometheus reader, config."""

from __future__ import annotations

import bisect
import http.server
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.sdk.metrics.export import MetricExportResult
from prometheus_client.utils import floatToGoString

from collectors._otel import (
    LATENCY_BUCKETS_S,
    STEP_BUCKETS_S,
    StoreMetricExporter,
    TelemetryConfig,
    TelemetryConfigError,
    setup_telemetry,
)
from collectors._otlp_decode import DecodedMetrics
from collectors._points import Point

STEP = "seedance.train.step.duration"
TTFT = "gen_ai.server.time_to_first_token"
TOKENS = "seedance.train.tokens_per_second"
BYTES = "seedance.comm.allreduce.bytes"
_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's OTEL_EXPORTER_OTLP_* must not turn exporters on in these tests."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def config(**overrides: object) -> TelemetryConfig:
    fields: dict[str, object] = {"job": "train-demo", "rank": 3, "host": "node-7",
                                 "export_interval_s": 3600.0}
    fields.update(overrides)
    return TelemetryConfig(**fields)  # type: ignore[arg-type]


def cumulative(values: list[float], bounds: tuple[float, ...]) -> list[float]:
    """What a cumulative histogram over ``bounds`` must hold for ``values`` (le is inclusive)."""
    ordered = sorted(values)
    return [float(bisect.bisect_right(ordered, b)) for b in bounds] + [float(len(values))]


def by_name(points: list[Point], name: str) -> list[Point]:
    return [p for p in points if p.name == name]


def record_sample(telemetry_meter_source: object, steps: list[float], ttfts: list[float]) -> None:
    meter = telemetry_meter_source.meter("tests.otel")  # type: ignore[attr-defined]
    step = meter.create_histogram(STEP, unit="s")
    ttft = meter.create_histogram(TTFT, unit="s")
    for value in steps:
        step.record(value, {"seedance.config.version": "5"})
    for value in ttfts:
        ttft.record(value)
    meter.create_gauge(TOKENS, unit="{token}/s").set(812.5)
    meter.create_counter(BYTES, unit="By").add(4096)
    meter.create_counter(BYTES, unit="By").add(1024)


def test_store_sink_receives_counter_gauge_histogram_with_buckets_and_resource() -> None:
    sunk: list[Point] = []
    steps = [0.004, 0.3, 0.31, 1.7, 45.0]
    ttfts = [0.0007, 0.02, 0.2]
    with setup_telemetry(config(), store_sink=lambda decoded: sunk.extend(decoded.points)) as telemetry:
        record_sample(telemetry, steps, ttfts)
        assert telemetry.force_flush(timeout_s=10)
        received = list(sunk)  # shutdown exports (cumulative) once more

    (tokens,) = by_name(received, TOKENS)
    assert tokens.value == 812.5
    (total_bytes,) = by_name(received, BYTES)
    assert total_bytes.value == 4096 + 1024
    for point in (tokens, total_bytes):
        assert point.attributes["service.name"] == "train-demo"
        assert point.attributes["host.name"] == "node-7"
        assert point.attributes["seedance.rank"] == "3"

    buckets = by_name(received, STEP + ".bucket")
    assert [p.attributes["le"] for p in buckets] == \
        [floatToGoString(b) for b in STEP_BUCKETS_S] + ["+Inf"]
    assert [p.value for p in buckets] == cumulative(steps, STEP_BUCKETS_S)
    assert all(p.attributes["seedance.config.version"] == "5" for p in buckets)
    (count,) = by_name(received, STEP + ".count")
    (total,) = by_name(received, STEP + ".sum")
    assert count.value == len(steps)
    assert total.value == pytest.approx(sum(steps))

    ttft_buckets = by_name(received, TTFT + ".bucket")
    assert [p.attributes["le"] for p in ttft_buckets] == \
        [floatToGoString(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
    assert [p.value for p in ttft_buckets] == cumulative(ttfts, LATENCY_BUCKETS_S)


def test_histograms_outside_our_patterns_keep_sdk_default_buckets() -> None:
    received: list[Point] = []
    with setup_telemetry(config(),
                         store_sink=lambda decoded: received.extend(decoded.points)) as telemetry:
        telemetry.meter("tests.otel").create_histogram("other.size", unit="By").record(3.0)
        telemetry.force_flush()
    bounds = {p.attributes["le"] for p in by_name(received, "other.size.bucket")}
    assert bounds  # the SDK default view still applies
    assert bounds.isdisjoint({floatToGoString(b) for b in STEP_BUCKETS_S[:3]})


def test_failing_sink_reports_failure_and_the_next_export_sends_the_points_again() -> None:
    calls: list[list[float]] = []

    def flaky(decoded: DecodedMetrics) -> None:
        calls.append([p.value for p in decoded.points])
        if len(calls) == 1:
            raise OSError("disk full")

    with setup_telemetry(config(), store_sink=flaky) as telemetry:
        telemetry.meter("tests.otel").create_counter("seedance.test.steps").add(3)
        telemetry.force_flush()  # fails
        telemetry.force_flush()  # the unchanged counter is sent again: the last try failed
        telemetry.force_flush()  # unchanged and delivered: nothing to send
    assert calls == [[3.0], [3.0]]


def test_frozen_streams_are_not_exported_again() -> None:
    # A job that moved from config v1 to v2: v1's counter and gauge stop changing, and only
    # v2's points (and every value the job set, repeats included) go out.
    batches: list[list[tuple[str, str, float]]] = []

    def sink(decoded: DecodedMetrics) -> None:
        batches.append(sorted((p.name, p.attributes["v"], p.value) for p in decoded.points))

    with setup_telemetry(config(), store_sink=sink) as telemetry:
        meter = telemetry.meter("tests.otel")
        steps, loss = meter.create_counter("seedance.test.steps"), meter.create_gauge(TOKENS)
        steps.add(1, {"v": "1"})
        loss.set(2.0, {"v": "1"})
        telemetry.force_flush()
        for _ in range(2):
            steps.add(1, {"v": "2"})
            loss.set(1.0, {"v": "2"})
            telemetry.force_flush()
        telemetry.force_flush()
    assert batches == [
        [("seedance.test.steps", "1", 1.0), (TOKENS, "1", 2.0)],
        [("seedance.test.steps", "2", 1.0), (TOKENS, "2", 1.0)],
        [("seedance.test.steps", "2", 2.0), (TOKENS, "2", 1.0)],
    ]


def test_store_exporter_returns_failure_instead_of_raising() -> None:
    def broken(decoded: DecodedMetrics) -> None:
        raise RuntimeError("boom")

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("t").create_counter("c").add(1)
    data = reader.get_metrics_data()
    assert data is not None
    assert StoreMetricExporter(broken).export(data) is MetricExportResult.FAILURE
    assert StoreMetricExporter(lambda decoded: None).export(data) is MetricExportResult.SUCCESS
    provider.shutdown()


def test_without_any_reader_everything_still_works() -> None:
    telemetry = setup_telemetry(config())
    meter = telemetry.meter("tests.otel")
    meter.create_histogram(STEP, unit="s").record(0.5)
    meter.create_counter(BYTES).add(1)
    assert telemetry.prometheus_port is None
    assert telemetry.force_flush(timeout_s=1)
    telemetry.shutdown()
    telemetry.shutdown()  # idempotent


class _OtlpHttpSink(http.server.ThreadingHTTPServer):
    """A tiny OTLP/HTTP receiver: keeps (path, content type, body) of every POST."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, bytes]] = []
        super().__init__(("127.0.0.1", 0), _OtlpHandler)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class _OtlpHandler(http.server.BaseHTTPRequestHandler):
    server: _OtlpHttpSink

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append((self.path, self.headers["Content-Type"], body))
        reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def otlp_http() -> Iterator[_OtlpHttpSink]:
    server = _OtlpHttpSink()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def parse_requests(bodies: list[bytes]) -> list[metrics_service_pb2.ExportMetricsServiceRequest]:
    requests = []
    for body in bodies:
        request = metrics_service_pb2.ExportMetricsServiceRequest()
        request.ParseFromString(body)
        requests.append(request)
    return requests


def metric_names(requests: list[metrics_service_pb2.ExportMetricsServiceRequest]) -> set[str]:
    return {m.name for r in requests for rm in r.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics}


def resource_attrs(request: metrics_service_pb2.ExportMetricsServiceRequest) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in request.resource_metrics[0].resource.attributes:
        out[kv.key] = getattr(kv.value, kv.value.WhichOneof("value"))
    return out


def test_otlp_http_exporter_posts_protobuf_to_the_configured_endpoint(
        otlp_http: _OtlpHttpSink) -> None:
    cfg = config(otlp_endpoint=otlp_http.base_url, resource_attributes={"seedance.job.kind": "train"})
    with setup_telemetry(cfg) as telemetry:
        record_sample(telemetry, [0.2], [0.01])
        assert telemetry.force_flush(timeout_s=10)
    assert otlp_http.requests
    paths = {path for path, _, _ in otlp_http.requests}
    types = {ctype for _, ctype, _ in otlp_http.requests}
    assert paths == {"/v1/metrics"}
    assert types == {"application/x-protobuf"}
    requests = parse_requests([body for _, _, body in otlp_http.requests])
    assert {STEP, TTFT, TOKENS, BYTES} <= metric_names(requests)
    attrs = resource_attrs(requests[0])
    assert attrs["service.name"] == "train-demo"
    assert attrs["seedance.rank"] == 3
    assert attrs["seedance.job.kind"] == "train"


def test_otlp_endpoint_from_standard_env_when_config_leaves_it_unset(
        otlp_http: _OtlpHttpSink, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_http.base_url)
    cfg = config()
    assert cfg.otlp_endpoint is None and cfg.otlp_enabled()
    with setup_telemetry(cfg) as telemetry:
        telemetry.meter("tests.otel").create_gauge(TOKENS).set(2.0)
        telemetry.force_flush(timeout_s=10)
    assert TOKENS in metric_names(parse_requests([body for _, _, body in otlp_http.requests]))


class _GrpcSink(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    def Export(self, request: metrics_service_pb2.ExportMetricsServiceRequest,  # noqa: N802
               context: object) -> metrics_service_pb2.ExportMetricsServiceResponse:
        self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def test_otlp_grpc_exporter_reaches_a_grpc_receiver() -> None:
    sink = _GrpcSink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        cfg = config(otlp_endpoint=f"http://127.0.0.1:{port}", otlp_protocol="grpc")
        with setup_telemetry(cfg) as telemetry:
            record_sample(telemetry, [0.2], [0.01])
            assert telemetry.force_flush(timeout_s=10)
    finally:
        server.stop(grace=None)
    assert {STEP, TOKENS} <= metric_names(sink.requests)
    assert resource_attrs(sink.requests[0])["host.name"] == "node-7"


def test_protocol_default_comes_from_the_standard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config().otlp_protocol == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert config().otlp_protocol == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    assert config().otlp_protocol == "http/protobuf"
    assert config(otlp_protocol="grpc").otlp_protocol == "grpc"


def test_prometheus_reader_serves_the_same_instruments_on_localhost() -> None:
    with setup_telemetry(config(prometheus_port=0)) as telemetry:
        port = telemetry.prometheus_port
        assert port
        record_sample(telemetry, [0.3], [0.01])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    assert 'seedance_train_step_duration_seconds_bucket{le="0.5"' in text
    assert "seedance_train_tokens_per_second" in text
    assert "seedance_comm_allreduce_bytes_total" in text
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@pytest.mark.parametrize(("field", "value"), [
    ("job", ""),
    ("rank", -1),
    ("rank", True),
    ("host", " "),
    ("export_interval_s", 0),
    ("export_interval_s", float("nan")),
    ("otlp_endpoint", "127.0.0.1:4318"),
    ("otlp_protocol", "http/json"),
    ("prometheus_port", 70000),
    ("prometheus_port", "9464"),
    ("resource_attributes", {"service.name": "other"}),
    ("resource_attributes", {"seedance.team": ["a"]}),
])
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(TelemetryConfigError, match=field):
        config(**{field: value})


def test_config_is_frozen_and_its_extras_read_only() -> None:
    cfg = config(resource_attributes={"seedance.job.kind": "train"})
    with pytest.raises(AttributeError):
        cfg.job = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.resource_attributes["x"] = "y"  # type: ignore[index]
