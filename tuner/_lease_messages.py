"""What the two ends of the knob lease tell each other (docs/lease-protocol.md), and its errors.

The job's ack (`Ack`) and lease answer (`Lease`), the one-shot actions it may be asked to run
(`validate_action`), a job's status (`JobStatus`, also what `GET /v1/jobs` shows) and what an
attach did (`AttachEvent`, for the audit log). Plain data, made by the registry
(`tuner._lease`) and served by the HTTP router (`tuner._lease_http`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from collectors import JobFingerprint, SeedanceError
from tuner._knobs import Config, KnobSpace

JobKind = Literal["train", "serve"]
JobState = Literal["attached", "lapsed"]
AckStatus = Literal["applied", "failed"]
AttachOutcome = Literal["new", "resumed", "merged"]
ACTION_KINDS = ("snapshot", "rollback")
ROLLBACK_SCOPES = ("full", "local")


class LeaseError(SeedanceError):
    """A lease call cannot be served as asked."""


class UnknownJobError(LeaseError):
    """No job of that name is attached (HTTP 404): the client re-attaches."""


class SessionError(LeaseError):
    """The session is not the job's current one, or its lease lapsed (HTTP 409)."""


class JobClaimedError(SessionError):
    """Another live sidecar of the fleet holds the job (HTTP 409): the job tries again later,
    and gets it once that sidecar's heartbeat is stale (``tuner._fleet``)."""


class InvalidRequestError(LeaseError):
    """A well-formed request with values the registry refuses (HTTP 422)."""


@dataclass(frozen=True, kw_only=True)
class Ack:
    """What the job reported after a step boundary: `version` took effect (or failed) at `step`.

    `actions` echoes each one-shot action it ran, with `"status"` ("done" | "failed") and
    `"error"`. `time_s` is the sidecar's wall clock when the ack arrived.
    """

    job: str
    session: str
    version: int
    step: int
    status: AckStatus
    error: str | None = None
    actions: tuple[Mapping[str, Any], ...] = ()
    time_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The ack as JSON (the registry's record of it)."""
        return {"job": self.job, "session": self.session, "version": self.version,
                "step": self.step, "status": self.status, "error": self.error,
                "actions": [dict(a) for a in self.actions], "time_s": self.time_s}


@dataclass(frozen=True, kw_only=True)
class Lease:
    """One lease answer: the config to run, the baseline to fall back to, pending actions."""

    config: Config
    baseline: Config
    change_id: str | None
    traceparent: str | None
    lease_ttl_s: float
    actions: tuple[Mapping[str, Any], ...]

    def to_json(self) -> dict[str, Any]:
        """The lease call's answer body."""
        return {"config": self.config.to_json(), "baseline": self.baseline.to_json(),
                "change_id": self.change_id, "traceparent": self.traceparent,
                "lease_ttl_s": self.lease_ttl_s, "actions": [dict(a) for a in self.actions]}


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """A job as the registry sees it now.

    `acked_version` is the last version the job acked as applied (None before the first ack);
    `last_step` the step of its last ack. `expires_in_s` is negative once lapsed.
    `fingerprint` is what kind of job it is, as its client measured it (None: not sent).
    """

    job: str
    kind: JobKind
    world_size: int
    state: JobState
    session: str
    lease_ttl_s: float
    expires_in_s: float
    knobs: KnobSpace
    baseline: Config
    desired: Config
    change_id: str | None
    acked_version: int | None
    last_step: int | None
    fingerprint: JobFingerprint | None = None

    @property
    def desired_version(self) -> int:
        """The version of the config the job is asked to run."""
        return self.desired.version

    def to_json(self) -> dict[str, Any]:
        """The job as `GET /v1/jobs` shows it."""
        return {"job": self.job, "kind": self.kind, "world_size": self.world_size,
                "state": self.state, "lease_ttl_s": self.lease_ttl_s,
                "expires_in_s": round(self.expires_in_s, 3),
                "knobs": [k.to_json() for k in self.knobs.knobs.values()],
                "baseline": self.baseline.to_json(), "desired": self.desired.to_json(),
                "change_id": self.change_id, "acked_version": self.acked_version,
                "last_step": self.last_step,
                "fingerprint": (self.fingerprint.to_json() if self.fingerprint is not None
                                else None)}


@dataclass(frozen=True, kw_only=True)
class AttachEvent:
    """What an attach did to the job's baseline: ``new`` (the job's proposal, first attach),
    ``resumed`` (the stored baseline kept; ``ignored`` the proposed values that differ from it)
    or ``merged`` (the job declared other knobs: stored values kept where still valid)."""

    job: str
    session: str
    outcome: AttachOutcome
    baseline_version: int
    ignored: tuple[str, ...] = ()


def validate_action(action: Mapping[str, Any]) -> dict[str, Any]:
    """A one-shot action as the protocol allows it, or InvalidRequestError naming the field."""
    action = dict(action)
    kind = action.get("kind")
    if kind not in ACTION_KINDS:
        raise InvalidRequestError(f"action kind must be one of {ACTION_KINDS}, got {kind!r}")
    change_id = action.get("change_id")
    if change_id is not None and not isinstance(change_id, str):
        raise InvalidRequestError(f"action change_id must be a string, got {change_id!r}")
    allowed = {"kind", "change_id"}
    if kind == "rollback":
        allowed |= {"scope", "group"}
        scope = action.get("scope", "full")
        if scope not in ROLLBACK_SCOPES:
            raise InvalidRequestError(
                f"rollback scope must be one of {ROLLBACK_SCOPES}, got {scope!r}")
        action["scope"] = scope
        group = action.get("group")
        if scope == "local" and (not isinstance(group, str) or not group):
            raise InvalidRequestError("a local rollback needs a module group name in 'group'")
    extra = sorted(set(action) - allowed)
    if extra:
        raise InvalidRequestError(f"{kind} action has unknown field(s) {', '.join(extra)}")
    return action


__all__ = [
    "Ack", "AttachEvent", "InvalidRequestError", "JobClaimedError", "JobStatus", "Lease", "LeaseError",
    "SessionError", "UnknownJobError", "validate_action",
]
