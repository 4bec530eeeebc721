"""Confirming a rollback: it is done when the job acks its baseline (and ran the rollback
action, when there is one), not when the sidecar sent it.

A restore the job cannot carry out (its baseline fails to apply, the model-state rollback
raises, no ack comes) is sent again, up to ``RolloutConfig.restore_attempts`` times; then the
change waits for a person in ``manual_intervention_required``, as a job that cannot return to
its baseline may be running a config or model state nobody checked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tuner._lease_messages import Ack

RESTORE_KEY = "restore"
"""Where a rollback's restore lives in ``Change.plan``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Restore:
    """One rollback's restore: what was sent, as which version, and how it went so far."""

    version: int
    """The config version that carries the baseline (and the action): its ack confirms."""
    values: Mapping[str, Any]
    action: Mapping[str, Any] | None
    attempt: int
    sent_at_s: float
    problem: str | None = None
    """Why the last attempt failed (None while it may still succeed)."""
    confirmed: bool = False

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))  # type: ignore[no-any-return]

    @classmethod
    def from_plan(cls, plan: Mapping[str, Any]) -> Restore | None:
        data = plan.get(RESTORE_KEY)
        return None if data is None else cls(**data)


def restore_outcome(restore: Restore, acks: Sequence[Ack], *, now_s: float,
                    ack_timeout_s: float) -> str | None:
    """``"confirmed"``, ``None`` while the ack may still come, else why the attempt failed."""
    ack = next((a for a in acks if a.version >= restore.version), None)
    if ack is None:
        if now_s - restore.sent_at_s <= ack_timeout_s:
            return None
        return f"no ack of the baseline v{restore.version} within {ack_timeout_s:g} s"
    if ack.status != "applied":
        return f"the job failed to apply its baseline v{ack.version}: {ack.error}"
    if restore.action is None:
        return "confirmed"
    ran = next((a for a in ack.actions if a.get("kind") == restore.action.get("kind")
                and a.get("change_id") == restore.action.get("change_id")), None)
    if ran is None:
        return f"v{ack.version} was applied without the {_action_text(restore.action)}"
    if ran.get("status") != "done":
        return f"the job's {_action_text(restore.action)} failed: {ran.get('error')}"
    return "confirmed"


def _action_text(action: Mapping[str, Any]) -> str:
    scope = action.get("scope", "full")
    group = f" of group {action['group']}" if scope == "local" and action.get("group") else ""
    return f"{scope} model-state rollback{group}"
