"""How long the sidecar itself takes to answer each HTTP request, per route.

A client's latency adds its own waits (its process, the network, a busy node's run queue) to
the sidecar's; this histogram is the sidecar's part alone, from the request reaching the app
to the last byte of its answer handed to the server, so an operator (and ``bench/fleet.py``)
can tell which of the two holds a slow tail. OpenTelemetry's HTTP semantic conventions name it
and its attributes; the route is the template (``/v1/changes/{change_id}``), never the path,
so a series per change id cannot grow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from typing import Any

from opentelemetry.metrics import Histogram, Meter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from collectors.names import (
    ATTR_HTTP_REQUEST_METHOD,
    ATTR_HTTP_RESPONSE_STATUS_CODE,
    ATTR_HTTP_ROUTE,
    HTTP_SERVER_REQUEST_DURATION,
)

BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            10.0, 30.0)
"""Bucket bounds: the semantic conventions' own, with 1 ms and 2.5 ms below them (most answers
from memory take less than 5 ms) and 30 s above (a lease's long poll)."""


def request_duration_histogram(meter: Meter) -> Histogram:
    return meter.create_histogram(
        HTTP_SERVER_REQUEST_DURATION, unit="s",
        description="Time the sidecar took to answer an HTTP request, per route",
        explicit_bucket_boundaries_advisory=list(BOUNDS_S))


class RequestDuration:
    """ASGI middleware recording each HTTP request's duration into the histogram ``histogram()``
    returns (None: not yet, before the sidecar's telemetry starts)."""

    def __init__(self, app: ASGIApp, histogram: Callable[[], Histogram | None]) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]  # an exception before the answer started is the server's 500

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            histogram = self.histogram()
            if histogram is not None:
                histogram.record(time.perf_counter() - started, _attributes(scope, status[0]))


def _attributes(scope: MutableMapping[str, Any], status: int) -> dict[str, str | int]:
    route = scope.get("route")  # set by the router on a match
    return {ATTR_HTTP_REQUEST_METHOD: str(scope.get("method", "")),
            ATTR_HTTP_ROUTE: str(getattr(route, "path", None) or "(unmatched)"),
            ATTR_HTTP_RESPONSE_STATUS_CODE: status}
