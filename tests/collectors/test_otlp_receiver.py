"""The OTLP/HTTP receiver against real HTTP: uvicorn on 127.0.0.1, the stock OTel SDK exporter in
a separate process, bad bodies of every kind, and forwarding to a second real server."""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import gzip
import json
import logging
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)

from collectors._errors import SeedanceError
from collectors._otlp_decode import DecodedMetrics, Temporality, decode_json
from collectors._otlp_receiver import (
    INGEST_WORKERS,
    BodyTooLarge,
    Forwarder,
    ForwarderConfig,
    ReceiverStats,
    gunzip,
    otlp_router,
)

HERE = Path(__file__).parent
EXAMPLE = HERE.parent / "data" / "otlp_opentelemetry-proto_examples_metrics.json"
PB = {"content-type": "application/x-protobuf"}
LIMIT = 256 * 1024


class Sink:
    """Collects what the receiver hands over; raises while ``fail`` is set (``error``, or
    "store is down")."""

    def __init__(self) -> None:
        self.received: list[DecodedMetrics] = []
        self.fail = False
        self.error: Exception = RuntimeError("store is down")

    def __call__(self, decoded: DecodedMetrics) -> None:
        if self.fail:
            raise self.error
        self.received.append(decoded)


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under uvicorn on 127.0.0.1 and a free port; yield its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_for(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class Receiver:
    def __init__(self, url: str, sink: Sink, stats: ReceiverStats, encodings: list[str]) -> None:
        self.url, self.sink, self.stats, self.encodings = url, sink, stats, encodings
        self.endpoint = url + "/v1/metrics"


@contextlib.contextmanager
def receiver(forwarder: Forwarder | None = None, ingest_token: str | None = None,
             admit: Callable[[Callable[[], Mapping[str, str] | None]], None] | None = None,
             ) -> Iterator[Receiver]:
    sink, stats, encodings = Sink(), ReceiverStats(), []
    app = FastAPI()
    app.include_router(otlp_router(sink, max_body_bytes=LIMIT, forwarder=forwarder, stats=stats,
                                   ingest_token=ingest_token, admit=admit))

    @app.middleware("http")
    async def record_encoding(request: Request, call_next):  # type: ignore[no-untyped-def]
        encodings.append(request.headers.get("content-encoding", "identity"))
        return await call_next(request)

    with serve(app) as url:
        yield Receiver(url, sink, stats, encodings)


@pytest.fixture
def rx() -> Iterator[Receiver]:
    with receiver() as r:
        yield r


def _good_body() -> bytes:
    return decode_json(EXAMPLE.read_bytes()).SerializeToString()


def _assert_good_request_accepted(rx: Receiver) -> None:
    before = len(rx.sink.received)
    r = httpx.post(rx.endpoint, content=_good_body(), headers=PB)
    assert r.status_code == 200
    assert len(rx.sink.received) == before + 1


@pytest.mark.integration
@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_stock_sdk_exporter_in_another_process(rx: Receiver, compression: str) -> None:
    spec = {
        "resource": {"service.name": "sdk-sender", "service.instance.id": "i-1",
                     "seedance.rank": 2, "process.pid": 1, "deployment.environment": "prod",
                     "k8s.pod.name": "trainer-0"},
        "gauge": [[42.5, {"gpu.index": "0"}], [7, {"gpu.index": "1"}]],
        "counter": [3, 4],
        "histogram": [3.0, 7.0, 7.0, 300.0],
        "bounds": [5.0, 10.0, 250.0],
        "attrs": {"phase": "train", "ok": True},
    }
    subprocess.run([sys.executable, str(HERE / "otlp_sdk_sender.py"), rx.endpoint, compression,
                    json.dumps(spec)], check=True, timeout=60)

    assert rx.encodings == ["identity" if compression == "none" else "gzip"]
    assert rx.stats.requests_accepted == 1
    (decoded,) = rx.sink.received
    # The int rank is rendered as str; what the sender said beyond service.name is kept (#15),
    # process.pid, service.instance.id and the SDK's telemetry.sdk.* are not copied.
    res = {"service.name": "sdk-sender", "seedance.rank": "2",
           "deployment.environment": "prod", "k8s.pod.name": "trainer-0"}
    attrs = {**res, "phase": "train", "ok": "true"}
    got = {(p.name, tuple(sorted(p.attributes.items()))): p.value for p in decoded.points}

    def at(name: str, **extra: str) -> float:
        return got[(name, tuple(sorted(extra.items())))]

    for value, gauge_attrs in spec["gauge"]:
        assert at("test.gauge", **res, **gauge_attrs) == value
    assert at("test.counter", **attrs) == sum(spec["counter"])
    values, bounds = spec["histogram"], spec["bounds"]
    assert at("test.latency.count", **attrs) == len(values)
    assert at("test.latency.sum", **attrs) == sum(values)
    for bound in bounds:
        le = str(float(bound))
        assert at("test.latency.bucket", **attrs, le=le) == bisect.bisect_right(sorted(values),
                                                                                bound)
    assert at("test.latency.bucket", **attrs, le="+Inf") == len(values)
    assert len(got) == len(decoded.points)  # nothing else, no duplicates
    assert decoded.metrics["test.counter"].temporality == Temporality.CUMULATIVE
    assert decoded.metrics["test.counter"].monotonic
    assert decoded.metrics["test.gauge"].unit == "By"
    assert all(p.time_ns > 0 for p in decoded.points)


@pytest.mark.integration
def test_with_an_ingest_token_only_exporters_that_send_it_get_in() -> None:
    spec = {"resource": {"service.name": "sdk-sender"}, "gauge": [[1.0, {}]], "counter": [1],
            "histogram": [1.0], "bounds": [5.0], "attrs": {}}
    with receiver(ingest_token="ingest-s3cret") as rx:
        def send(headers: str | None) -> None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
            if headers is not None:
                env["OTEL_EXPORTER_OTLP_HEADERS"] = headers
            subprocess.run([sys.executable, str(HERE / "otlp_sdk_sender.py"), rx.endpoint,
                            "none", json.dumps(spec)], check=True, timeout=60, env=env)

        send(None)
        send("Authorization=Bearer%20a-guess")
        assert rx.sink.received == [] and rx.stats.requests_unauthorised == 2
        send("Authorization=Bearer%20ingest-s3cret")  # the standard OTel way to send it
        assert len(rx.sink.received) == 1 and rx.stats.requests_accepted == 1
        r = httpx.post(rx.endpoint, content=_good_body(), headers=PB)
        assert r.status_code == 401 and b"OTEL_EXPORTER_OTLP_HEADERS" in r.content


def test_real_otlp_json_example_over_http(rx: Receiver) -> None:
    body = EXAMPLE.read_bytes()
    r = httpx.post(rx.endpoint, content=body,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {}
    (decoded,) = rx.sink.received

    # Expectations read from the document with plain json, independently of protobuf.
    doc = json.loads(body)
    resource = {a["key"]: a["value"]["stringValue"]
                for a in doc["resourceMetrics"][0]["resource"]["attributes"]}
    metrics = {m["name"]: m for m in doc["resourceMetrics"][0]["scopeMetrics"][0]["metrics"]}
    points = {p.name: p for p in decoded.points if p.name != "my.histogram.bucket"
              and not p.name.startswith("my.exponential.histogram.")}
    for name, kind in [("my.counter", "sum"), ("my.gauge", "gauge")]:
        dp = metrics[name][kind]["dataPoints"][0]
        assert points[name].value == dp["asDouble"]
        assert points[name].time_ns == int(dp["timeUnixNano"])
        assert points[name].attributes == {
            **resource, dp["attributes"][0]["key"]: dp["attributes"][0]["value"]["stringValue"]}
        assert decoded.metrics[name].description == metrics[name]["description"]
    hist = metrics["my.histogram"]["histogram"]["dataPoints"][0]
    assert points["my.histogram.count"].value == int(hist["count"])
    assert points["my.histogram.sum"].value == hist["sum"]
    buckets = [p.value for p in decoded.points if p.name == "my.histogram.bucket"]
    counts = [int(c) for c in hist["bucketCounts"]]
    assert buckets == [sum(counts[: i + 1]) for i in range(len(counts))]
    exp = metrics["my.exponential.histogram"]["exponentialHistogram"]["dataPoints"][0]
    exp_count = [p for p in decoded.points if p.name == "my.exponential.histogram.count"]
    assert [p.value for p in exp_count] == [int(exp["count"])]
    assert decoded.metrics["my.counter"].temporality == Temporality.DELTA  # enum given as 1


def _gzip_bomb() -> bytes:
    return gzip.compress(b"\0" * (64 * LIMIT), compresslevel=9)


BAD_REQUESTS = {
    "malformed protobuf": (PB, b"\xff\xff\xff\xff", 400, "protobuf"),
    "truncated protobuf": (PB, _good_body()[:-7], 400, "protobuf"),
    "invalid json": ({"content-type": "application/json"}, b'{"resourceMetrics": [', 400,
                     "JSON"),
    "json of the wrong shape": ({"content-type": "application/json"},
                                b'{"resourceMetrics": {"a": 1}}', 400, "JSON"),
    "oversized body": (PB, b"\0" * (LIMIT + 1), 413, "limit"),
    "gzip bomb": ({**PB, "content-encoding": "gzip"}, _gzip_bomb(), 413, "inflates"),
    "wrong content type": ({"content-type": "text/plain"}, _good_body(), 415, "Content-Type"),
    "no content type": ({}, _good_body(), 415, "Content-Type"),
    "unsupported encoding": ({**PB, "content-encoding": "br"}, _good_body(), 415,
                             "Content-Encoding"),
    "bad gzip": ({**PB, "content-encoding": "gzip"}, b"not gzip at all", 400, "gzip"),
    "truncated gzip": ({**PB, "content-encoding": "gzip"}, gzip.compress(_good_body())[:-12],
                       400, "gzip"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_4xx_with_reason_and_receiver_goes_on(rx: Receiver, case: str) -> None:
    headers, body, code, reason = BAD_REQUESTS[case]
    r = httpx.post(rx.endpoint, content=body, headers=headers)

    assert r.status_code == code
    if r.headers["content-type"].startswith("application/json"):
        message = r.json()["message"]
    else:
        message = Status.FromString(r.content).message
    assert reason in message
    assert rx.sink.received == []
    assert rx.stats.requests_rejected == 1
    _assert_good_request_accepted(rx)


def test_gzip_bomb_never_inflates_past_the_limit_in_memory(rx: Receiver) -> None:
    bomb = _gzip_bomb()  # 64 x LIMIT when inflated
    tracemalloc.start()
    try:
        r = httpx.post(rx.endpoint, content=bomb, headers={**PB, "content-encoding": "gzip"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.status_code == 413
    assert peak < 8 * LIMIT, peak


def test_body_over_limit_without_content_length_is_refused(rx: Receiver) -> None:
    chunks = iter([b"\0" * 4096] * (LIMIT // 4096 + 2))  # chunked: no Content-Length to check
    try:
        r = httpx.post(rx.endpoint, content=chunks, headers=PB)
        assert r.status_code == 413
        assert "limit" in Status.FromString(r.content).message
    except httpx.TransportError:
        pass  # the server may close the connection before the client finished sending
    assert rx.stats.requests_rejected == 1
    _assert_good_request_accepted(rx)


def test_wrong_method_is_405(rx: Receiver) -> None:
    assert httpx.get(rx.endpoint).status_code == 405
    _assert_good_request_accepted(rx)


def test_success_answers_in_the_request_encoding(rx: Receiver) -> None:
    r = httpx.post(rx.endpoint, content=gzip.compress(_good_body()),
                   headers={**PB, "content-encoding": "gzip"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-protobuf"
    ExportMetricsServiceResponse.FromString(r.content)  # parses
    assert rx.stats.points_accepted == len(rx.sink.received[0].points) > 0
    assert rx.stats.bytes_received == len(gzip.compress(_good_body()))


def test_sink_failure_is_503_retryable_and_counted(rx: Receiver) -> None:
    rx.sink.fail = True
    r = httpx.post(rx.endpoint, content=_good_body(), headers=PB)
    assert r.status_code == 503
    assert "store is down" in Status.FromString(r.content).message
    assert rx.stats.sink_errors == 1
    assert rx.stats.points_rejected > 0 and rx.stats.points_accepted == 0
    rx.sink.fail = False
    _assert_good_request_accepted(rx)
    assert rx.stats.points_accepted == rx.stats.points_rejected


class Throttled(Exception):
    http_status = 429
    retry_after_s = 2


def test_a_sink_asking_to_slow_down_is_429_counted_and_not_logged_as_an_error(
        rx: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    rx.sink.fail, rx.sink.error = True, Throttled("job 'greedy' has too many points waiting")
    with caplog.at_level(logging.DEBUG, logger="collectors._otlp_receiver"):
        r = httpx.post(rx.endpoint, content=_good_body(), headers=PB)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert "greedy" in Status.FromString(r.content).message
    assert rx.stats.requests_throttled == 1 and rx.stats.sink_errors == 0
    assert rx.stats.points_rejected > 0
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert any("throttled" in rec.getMessage() for rec in caplog.records)
    rx.sink.fail = False
    _assert_good_request_accepted(rx)


def test_a_sender_turned_away_before_its_decode_is_429_and_costs_no_decode() -> None:
    """``admit`` judges a protobuf body by its first resource before it is decoded: the
    sender over its share gets the sink's 429 without a decode (no points counted, the sink
    never called); another job, and a JSON body (which has no look before its decode), go on
    to the sink, which still has the last word."""
    seen: list[Mapping[str, str] | None] = []

    def admit(resource: Callable[[], Mapping[str, str] | None]) -> None:
        seen.append(resource())
        if seen[-1] is not None and seen[-1].get("service.name") == "greedy":
            raise Throttled("job 'greedy' has too many points waiting")

    request = decode_json(EXAMPLE.read_bytes())
    polite = request.SerializeToString()
    request.resource_metrics[0].resource.attributes[0].value.string_value = "greedy"
    greedy = request.SerializeToString()
    with receiver(admit=admit) as rx:
        r = httpx.post(rx.endpoint, content=gzip.compress(greedy),
                       headers={**PB, "content-encoding": "gzip"})
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert "greedy" in Status.FromString(r.content).message
        assert rx.stats.requests_throttled == 1 and rx.stats.points_rejected == 0
        assert rx.sink.received == []
        assert httpx.post(rx.endpoint, content=polite, headers=PB).status_code == 200
        assert seen == [{"service.name": "greedy"}, {"service.name": "my.service"}]
        r = httpx.post(rx.endpoint, content=json.dumps(
            {"resourceMetrics": [{"resource": {"attributes": [
                {"key": "service.name", "value": {"stringValue": "greedy"}}]}}]}),
            headers={"content-type": "application/json"})
        assert r.status_code == 200 and len(seen) == 2


class BlockingSink:
    """Holds every call until released, counting how many are inside at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.inside = self.most_inside = self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, decoded: DecodedMetrics) -> None:
        with self._lock:
            self.calls += 1
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            assert self.release.wait(60), "never released"
        finally:
            with self._lock:
                self.inside -= 1


@pytest.mark.integration
def test_a_flood_of_exports_takes_a_few_ingest_threads_and_the_apis_threads_stay_free() -> None:
    """More exports at once than anyio's shared thread pool holds (40), all stuck in a slow
    sink: at most INGEST_WORKERS of them are in the sink, and a plain ``def`` endpoint of the
    same app (the sidecar's API and leases are such) still answers; then every export lands."""
    sink = BlockingSink()
    app = FastAPI()
    app.include_router(otlp_router(sink))
    app.get("/plain")(lambda: {"ok": True})  # a sync endpoint: runs in anyio's pool
    exports = 48
    with serve(app) as url:
        limits = httpx.Limits(max_connections=exports + 1)
        with httpx.Client(timeout=90, limits=limits) as client, \
                concurrent.futures.ThreadPoolExecutor(exports) as pool:
            answers = [pool.submit(client.post, url + "/v1/metrics", content=_good_body(),
                                   headers=PB) for _ in range(exports)]
            try:
                _wait_for(lambda: sink.calls >= INGEST_WORKERS)
                time.sleep(0.5)  # the others had their chance to enter the sink
                assert sink.calls == sink.most_inside == INGEST_WORKERS
                assert client.get(url + "/plain", timeout=10).json() == {"ok": True}
            finally:
                sink.release.set()
            assert [a.result().status_code for a in answers] == [200] * exports
    assert sink.calls == exports and sink.most_inside == INGEST_WORKERS


def test_the_ingest_thread_count_is_checked() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        otlp_router(lambda d: None, workers=0)


@pytest.mark.integration
@pytest.mark.parametrize("encoding", ["identity", "gzip"])
def test_forwarding_sends_the_identical_body_upstream(encoding: str) -> None:
    seen: list[tuple[bytes, str, str]] = []
    upstream = FastAPI()

    @upstream.post("/v1/metrics")
    async def collect(request: Request) -> Response:
        seen.append((await request.body(), request.headers["content-type"],
                     request.headers.get("content-encoding", "identity")))
        return Response(b"", media_type="application/x-protobuf")

    body = _good_body() if encoding == "identity" else gzip.compress(_good_body())
    with serve(upstream) as up_url:
        config = ForwarderConfig(url=up_url + "/v1/metrics", timeout_s=5)
        with Forwarder(config) as forwarder, receiver(forwarder) as rx:
            r = httpx.post(rx.endpoint, content=body,
                           headers={**PB, "content-encoding": encoding})
            assert r.status_code == 200
            _wait_for(lambda: forwarder.sent == 1)
    assert seen == [(body, "application/x-protobuf", encoding)]
    assert (forwarder.failed, forwarder.dropped) == (0, 0)


def test_forwarder_drops_and_counts_when_full_and_never_blocks() -> None:
    forwarder = Forwarder(ForwarderConfig(url="http://127.0.0.1:9/v1/metrics", max_queue=2))
    results = [forwarder.submit(b"x", {}) for _ in range(5)]  # not started: nothing drains
    assert results == [True, True, False, False, False]
    assert forwarder.dropped == 3
    forwarder.shutdown(timeout_s=1)
    assert forwarder.dropped == 5  # queued bodies of a never-started forwarder are dropped
    forwarder.shutdown(timeout_s=1)  # harmless twice
    assert forwarder.submit(b"x", {}) is False
    with pytest.raises(SeedanceError, match="restart"):
        forwarder.start()


def test_forwarder_counts_upstream_failures_and_goes_on() -> None:
    with serve(FastAPI()) as url:  # no route: every forward is answered 404
        forwarder = Forwarder(ForwarderConfig(url=url + "/v1/metrics", timeout_s=5))
        forwarder.start()
        forwarder.start()  # idempotent
        for _ in range(3):
            assert forwarder.submit(b"x", {"content-type": "application/x-protobuf"})
        forwarder.shutdown(timeout_s=20)
    assert (forwarder.sent, forwarder.failed, forwarder.dropped) == (0, 3, 0)


def test_forwarder_honours_retry_after_then_delivers() -> None:
    arrivals: list[float] = []
    app = FastAPI()

    @app.post("/v1/metrics")
    async def busy(request: Request) -> Response:  # 503 + Retry-After: 1, then takes it
        arrivals.append(time.monotonic())
        await request.body()
        if len(arrivals) == 1:
            return Response(status_code=503, headers={"Retry-After": "1"})
        return Response(status_code=200)

    with serve(app) as url:
        forwarder = Forwarder(ForwarderConfig(url=url + "/v1/metrics", timeout_s=5))
        forwarder.start()
        assert forwarder.submit(b"x", {"content-type": "application/x-protobuf"})
        _wait_for(lambda: forwarder.sent == 1)
        forwarder.shutdown(timeout_s=10)
    assert (forwarder.sent, forwarder.failed, forwarder.deferred) == (1, 0, 1)
    assert arrivals[1] - arrivals[0] >= 0.95  # it waited as asked before trying again


def test_forwarder_stops_within_its_deadline_while_the_upstream_hangs() -> None:
    app = FastAPI()
    release = threading.Event()

    @app.post("/v1/metrics")
    def hang() -> Response:
        release.wait(30)
        return Response(status_code=200)

    with serve(app) as url:
        forwarder = Forwarder(ForwarderConfig(url=url + "/v1/metrics", timeout_s=20,
                                              max_queue=4))
        forwarder.start()
        results = [forwarder.submit(b"x", {}) for _ in range(10)]
        began = time.monotonic()
        forwarder.shutdown(timeout_s=1.0)
        stopped_after = time.monotonic() - began
        release.set()
    assert results.count(False) >= 10 - 4 - 1  # the queue stayed bounded: the rest dropped
    assert stopped_after < 5.0, stopped_after  # its deadline, not the upstream's 20 s


@pytest.mark.parametrize("field_name,kwargs", [
    ("url", {"url": "ftp://x"}),
    ("timeout_s", {"url": "http://x", "timeout_s": 0}),
    ("max_queue", {"url": "http://x", "max_queue": 0}),
])
def test_forwarder_config_names_the_bad_field(field_name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field_name):
        ForwarderConfig(**kwargs)


def test_gunzip_reads_concatenated_members_and_caps_output() -> None:
    assert gunzip(gzip.compress(b"ab") + gzip.compress(b"cd"), 4) == b"abcd"
    with pytest.raises(BodyTooLarge):
        gunzip(gzip.compress(b"ab") + gzip.compress(b"cde"), 4)
