"""The on-call page: pending changes with their evidence, approve / reject, findings, history;
and the fleet page (``fleet.html``): every job of the sidecars sharing the state database.

Static pages (HTML, ES modules, CSS; no CDN, no build step) that call the sidecar's JSON
API from the browser. The router serves them under ``/ui/`` and adds the one endpoint the
on-call page needs that the API does not hold: ``GET /v1/changes/{id}/series``, the
triggering metric's points for the evidence plot. It reads the sidecar's reader (its store or
Prometheus) and the rollout controller through whatever object it is handed (the Sidecar), so
it never imports the application shell. The fleet page reads ``GET /v1/fleet`` and decides
through ``/v1/fleet/changes/{id}/...``, which the application shell serves (they call other
sidecars).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources
from typing import Any, Protocol

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import RedirectResponse, Response

from collectors import StoreReader
from dashboards.web._series import LOOKBACK_S, MAX_POINTS, change_series, triggering_metric
from tuner import RolloutController, RolloutError

STATIC: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "fleet.html": "text/html; charset=utf-8",
    "fleet.js": "text/javascript; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
"""The page's files (package data next to this module) and their media types."""
HEADERS = {
    # Scripts and styles only from the sidecar itself; nothing inline, nothing fetched elsewhere.
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; "
                                "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class SidecarParts(Protocol):
    """What the page's router reads: the Sidecar satisfies it (both None until started)."""

    @property
    def reader(self) -> StoreReader | None:
        """Where a change's series are read from (the store or Prometheus)."""

    @property
    def controller(self) -> RolloutController | None:
        """Where a change is looked up by id."""


def web_router(sidecar: SidecarParts, *, clock: Callable[[], float] = time.time) -> APIRouter:
    """``GET /`` (redirect), ``GET /ui/`` and its files, ``GET /v1/changes/{id}/series``."""
    router = APIRouter(tags=["web"])

    @router.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/", status_code=307)

    @router.get("/ui/", include_in_schema=False)
    def index() -> Response:
        return _static("index.html")

    @router.get("/ui/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in STATIC:
            raise HTTPException(status_code=404, detail=f"no page file {name!r}")
        return _static(name)

    @router.get("/v1/changes/{change_id}/series")
    def series(change_id: str,
               lookback_s: float = Query(default=LOOKBACK_S, gt=0, le=7 * 86400),
               max_points: int = Query(default=MAX_POINTS, ge=2, le=2000)) -> dict[str, Any]:
        """The triggering metric of the change around its life (see dashboards/web/README.md)."""
        reader, controller = sidecar.reader, sidecar.controller
        if reader is None or controller is None:
            raise HTTPException(status_code=503, detail="the sidecar is not started")
        try:
            change = controller.get(change_id)
        except RolloutError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        return change_series(change, reader, now_s=clock(), lookback_s=lookback_s,
                             max_points=max_points)

    return router


def _static(name: str) -> Response:
    body = resources.files(__package__).joinpath(name).read_bytes()
    return Response(body, media_type=STATIC[name], headers=HEADERS)


__all__ = ["SidecarParts", "change_series", "triggering_metric", "web_router"]
