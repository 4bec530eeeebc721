"""LatestValueCollector exposition, the /metrics server, and a real Prometheus scraping it."""

from __future__ import annotations

import bisect
import http.server
import math
import statistics
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.metrics import Counter, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from collectors._otel import STEP_BUCKETS_S, TelemetryConfig, histogram_views, setup_telemetry
from collectors._otlp_decode import (
    DecodedMetrics,
    decode_json,
    decode_protobuf,
    points_from_request,
)
from collectors._prometheus import (
    LatestValueCollector,
    MetricsServerError,
    prometheus_labels,
    serve_metrics,
)
from tests.servers import QUERY_WAIT_S, start_prometheus, wait_for

DATA = Path(__file__).resolve().parents[1] / "data"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def sdk_decoded(record: object, *, delta: bool = False) -> DecodedMetrics:
    """Run ``record(meter)`` against the real SDK and decode its OTLP encoding."""
    temporality = {Counter: AggregationTemporality.DELTA} if delta else None
    reader = InMemoryMetricReader(preferred_temporality=temporality)
    provider = MeterProvider(metric_readers=[reader], views=histogram_views(),
                             resource=Resource.create({"service.name": "train-demo"}))
    record(provider.get_meter("tests.prometheus"))  # type: ignore[operator]
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return points_from_request(encode_metrics(data))


def exposition(collector: LatestValueCollector) -> dict[str, Metric]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family: Metric, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for s in family.samples if s.name == name]


def training(meter: object, steps: Sequence[float] = (0.2, 0.3, 0.7), tokens: float = 900.0,
             version: str = "4") -> None:
    attrs = {"seedance.config.version": version}
    step = meter.create_histogram("seedance.train.step.duration", unit="s")  # type: ignore[attr-defined]
    for value in steps:
        step.record(value, attrs)
    meter.create_gauge("seedance.train.tokens_per_second", unit="{token}/s").set(tokens, attrs)  # type: ignore[attr-defined]
    meter.create_counter("seedance.comm.allreduce.bytes", unit="By").add(4096, attrs)  # type: ignore[attr-defined]
    meter.create_up_down_counter("seedance.serve.queue_depth", unit="{request}").add(3)  # type: ignore[attr-defined]


def test_names_types_and_labels_follow_the_otel_prometheus_translation() -> None:
    steps = [0.2, 0.3, 0.7]
    collector = LatestValueCollector()
    collector.update(sdk_decoded(lambda m: training(m, steps)))
    families = exposition(collector)

    step = families["seedance_train_step_duration_seconds"]
    assert step.type == "histogram"
    buckets = samples(step, "seedance_train_step_duration_seconds_bucket")
    assert [float(labels["le"]) for labels, _ in buckets] == [*STEP_BUCKETS_S, math.inf]
    ordered = sorted(steps)
    assert [v for _, v in buckets] == \
        [float(bisect.bisect_right(ordered, b)) for b in STEP_BUCKETS_S] + [len(steps)]
    assert all(labels["seedance_config_version"] == "4" for labels, _ in buckets)
    assert all(labels["service_name"] == "train-demo" for labels, _ in buckets)
    ((_, count),) = samples(step, "seedance_train_step_duration_seconds_count")
    ((_, total),) = samples(step, "seedance_train_step_duration_seconds_sum")
    assert count == len(steps)
    assert total == pytest.approx(sum(steps))

    assert families["seedance_train_tokens_per_second"].type == "gauge"
    counter = families["seedance_comm_allreduce_bytes"]
    assert counter.type == "counter"
    assert [v for _, v in samples(counter, "seedance_comm_allreduce_bytes_total")] == [4096]
    assert families["seedance_serve_queue_depth"].type == "gauge"  # non-monotonic sum


def test_latest_value_wins_per_series() -> None:
    collector = LatestValueCollector()
    collector.update(sdk_decoded(lambda m: training(m, tokens=100.0, version="1")))
    collector.update(sdk_decoded(lambda m: training(m, tokens=250.0, version="1")))
    collector.update(sdk_decoded(lambda m: training(m, tokens=75.0, version="2")))
    gauge = exposition(collector)["seedance_train_tokens_per_second"]
    by_version = {labels["seedance_config_version"]: value
                  for labels, value in samples(gauge, "seedance_train_tokens_per_second")}
    assert by_version == {"1": 250.0, "2": 75.0}


