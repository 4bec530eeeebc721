"""The sidecar's operator API: status, findings, changes, approvals, rollbacks, audit.

Served on the sidecar's loopback listener next to the OTLP receiver and the knob lease. Reads
are open to whoever can reach it; every call that changes something needs the bearer token
(401 without one, 403 with a wrong one). The token is checked before the handler runs, so a
refused call changes nothing and leaves no event in the audit log. Errors are
``{"detail": "one line"}``: 404 unknown change, finding or job; 409 a move the state machine
does not allow; 422 values outside the job's knob space or a malformed body; 503 not started.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from collectors import SeedanceError
from seedancectl._config import SidecarConfig
from tuner import (
    ACTIVE,
    TOKEN_ENV,
    Change,
    ChangeCursor,
    Credentials,
    IllegalTransition,
    KnobError,
    KnobValue,
    RolloutController,
    RolloutError,
    UnknownJobError,
    read_token,
)

if TYPE_CHECKING:
    from seedancectl._job_searches import JobSearches
    from seedancectl._sidecar import Sidecar

log = logging.getLogger(__name__)

TOKEN_FILE_NAME = "token"
PAGE = 100
"""Changes in a page of ``GET /v1/changes`` unless ``limit`` says otherwise (at most
``MAX_PAGE``): a fleet's shared journal only grows, so one answer cannot hold all of it, and
each change costs the endpoint about 0.15 ms to decode and encode (bench/changes_page.py)."""
MAX_PAGE = 1000


def resolve_token(config: SidecarConfig, environ: Mapping[str, str]) -> tuple[str, Path | None]:
    """The API token and the file it came from: ``token_file``, else $SEEDANCE_TOKEN, else
    ``<state dir>/token``, generated (mode 0600) on the first start."""
    if config.token_file is not None:
        return read_token(config.token_file), config.token_file
    if environ.get(TOKEN_ENV):
        return environ[TOKEN_ENV].strip(), None
    path = config.state_dir / TOKEN_FILE_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32) + "\n", encoding="utf-8")
        log.warning("generated the API token into %s (mutating calls need it)", path)
    return read_token(path), path


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = Field(min_length=1, max_length=256)


class ApproveBody(_Body):
    comment: str = ""


class ReasonBody(_Body):
    reason: str = Field(min_length=1)


class RollbackBody(ReasonBody):
    change: str | None = Field(default=None, description=(
        "Roll back only this change, and only while it is in flight (409 otherwise)."))


class TuningBody(_Body):
    action: Literal["pause", "resume"]


class ProposeBody(ReasonBody):
    values: dict[str, KnobValue] = Field(min_length=1)



_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (UnknownJobError, 404), (KnobError, 422), (IllegalTransition, 409), (RolloutError, 409))


@contextmanager
def api_errors() -> Iterator[None]:
    """Project errors to one-line HTTP errors."""
    try:
        yield
    except SeedanceError as exc:
        code = next((c for t, c in _STATUS if isinstance(exc, t)), 409)
        raise HTTPException(status_code=code, detail=str(exc)) from None


def change_json(change: Change) -> dict[str, Any]:
    """A change as plain JSON values, as the API answers it. Through orjson, a third of the
    cost of json's round trip (a page of changes is the API's largest answer); NaN and
    infinities become null, as FastAPI renders them anyway. A value orjson cannot encode (an
    int past 64 bits) takes json's path."""
    try:
        return orjson.loads(orjson.dumps(  # type: ignore[no-any-return]
            change.json_body(), default=dict,
            option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS))
    except orjson.JSONEncodeError:
        return json.loads(change.to_json())  # type: ignore[no-any-return]


def bearer_token(credentials: Credentials) -> str:
    """The caller's bearer token; 401 without one."""
    if credentials is None or not credentials.credentials:
        raise HTTPException(401, "a bearer token is required (seedancectl --token-file)",
                            headers={"WWW-Authenticate": "Bearer"})
    return credentials.credentials


def check_token(sidecar: Sidecar, credentials: Credentials) -> None:
    """401 without a bearer token, 403 with one that is not ``sidecar``'s."""
    token = sidecar.token
    if token is None or not hmac.compare_digest(bearer_token(credentials).encode(),
                                                token.encode()):
        raise HTTPException(403, "the bearer token is not this sidecar's")


