"""One client for the sidecar's HTTP API, shared by the CLI, the tuning session and the demo.

Every call either returns the body as its type (``seedancectl._api_types``) or raises
``SidecarError`` whose message is one line fit to show a person as it is: no answer at the
URL, or the HTTP status with the server's ``detail``. Reads go without credentials (the API
leaves them open); calls that change something carry the bearer token when the client has one,
and without one the sidecar's own 401 is the error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from collectors import ConfigError, SeedanceError
from seedancectl._api_types import (
    AckJSON,
    ChangeDetailJSON,
    ChangeJSON,
    EventJSON,
    FindingJSON,
    KnobsJSON,
    LeaseJobJSON,
    ReadinessJSON,
    StatusJSON,
    TuningJSON,
)
from tuner import KnobValue

DEFAULT_TIMEOUT_S = 30.0


class SidecarError(SeedanceError):
    """A call to the sidecar failed; the message is the one-line reason.

    ``status`` is the HTTP status of the sidecar's answer, None when none came (refused,
    timed out, not an HTTP URL): a caller that waits for a sidecar to come up retries those
    and lets the others through.
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SidecarClient:
    """The sidecar's operator API at ``url``: one method per route, typed answers.

    A context manager (or ``close()``) releases its connections. ``token`` is sent with the
    calls that change something; ``timeout_s`` bounds each call. A ``url`` that does not parse
    is a ``ConfigError`` here, before any call.
    """

    def __init__(self, url: str, *, token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            scheme = httpx.URL(url).scheme
        except httpx.InvalidURL as exc:
            raise ConfigError(f"{url!r}: {exc}") from None
        if scheme not in ("http", "https"):
            raise ConfigError(f"{url!r}: expected http(s)://HOST:PORT, e.g. "
                              f"http://{url.partition('://')[2] or url}")
        self.url = url
        self._token = token
        self._http = httpx.Client(timeout=timeout_s)

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Release the connections (idempotent)."""
        self._http.close()

    # ---- reads -------------------------------------------------------------------------------

    def readiness(self) -> ReadinessJSON:
        """``/readyz``: answered with 200 when ready and 503 with the reasons when not."""
        return self._call("GET", "/readyz", ok=(200, 503))

    def status(self) -> StatusJSON:
        """Jobs, their versions and modes, open findings and changes counted."""
        return self._call("GET", "/v1/status")

    def jobs(self) -> list[LeaseJobJSON]:
        """Every job the lease registry knows, attached or lapsed."""
        return self._call("GET", "/v1/jobs")

    def knobs(self, job: str) -> KnobsJSON:
        """The job's knobs, baseline and desired configs, mode and search state."""
        return self._call("GET", f"/v1/jobs/{job}/knobs")

    def acks(self, job: str) -> list[AckJSON]:
        """What the job reported at each step boundary, oldest first."""
        return self._call("GET", f"/v1/jobs/{job}/acks")

    def findings(self, *, job: str | None = None,
                 include_closed: bool = False) -> list[FindingJSON]:
        """Open findings (with ``include_closed``, every finding ever opened)."""
        params: dict[str, Any] = {"job": job, "all": True if include_closed else None}
        return self._call("GET", "/v1/findings", params=params)

    def changes(self, *, job: str | None = None, states: Sequence[str] | None = None,
                page: int | None = None) -> list[ChangeJSON]:
        """Changes, oldest first, of one job and in the given states when asked: every page
        (of ``page`` changes; the sidecar's default when None)."""
        params: dict[str, Any] = {"job": job, "state": list(states) if states else None,
                                  "limit": page}
        return self._pages("/v1/changes", params)

    def change(self, change_id: str) -> ChangeDetailJSON:
        """One change with its audit trail."""
        return self._call("GET", f"/v1/changes/{change_id}")

    def audit(self, *, job: str | None = None,
              change_id: str | None = None) -> list[EventJSON]:
        """The audit log, oldest first."""
        return self._call("GET", "/v1/audit", params={"job": job, "change": change_id})

    # ---- writes (bearer token) ---------------------------------------------------------------

    def propose(self, job: str, values: Mapping[str, KnobValue], *, by: str,
                reason: str) -> ChangeJSON:
        """An operator's change; it waits for approval unless the job's mode approves it."""
        return self._call("POST", f"/v1/jobs/{job}/changes",
                          body={"values": dict(values), "by": by, "reason": reason})

    def approve(self, change_id: str, *, by: str, comment: str = "") -> ChangeJSON:
        """Approve a proposed change; the controller applies and measures it."""
        return self._call("POST", f"/v1/changes/{change_id}/approve",
                          body={"by": by, "comment": comment})

    def reject(self, change_id: str, *, by: str, reason: str) -> ChangeJSON:
        """Reject a change that is not yet applied."""
        return self._call("POST", f"/v1/changes/{change_id}/reject",
                          body={"by": by, "reason": reason})

    def rollback(self, job: str, *, by: str, reason: str,
                 change_id: str | None = None) -> ChangeJSON:
        """Roll back the job's change in flight, else its last kept one; with ``change_id``,
        only that change and only while it is in flight (HTTP 409 otherwise)."""
        body: dict[str, Any] = {"by": by, "reason": reason}
        if change_id is not None:
            body["change"] = change_id
        return self._call("POST", f"/v1/jobs/{job}/rollback", body=body)

    def set_tuning(self, job: str, action: str, *, by: str) -> TuningJSON:
        """``pause`` or ``resume`` the job's search."""
        return self._call("POST", f"/v1/jobs/{job}/tuning", body={"action": action, "by": by})

    # ---- the one way a call is made ----------------------------------------------------------

    def _pages(self, path: str, params: Mapping[str, Any]) -> Any:
        """Every page of a listing, followed by its ``Link: rel="next"`` headers."""
        found: list[Any] = []
        url: str | None = path
        while url is not None:
            reply = self._send("GET", url, params=params if url == path else None)
            found += self._json(reply)
            url = reply.links.get("next", {}).get("url")
        return found

    def _call(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
              body: Mapping[str, Any] | None = None, ok: Sequence[int] = ()) -> Any:
        """The answer's JSON; SidecarError for no answer or a status neither 2xx nor ``ok``."""
        return self._json(self._send(method, path, params=params, body=body), ok=ok)

    def _send(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
              body: Mapping[str, Any] | None = None) -> httpx.Response:
        """The reply to one request; SidecarError when no sidecar answers."""
        headers = ({"Authorization": f"Bearer {self._token}"}
                   if method != "GET" and self._token is not None else {})
        url = self.url.rstrip("/") + path
        try:
            reply = self._http.request(
                method, url, headers=headers, json=None if body is None else dict(body),
                params=None if params is None else {k: v for k, v in params.items()
                                                     if v is not None})
        except httpx.InvalidURL as exc:
            raise SidecarError(f"{url!r}: {exc}") from None
        except httpx.HTTPError as exc:
            raise SidecarError(f"no sidecar answers at {self.url} ({type(exc).__name__}: "
                               f"{exc}); is `seedancectl sidecar` running?") from None
        return reply

    def _json(self, reply: httpx.Response, *, ok: Sequence[int] = ()) -> Any:
        """The reply's JSON; SidecarError for a status neither 2xx nor ``ok``."""
        if reply.is_success or reply.status_code in ok:
            try:
                return reply.json()
            except ValueError:
                raise SidecarError(f"sidecar {self.url}: HTTP {reply.status_code}: the answer "
                                   f"is not JSON", status=reply.status_code) from None
        raise SidecarError(f"sidecar {self.url}: HTTP {reply.status_code}: {_detail(reply)}",
                           status=reply.status_code)


def _detail(reply: httpx.Response) -> str:
    """The server's one-line ``detail``; a validation error names its first field."""
    try:
        body = reply.json()
    except ValueError:
        return reply.text.strip()[:200]
    detail = body.get("detail") if isinstance(body, dict) else body
    if isinstance(detail, list) and detail:
        first = detail[0]
        return f"{'.'.join(str(p) for p in first.get('loc', ())[1:])}: {first.get('msg')}"
    return str(detail)


__all__ = ["SidecarClient", "SidecarError"]