def test_delta_counters_are_added_up_into_a_running_total() -> None:
    collector = LatestValueCollector()
    for added in (5, 7):
        collector.update(sdk_decoded(
            lambda m, n=added: m.create_counter("seedance.serve.preemptions").add(n),
            delta=True))
    family = exposition(collector)["seedance_serve_preemptions"]
    assert [v for _, v in samples(family, "seedance_serve_preemptions_total")] == [5 + 7]


def test_the_canonical_otlp_example_exposes_every_type() -> None:
    """tests/data: opentelemetry-proto examples/metrics.json (sum, gauge, histogram, exp.)."""
    request = decode_json((DATA / "otlp_opentelemetry-proto_examples_metrics.json").read_bytes())
    decoded = points_from_request(request)
    collector = LatestValueCollector()
    collector.update(decoded)
    families = exposition(collector)
    expected_types = {"gauge": "gauge", "histogram": "histogram",
                      "exponential_histogram": "histogram"}
    for info in decoded.metrics.values():
        name = info.name.replace(".", "_")
        if info.otlp_type == "sum":
            assert families[name].type == ("counter" if info.monotonic else "gauge")
        else:
            assert families[name].type == expected_types[info.otlp_type]
        if families[name].type == "histogram":
            count_points = [p for p in decoded.points if p.name == info.name + ".count"]
            inf = [v for labels, v in samples(families[name], name + "_bucket")
                   if labels["le"] == "+Inf"]
            assert inf == [p.value for p in count_points]


def test_summaries_expose_quantiles_count_and_sum() -> None:
    request = ExportMetricsServiceRequest()
    metric = request.resource_metrics.add().scope_metrics.add().metrics.add()
    metric.name, metric.unit = "gen_ai.server.request.duration", "s"
    dp = metric.summary.data_points.add()
    dp.count, dp.sum, dp.time_unix_nano = 10, 4.5, 1
    for quantile, value in ((0.5, 0.4), (0.99, 0.9)):
        q = dp.quantile_values.add()
        q.quantile, q.value = quantile, value
    collector = LatestValueCollector()
    collector.update(points_from_request(request))
    family = exposition(collector)["gen_ai_server_request_duration_seconds"]
    assert family.type == "summary"
    assert {labels["quantile"]: v
            for labels, v in samples(family, "gen_ai_server_request_duration_seconds")} == \
        {"0.5": 0.4, "0.99": 0.9}
    assert samples(family, "gen_ai_server_request_duration_seconds_count") == [({}, 10.0)]


def test_colliding_attribute_keys_are_joined_in_key_order() -> None:
    assert prometheus_labels({"a_b": "2", "a.b": "1", "seedance.config.version": "7"}) == \
        {"a_b": "1;2", "seedance_config_version": "7"}


def test_expire_drops_only_stale_series() -> None:
    clock = FakeClock()
    collector = LatestValueCollector(clock=clock)
    collector.update(sdk_decoded(lambda m: training(m, version="old")))
    clock.now_s += 60
    collector.update(sdk_decoded(lambda m: m.create_gauge(
        "seedance.train.tokens_per_second", unit="{token}/s").set(1.0, {
            "seedance.config.version": "new"})))
    assert collector.expire(max_age_s=30) > 0
    families = exposition(collector)
    assert set(families) == {"seedance_train_tokens_per_second"}
    ((labels, _),) = samples(families["seedance_train_tokens_per_second"],
                             "seedance_train_tokens_per_second")
    assert labels["seedance_config_version"] == "new"
    assert collector.expire(max_age_s=30) == 0


def test_with_idle_s_updates_drop_series_that_stopped_arriving() -> None:
    """A tuned job's old config versions leave /metrics by themselves."""
    clock = FakeClock()
    collector = LatestValueCollector(idle_s=40.0, clock=clock)

    def tokens(version: str) -> DecodedMetrics:
        return sdk_decoded(lambda m: m.create_gauge(
            "seedance.train.tokens_per_second", unit="{token}/s").set(1.0, {
                "seedance.config.version": version}))

    for version in ("1", "2", "3"):
        collector.update(tokens(version))
        clock.now_s += 30
    versions = [labels["seedance_config_version"] for labels, _ in samples(
        exposition(collector)["seedance_train_tokens_per_second"],
        "seedance_train_tokens_per_second")]
    assert versions == ["2", "3"]  # "1" was idle 60 s > 40 s at the last update's sweep


def test_points_the_request_did_not_describe_are_ignored() -> None:
    decoded = sdk_decoded(training)
    decoded.metrics.pop("seedance.train.tokens_per_second")
    collector = LatestValueCollector()
    collector.update(decoded)
    assert "seedance_train_tokens_per_second" not in exposition(collector)


