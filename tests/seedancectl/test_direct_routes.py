"""The OTLP ingest endpoints are served before the web framework, and answer as they did."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.testclient import TestClient
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from starlette.types import ASGIApp, Receive, Scope, Send

from policies._state_db import sqlite_url
from seedancectl._config import SidecarConfig
from seedancectl._direct_routes import DirectRoutes
from seedancectl._sidecar import Sidecar


class _Seen:
    """ASGI middleware noting each request that went through the app, and the route the scope
    named once answered."""

    def __init__(self, app: ASGIApp, seen: list[str]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append(f'{scope["method"]} {scope["path"]}')
        await self.app(scope, receive, send)


def _wrapped() -> tuple[TestClient, list[str], list[str]]:
    """An app with a POST and a GET on /ingest (the POST in the direct router), a POST on
    /other; returns the client, what went through the app, and the routes the scope named."""
    seen: list[str] = []
    routes: list[str] = []
    router = APIRouter()

    @router.post("/ingest")
    async def ingest(request: Request) -> Response:
        return Response(b"took " + await request.body(), status_code=202)

    app = FastAPI()
    app.include_router(router)
    app.add_middleware(_Seen, seen=seen)

    @app.get("/ingest")
    def read() -> dict[str, str]:
        return {"read": "yes"}

    @app.post("/other")
    def other() -> dict[str, str]:
        return {"other": "yes"}

    direct = DirectRoutes(app, router)

    async def outer(scope: Scope, receive: Receive, send: Send) -> None:
        await direct(scope, receive, send)
        if scope["type"] == "http":
            route = scope.get("route")
            routes.append(getattr(route, "path", "(none)"))

    return TestClient(outer), seen, routes


def test_a_post_to_a_direct_route_skips_the_app_and_the_scope_names_its_route() -> None:
    client, seen, routes = _wrapped()
    r = client.post("/ingest", content=b"points")
    assert (r.status_code, r.content) == (202, b"took points")
    assert seen == []  # the app's middleware never ran
    assert routes == ["/ingest"]  # so a duration histogram around it still names the route


def test_every_other_request_goes_through_the_app() -> None:
    client, seen, routes = _wrapped()
    assert client.get("/ingest").json() == {"read": "yes"}
    assert client.post("/other").json() == {"other": "yes"}
    assert client.put("/ingest").status_code == 405
    assert client.post("/ingest/", follow_redirects=False).status_code == 307
    assert seen == ["GET /ingest", "POST /other", "PUT /ingest", "POST /ingest/"]
    assert routes[:2] == ["/ingest", "/other"]


def test_the_sidecar_answers_otlp_on_the_direct_path_as_the_receiver_does(
        tmp_path: Path) -> None:
    """Errors in the request's encoding, points reaching the store, other methods refused."""
    config = SidecarConfig(job="direct", store=tmp_path / "m.db", nvml="off",
                           state_db=sqlite_url(tmp_path / "s.db"))
    export = ExportMetricsServiceRequest()
    rm = export.resource_metrics.add()
    rm.resource.attributes.add(key="service.name").value.string_value = "direct-job"
    gauge = rm.scope_metrics.add().metrics.add(name="direct.gauge", unit="1").gauge
    # now: a point older than the store's raw retention (2 days) is gone after its first prune
    gauge.data_points.add(time_unix_nano=time.time_ns(), as_double=2.5)
    sidecar = Sidecar(config, environ={})
    with TestClient(sidecar.app()) as client:
        r = client.post("/v1/metrics", content=export.SerializeToString(),
                        headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200, r.content
        r = client.post("/v1/metrics", content=b"{", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
        assert "Content-Type must be" in Status.FromString(r.content).message
        r = client.post("/v1/metrics", content=b"\xff\xff",
                        headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 400 and Status.FromString(r.content).message
        assert client.get("/v1/metrics").status_code == 405
        assert sidecar.stats.points_accepted == 1
        assert sidecar.store is not None
        sidecar.store.flush()
        assert sidecar.store.query("direct.gauge")["value"].tolist() == [2.5]
