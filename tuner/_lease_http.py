"""The lease's HTTP endpoints (docs/lease-protocol.md): the job's client calls them.

Each endpoint checks the job's bearer token, hands the call to the `JobRegistry`
(`tuner._lease`) and maps its errors to HTTP statuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from collectors import FingerprintError, JobFingerprint, SeedanceError
from tuner._knobs import Knob, KnobError, KnobValue
from tuner._lease import JobRegistry
from tuner._lease_messages import (
    AckStatus,
    InvalidRequestError,
    JobKind,
    SessionError,
    UnknownJobError,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AttachBody(_Body):
    rank: int = 0
    world_size: int = 1
    kind: JobKind = "train"
    knobs: list[dict[str, Any]] = Field(default_factory=list)
    baseline: dict[str, KnobValue] = Field(default_factory=dict)
    lease_ttl_s: float | None = None
    version: int = 0
    fingerprint: dict[str, Any] | None = None
    """What kind of job it is (``collectors.JobFingerprint``); bounded by its ``from_json``."""


class AckBody(_Body):
    session: str
    version: int
    step: int
    status: AckStatus
    error: str | None = None
    actions: list[dict[str, Any]] = Field(default_factory=list)


_HTTP_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (UnknownJobError, 404), (SessionError, 409), (InvalidRequestError, 422), (KnobError, 422))


def _fingerprint(data: dict[str, Any] | None) -> JobFingerprint | None:
    try:
        return None if data is None else JobFingerprint.from_json(data)
    except FingerprintError as exc:
        raise InvalidRequestError(str(exc)) from None


def _http(exc: SeedanceError) -> HTTPException:
    code = next((c for t, c in _HTTP_STATUS if isinstance(exc, t)), 400)
    return HTTPException(status_code=code, detail=str(exc))


Credentials = Annotated[HTTPAuthorizationCredentials | None,
                        Depends(HTTPBearer(auto_error=False))]
"""The bearer token, if sent (module level: FastAPI resolves the annotation by name)."""
JobAuthoriser = Callable[[str, str], bool]
"""(job, bearer token) -> whether that token may hold the job's lease."""
NO_TOKEN = ("a job token is required: the client sends the token in $SEEDANCE_TOKEN, the file "
            "$SEEDANCE_TOKEN_FILE names, or seedance-data/token")


def lease_router(registry: JobRegistry, authorise: JobAuthoriser) -> APIRouter:
    """The three endpoints of docs/lease-protocol.md, plus `GET /v1/jobs` for people.

    Attach, lease and ack need a bearer token that ``authorise`` accepts for the job: 401
    without one, 403 with one it refuses. Other errors are `{"detail": "<one line>"}` with 404
    (unknown job), 409 (stale session or lapsed lease: re-attach) or 422 (values outside the
    knob space, bad action or body).
    """
    def job_token(job: str, credentials: Credentials) -> None:
        if credentials is None or not credentials.credentials:
            raise HTTPException(401, NO_TOKEN, headers={"WWW-Authenticate": "Bearer"})
        if not authorise(job, credentials.credentials):
            raise HTTPException(403, f"the bearer token may not hold the lease of job {job!r}")

    router = APIRouter(prefix="/v1/jobs", tags=["lease"])
    guarded = APIRouter(dependencies=[Depends(job_token)])  # under the prefix of router

    @guarded.post("/{job}/attach")
    def attach(job: str, body: AttachBody) -> dict[str, Any]:
        try:
            knobs = [Knob.from_json(k) for k in body.knobs]
            session, config = registry.attach(
                job, rank=body.rank, world_size=body.world_size, kind=body.kind, knobs=knobs,
                baseline=body.baseline, lease_ttl_s=body.lease_ttl_s, version=body.version,
                fingerprint=_fingerprint(body.fingerprint))
            status = registry.status(job)
        except SeedanceError as exc:
            raise _http(exc) from None
        return {"session": session, "lease_ttl_s": status.lease_ttl_s,
                "config": config.to_json(), "baseline": status.baseline.to_json()}

    @guarded.get("/{job}/lease")
    def lease(job: str, session: str, version: int,
              wait_s: float = Query(default=0.0, ge=0)) -> dict[str, Any]:
        try:
            return registry.lease(job, session, version, wait_s).to_json()
        except SeedanceError as exc:
            raise _http(exc) from None

    @guarded.post("/{job}/ack")
    def ack(job: str, body: AckBody) -> dict[str, bool]:
        try:
            registry.ack(job, body.session, version=body.version, step=body.step,
                         status=body.status, error=body.error, actions=body.actions)
        except SeedanceError as exc:
            raise _http(exc) from None
        return {"ok": True}

    @router.get("")
    def jobs() -> list[dict[str, Any]]:
        return [s.to_json() for s in registry.jobs()]

    router.include_router(guarded)
    return router


__all__ = ["Credentials", "JobAuthoriser", "lease_router"]
