"""The OTLP ingest endpoints served straight from the ASGI scope, before the web framework.

Every OTLP export is one small POST, hundreds a second from a job's ranks. On that path
FastAPI's stack (its error, telemetry and body-limit middleware, the exception middleware,
route matching across every router, the request-response wrapper and dependency solving) cost
more of the interpreter than the decode and the store together: about half the GIL time of a
sidecar ingesting at 8 exporters (py-spy ``--gil``, `bench/otlp_ingest.py`). The endpoints take
only the Request and answer every error themselves, so nothing of that stack is theirs to
need; the rest of the API still goes through it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class DirectRoutes:
    """ASGI middleware: a POST to one of ``router``'s POST routes goes straight to its
    endpoint (which must take the Request alone and return a Response); everything else goes
    on to ``app``. The route is put in the scope as the router would, so the request-duration
    histogram around this still names it."""

    def __init__(self, app: ASGIApp, router: APIRouter) -> None:
        self.app = app
        self._routes: dict[str, tuple[APIRoute, Endpoint]] = {
            route.path: (route, route.endpoint) for route in router.routes
            if isinstance(route, APIRoute) and "POST" in (route.methods or ())}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            found = self._routes.get(scope["path"])
            if found is not None:
                route, endpoint = found
                scope["route"] = route
                scope["endpoint"] = endpoint
                response = await endpoint(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