def test_updates_and_scrapes_from_many_threads() -> None:
    decoded = [sdk_decoded(lambda m, v=str(i): training(m, version=v)) for i in range(4)]
    collector = LatestValueCollector()
    errors: list[BaseException] = []

    def work(d: DecodedMetrics) -> None:
        try:
            for _ in range(50):
                collector.update(d)
                exposition(collector)
        except BaseException as e:  # noqa: BLE001 (reported by the assertion below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(d,)) for d in decoded]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    gauge = exposition(collector)["seedance_train_tokens_per_second"]
    assert len(samples(gauge, "seedance_train_tokens_per_second")) == 4


def test_serve_metrics_on_a_free_local_port_and_stop() -> None:
    collector = LatestValueCollector()
    collector.update(sdk_decoded(training))
    registry = CollectorRegistry()
    registry.register(collector)
    server = serve_metrics(registry, 0)
    try:
        assert server.port
        with urllib.request.urlopen(server.url, timeout=10) as reply:
            assert b"seedance_train_tokens_per_second" in reply.read()
        with pytest.raises(MetricsServerError, match=str(server.port)):
            serve_metrics(registry, server.port)
    finally:
        server.stop()
        server.stop()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


# --- a real Prometheus server --------------------------------------------------------------


class _OtlpIntoCollector(http.server.ThreadingHTTPServer):
    """The sidecar's receive path in miniature: OTLP/HTTP protobuf -> decode -> collector."""

    def __init__(self, collector: LatestValueCollector) -> None:
        self.collector = collector
        super().__init__(("127.0.0.1", 0), _OtlpHandler)


class _OtlpHandler(http.server.BaseHTTPRequestHandler):
    server: _OtlpIntoCollector

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.collector.update(points_from_request(decode_protobuf(body)))
        reply = ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.integration
def test_real_prometheus_scrapes_training_metrics_from_a_real_otlp_export(
        prometheus_binary: str, prometheus_dir: Path) -> None:
    """A job exports over OTLP/HTTP every 0.5 s; the decoded points feed LatestValueCollector;
    a real Prometheus scrapes it every 1 s and answers PromQL over what it stored."""
    step_cycle = [0.2, 0.3, 0.35, 0.4, 0.9]
    collector = LatestValueCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    receiver = _OtlpIntoCollector(collector)
    receiver_thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    receiver_thread.start()
    stop = threading.Event()
    proc: subprocess.Popen[bytes] | None = None
    metrics = serve_metrics(registry, 0)
    telemetry = setup_telemetry(TelemetryConfig(
        job="train-demo", rank=0, export_interval_s=0.5,
        otlp_endpoint=f"http://127.0.0.1:{receiver.server_port}"))

    def train() -> None:  # simulated training loop: records known step times, no real work
        meter = telemetry.meter("tests.prometheus")
        step = meter.create_histogram("seedance.train.step.duration", unit="s")
        tokens = meter.create_gauge("seedance.train.tokens_per_second", unit="{token}/s")
        attrs = {"seedance.config.version": "1"}
        i = 0
        while not stop.wait(0.02):
            step.record(step_cycle[i % len(step_cycle)], attrs)
            tokens.set(4096 / step_cycle[i % len(step_cycle)], attrs)
            i += 1

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        proc, api = start_prometheus(prometheus_binary, prometheus_dir,
                                     f"127.0.0.1:{metrics.port}")
        deadline = time.monotonic() + QUERY_WAIT_S
        log = prometheus_dir / "prometheus.log"

        tokens = wait_for(api, 'seedance_train_tokens_per_second{service_name="train-demo"}',
                          proc, deadline, log)
        assert {r["metric"]["seedance_config_version"] for r in tokens} == {"1"}  # type: ignore[index]
        assert float(tokens[0]["value"][1]) in {4096 / s for s in step_cycle}  # type: ignore[index]

        p50 = wait_for(api, "histogram_quantile(0.5, "
                       "rate(seedance_train_step_duration_seconds_bucket[10s]))",
                       proc, deadline, log)
        median = statistics.median(step_cycle)
        upper = STEP_BUCKETS_S[bisect.bisect_left(STEP_BUCKETS_S, median)]
        lower = STEP_BUCKETS_S[bisect.bisect_left(STEP_BUCKETS_S, median) - 1]
        # Prometheus interpolates inside the bucket that holds the median.
        assert lower <= float(p50[0]["value"][1]) <= upper  # type: ignore[index]
    finally:
        stop.set()
        trainer.join()
        telemetry.shutdown()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        metrics.stop()
        receiver.shutdown()
        receiver.server_close()
        receiver_thread.join()