def api_router(sidecar: Sidecar) -> APIRouter:
    """Every endpoint of the operator API, bound to ``sidecar``'s parts."""
    def authorised(credentials: Credentials) -> None:
        check_token(sidecar, credentials)

    def searches() -> JobSearches:
        controller()
        assert sidecar.searches is not None  # set up with the controller
        return sidecar.searches

    def controller() -> RolloutController:
        if sidecar.controller is None or not sidecar.started:
            raise HTTPException(503, "the sidecar is starting or stopping")
        return sidecar.controller

    def get_change(change_id: str) -> Change:
        try:
            return controller().get(change_id)
        except RolloutError:
            raise HTTPException(404, f"no change {change_id!r}") from None

    read = APIRouter(prefix="/v1", tags=["operator"])
    write = APIRouter(prefix="/v1", tags=["operator"], dependencies=[Depends(authorised)])

    @read.get("/status")
    def status() -> dict[str, Any]:
        ctl = controller()
        attached = {s.job: s for s in sidecar.jobs.jobs()}
        open_changes = ctl.changes(states=sorted(ACTIVE))  # not the whole history
        active = {c.job: c for c in open_changes}
        jobs = []
        for job in sorted(set(attached) | set(sidecar.config.jobs)):
            s = attached.get(job)
            current = active.get(job)
            jobs.append({
                "job": job, "state": "not attached" if s is None else s.state,
                "kind": None if s is None else s.kind,
                "desired_version": None if s is None else s.desired.version,
                "baseline_version": None if s is None else s.baseline.version,
                "acked_version": None if s is None else s.acked_version,
                "last_step": None if s is None else s.last_step,
                "mode": ctl.mode(job), "tuning": searches().tuning_state(job),
                "change": None if current is None else {"id": current.id,
                                                        "state": current.state}})
        found = sidecar.engine.active() if sidecar.engine is not None else []
        return {
            "sidecar": {"job": sidecar.config.job, "listen": sidecar.config.listen,
                        "ready": sidecar.started, "store": str(sidecar.config.store),
                        "state_db": sidecar.config.state_db},
            "jobs": jobs,
            "findings": dict(collections.Counter(f.detector for f in found)),
            "changes": ctl.state_counts(),
            "waiting": [c.id for c in open_changes if c.state == "proposed"],
            "webhook": {"configured": sidecar.notifier.url is not None,
                        **sidecar.notifier.stats.to_json()},
        }

    @read.get("/findings")
    def findings(job: str | None = None, all: bool = False) -> list[dict[str, Any]]:
        if sidecar.engine is None:
            raise HTTPException(503, "the sidecar is starting or stopping")
        # active: the state DB's, and what the engine holds that it could not save
        engine = sidecar.engine
        active = {f.id: f for f in (*engine.findings.active(), *engine.active())}
        found = engine.findings.history(job=job) if all else [
            f for f in active.values() if job is None or f.job == job]
        return [f.to_dict() for f in found]

    @read.get("/findings/{finding_id}")
    def finding(finding_id: str) -> dict[str, Any]:
        if sidecar.engine is None:
            raise HTTPException(503, "the sidecar is starting or stopping")
        found = sidecar.engine.findings.get(finding_id)
        if found is None:
            raise HTTPException(404, f"no finding {finding_id!r}")
        return {**found.to_dict(), "rendered": found.render()}

    @read.get("/changes")
    def changes(request: Request, response: Response, job: str | None = None,
                state: Annotated[list[str] | None, Query()] = None,
                limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = PAGE,
                after: str | None = None) -> list[dict[str, Any]]:
        """One page, oldest first; a ``Link: <...>; rel="next"`` header names the next one."""
        try:
            cursor = None if after is None else ChangeCursor.parse(after)
        except RolloutError as exc:
            raise HTTPException(400, str(exc)) from None
        found, following = controller().changes_page(job=job, states=state, after=cursor,
                                                     limit=limit)
        if following is not None:
            url = request.url.include_query_params(after=following.to_text())
            response.headers["Link"] = f'<{url.path}?{url.query}>; rel="next"'
        return [change_json(c) for c in found]

    @read.get("/changes/{change_id}")
    def change(change_id: str) -> dict[str, Any]:
        found = get_change(change_id)
        return {**change_json(found), "events": controller().events(change_id=change_id)}

    @read.get("/audit")
    def audit(job: str | None = None, change: str | None = None) -> list[dict[str, Any]]:
        return controller().events(change_id=change, job=job)

    @read.get("/jobs/{job}/knobs")
    def knobs(job: str) -> dict[str, Any]:
        with api_errors():
            s = sidecar.jobs.status(job)
        return {"job": job, "knobs": [k.to_json() for k in s.knobs.knobs.values()],
                "baseline": s.baseline.to_json(), "desired": s.desired.to_json(),
                "acked_version": s.acked_version, "mode": controller().mode(job),
                "tuning": searches().tuning_state(job), "moves_left": searches().moves_left(job)}

    @read.get("/jobs/{job}/acks")
    def acks(job: str) -> list[dict[str, Any]]:
        """What the job reported at each boundary, one-shot actions (snapshot, rollback)
        with their outcome included: whether a rollback really ran in the job."""
        with api_errors():
            found = sidecar.jobs.acks(job)
        return [{"version": a.version, "step": a.step, "status": a.status, "error": a.error,
                 "actions": [dict(x) for x in a.actions], "time_s": a.time_s} for a in found]

    @write.post("/changes/{change_id}/approve")
    def approve(change_id: str, body: ApproveBody) -> dict[str, Any]:
        get_change(change_id)
        with api_errors():
            return change_json(controller().approve(change_id, body.by, body.comment))

    @write.post("/changes/{change_id}/reject")
    def reject(change_id: str, body: ReasonBody) -> dict[str, Any]:
        get_change(change_id)
        with api_errors():
            return change_json(controller().reject(change_id, body.by, body.reason))

    @write.post("/jobs/{job}/rollback")
    def rollback(job: str, body: RollbackBody) -> dict[str, Any]:
        with api_errors():
            return change_json(controller().rollback(job, body.by, body.reason,
                                                     change_id=body.change))

    @write.post("/jobs/{job}/tuning")
    def tuning(job: str, body: TuningBody) -> dict[str, Any]:
        with api_errors():
            return {"job": job, "tuning": searches().set_tuning(job, body.action, by=body.by)}

    @write.post("/jobs/{job}/changes", status_code=201)
    def propose(job: str, body: ProposeBody) -> dict[str, Any]:
        with api_errors():
            change = controller().propose(
                job, body.values, reason=body.reason, source="operator", by=body.by)
        sidecar.notify_waiting()  # now, before anyone can approve it unannounced
        return change_json(change)

    router = APIRouter()
    router.include_router(read)
    router.include_router(write)
    return router
