"""Sources that misbehave are visible, and never stop the sidecar: a scrape source that is
down, then answers garbage, then recovers (``seedance_scrape_up`` and the error counter say
so); an upstream collector that is down (ingest keeps answering 200, forwarding failures are
counted, memory stays bounded) and comes back (forwarding resumes). Real sidecar processes,
real HTTP servers on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.faults._sidecar import PROTOBUF, ROOT, SidecarProcess, gauge_request, record
from tests.servers import free_port

pytestmark = pytest.mark.integration

DCGM = ROOT / "tests" / "data" / "dcgm-exporter_metrics_datadog-fixture_T4_partial-dummy.prom"


class Source(ThreadingHTTPServer):
    """An exporter whose answer a test switches: "good" (a real dcgm-exporter capture),
    "garbage" or "down" (the listener closed: connection refused)."""

    def __init__(self, port: int) -> None:
        self.mode = "good"
        good = DCGM.read_bytes()
        source = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = good if source.mode == "good" else b"\x00\xff not { a metric ]]\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{port}/metrics"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def source() -> Iterator[Source]:
    server = Source(free_port())
    yield server
    server.shutdown()
    server.server_close()


def test_a_scrape_source_down_or_garbage_is_visible_and_recovers(tmp_path: Path,
                                                                 source: Source) -> None:
    with SidecarProcess(tmp_path, scrape=[{"url": source.url, "kind": "dcgm",
                                           "interval_s": 1, "timeout_s": 1}]) as sidecar:
        def up() -> float | None:
            return sidecar.metric("seedance_scrape_up", source=source.url)

        sidecar.wait_for("scrape up 1", lambda: up() == 1)
        source.mode = "garbage"
        sidecar.wait_for("scrape up 0 on garbage", lambda: up() == 0)
        garbage_errors = sidecar.metric("seedance_scrape_errors_total", source=source.url)
        source.mode = "good"
        sidecar.wait_for("scrape up 1 again", lambda: up() == 1)
        source.shutdown()  # down: nothing listens
        source.server_close()
        sidecar.wait_for("scrape up 0 when down", lambda: up() == 0)
        errors = sidecar.metric("seedance_scrape_errors_total", source=source.url)
        assert garbage_errors and errors and errors > garbage_errors
        assert sidecar.http.get("/readyz").status_code == 200  # a source is not the sidecar
        record("scrape_source_faults", errors_counted=errors, states_seen=[
            "up", "garbage: down", "up", "refused: down"])


class Upstream(ThreadingHTTPServer):
    """An OTLP collector stand-in on loopback that counts what it receives."""

    def __init__(self, port: int) -> None:
        self.received = 0
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                upstream.received += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_an_upstream_down_for_a_while_costs_nothing_but_counted_bodies(
        tmp_path: Path) -> None:
    port = free_port()  # nothing listens there yet: the upstream is down
    with SidecarProcess(tmp_path, upstream_otlp_endpoint=f"http://127.0.0.1:{port}/v1/metrics"
                        ) as sidecar:
        rss_before = sidecar.rss_mib()
        for i in range(300):
            r = sidecar.http.post("/v1/metrics", headers=PROTOBUF, content=gauge_request(
                "up.gauge", range(20), t0_ns=10**18 + i * 10**9))
            assert r.status_code == 200  # ingest never waits on the upstream
        failed = sidecar.wait_for("forwarding failures", lambda: (
            (sidecar.metric("seedance_forward_failures_total", signal="metrics",
                            outcome="failed") or 0)
            + (sidecar.metric("seedance_forward_failures_total", signal="metrics",
                              outcome="dropped") or 0)) >= 1 and sidecar.metric(
            "seedance_forward_failures_total", signal="metrics", outcome="failed"))
        grown = sidecar.rss_mib() - rss_before
        upstream = Upstream(port)  # back
        try:
            for i in range(5):
                sidecar.http.post("/v1/metrics", headers=PROTOBUF, content=gauge_request(
                    "up.gauge", range(20), t0_ns=2 * 10**18 + i * 10**9))
            sidecar.wait_for("forwarding to resume", lambda: upstream.received >= 1)
        finally:
            upstream.shutdown()
            upstream.server_close()
        record("upstream_down", requests_while_down=300, bodies_failed=failed,
               rss_growth_mib=round(grown, 1), resumed_bodies=upstream.received)
        assert grown < 30, f"RSS grew {grown:.1f} MiB while the upstream was down"
