"""POST /v1/traces against real HTTP: the stock SDK span exporter in a separate process, the
OTLP/JSON encoding with hex ids, bad bodies answered 4xx, spans stored in a real SQLite file."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from collectors._otlp_decode import DecodedMetrics
from collectors._otlp_receiver import ReceiverStats, otlp_router
from collectors._otlp_traces import SpanRecord
from collectors._span_store import SpanStore
from policies._state_db import sqlite_url
from tests.collectors.test_otlp_receiver import serve

SENDER = Path(__file__).with_name("otlp_span_sender.py")
LIMIT = 64 * 1024


class Traces:
    def __init__(self, url: str, store: SpanStore, stats: ReceiverStats) -> None:
        self.url, self.store, self.stats = url, store, stats
        self.endpoint = url + "/v1/traces"


@pytest.fixture
def traces(tmp_path: Path) -> Iterator[Traces]:
    store, stats = SpanStore(sqlite_url(tmp_path / "state.db")), ReceiverStats()
    metrics: list[DecodedMetrics] = []
    app = FastAPI()
    app.include_router(otlp_router(metrics.append, max_body_bytes=LIMIT, stats=stats,
                                   span_sink=store.write))
    with serve(app) as url:
        yield Traces(url, store, stats)
    store.close()


@pytest.mark.integration
@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_stock_sdk_span_exporter_in_another_process(traces: Traces, compression: str) -> None:
    done = subprocess.run([sys.executable, str(SENDER), traces.endpoint, compression],
                          capture_output=True, text=True, timeout=60, check=True)
    sent = json.loads(done.stdout)
    trace_id = sent["parent"]["trace_id"]
    assert sent["child"]["trace_id"] == trace_id
    stored = {s.name: s for s in traces.store.spans_for_trace(trace_id)}
    assert set(stored) == {"parent", "child"}
    parent, child = stored["parent"], stored["child"]
    assert parent.span_id == sent["parent"]["span_id"] and parent.parent_span_id == ""
    assert child.span_id == sent["child"]["span_id"]
    assert child.parent_span_id == parent.span_id
    assert child.status == "error" and child.status_message == "boom"
    assert parent.attributes == {"n": 7, "ok": True}
    assert parent.service == "sender" and parent.resource["seedance.rank"] == 3
    assert parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns
    assert traces.stats.spans_accepted == 2


def otlp_json(trace_id: str, span_id: str, parent: str = "") -> dict[str, object]:
    return {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name",
                                     "value": {"stringValue": "json-job"}}]},
        "scopeSpans": [{"spans": [{
            "traceId": trace_id, "spanId": span_id, "parentSpanId": parent, "name": "job.apply",
            "startTimeUnixNano": "1000", "endTimeUnixNano": "2000",
            "attributes": [{"key": "seedance.step", "value": {"intValue": "12"}}]}]}]}]}


def test_otlp_json_hex_ids_and_retries_stored_once(traces: Traces) -> None:
    trace_id, span_id, parent = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", \
        "eee19b7ec3c1b173"
    body = json.dumps(otlp_json(trace_id, span_id, parent))
    for _ in range(2):  # an exporter retrying: the span is kept once
        reply = httpx.post(traces.endpoint, content=body,
                           headers={"Content-Type": "application/json"})
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"].startswith("application/json")
    [span] = traces.store.spans_for_trace(trace_id.upper())
    assert (span.span_id, span.parent_span_id) == (span_id, parent)
    assert (span.start_ns, span.end_ns, span.service) == (1000, 2000, "json-job")
    assert span.attributes == {"seedance.step": 12}


@pytest.mark.parametrize(("body", "headers", "code"), [
    (b"\xff\xff\xff", {"Content-Type": "application/x-protobuf"}, 400),
    (b"{not json", {"Content-Type": "application/json"}, 400),
    (json.dumps(otlp_json("zz" * 16, "ab" * 8)).encode(), {"Content-Type": "application/json"},
     400),
    (json.dumps(otlp_json("ab" * 8, "ab" * 8)).encode(), {"Content-Type": "application/json"},
     400),  # an 8-byte trace id
    (b"{}", {"Content-Type": "text/plain"}, 415),
    (b"{}", {"Content-Type": "application/json", "Content-Encoding": "br"}, 415),
    (b"not gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip"}, 400),
    (gzip.compress(b" " * (LIMIT + 1), mtime=0), {"Content-Type": "application/json",
                                                  "Content-Encoding": "gzip"}, 413),
    (b" " * (LIMIT + 1), {"Content-Type": "application/json"}, 413),
], ids=["bad protobuf", "bad json", "bad trace id", "8-byte trace id", "text/plain",
        "brotli", "not gzip", "gzip over the limit", "over the limit"])
# ids, not the bodies: a gzip body's header holds its time, and xdist's workers must collect
# the same test names
def test_malformed_bodies_are_4xx_and_store_nothing(traces: Traces, body: bytes,
                                                    headers: dict[str, str], code: int) -> None:
    reply = httpx.post(traces.endpoint, content=body, headers=headers)
    assert reply.status_code == code, reply.text
    assert traces.stats.requests_rejected == 1 and traces.stats.spans_accepted == 0
    assert httpx.post(traces.url + "/v1/metrics", content=b"\xff\xff\xff", headers={
        "Content-Type": "application/x-protobuf"}).status_code == 400  # metrics unchanged


def test_no_span_sink_no_traces_endpoint(tmp_path: Path) -> None:
    app = FastAPI()
    app.include_router(otlp_router(lambda d: None))
    with serve(app) as url:
        reply = httpx.post(url + "/v1/traces", content=b"{}",
                           headers={"Content-Type": "application/json"})
    assert reply.status_code == 404


def test_the_span_store_keeps_a_span_once_on_sqlite_and_postgresql(state_db_url: str) -> None:
    store = SpanStore(state_db_url)
    root = SpanRecord(trace_id="ab" * 16, span_id="01" * 8, parent_span_id="", name="root",
                      start_ns=1, end_ns=9, attributes={"n": 1}, resource={"host.name": "h"})
    child = SpanRecord(trace_id="ab" * 16, span_id="02" * 8, parent_span_id="01" * 8,
                       name="child", start_ns=2, end_ns=3, status="error", status_message="x")
    assert store.write([root]) == 1
    assert store.write([child, root, child]) == 1  # a retry and a repeat within one batch
    assert store.spans_for_trace("AB" * 16) == [root, child]
    store.close()
