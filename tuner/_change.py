"""What a change is: its states and legal moves, the change record and a rollback's cause.

A change takes a job from config A to config B (``tuner._rollout`` drives it through its
states); these values are what the journal stores and every reader (API, report, search) sees.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from collectors import SeedanceError
from tuner._knobs import KnobValue
from tuner._windows import Window, windows_from_json

State = Literal["proposed", "approved", "applying", "observing", "kept", "rolled_back",
                "rejected", "expired", "failed", "manual_intervention_required"]
Source = Literal["trial", "finding", "operator"]
Mode = Literal["auto", "suggest", "off"]
MANUAL: State = "manual_intervention_required"
RollbackKind = Literal["config", "full", "local"]
RollbackCause = Literal["guardrail", "verdict", "pruned", "job_failed", "timeout", "operator",
                        "stopped", "recovery"]
"""What forced a rollback, in a few words a dashboard can count (the reason says the rest)."""

TRANSITIONS: Mapping[str, frozenset[str]] = {
    "proposed": frozenset({"approved", "rejected", "expired", "failed"}),
    "approved": frozenset({"applying", "rejected", "failed"}),
    "applying": frozenset({"observing", "rolled_back", "failed"}),
    "observing": frozenset({"kept", "rolled_back", "failed"}),
    "kept": frozenset({"rolled_back"}),
    "rolled_back": frozenset({MANUAL}), MANUAL: frozenset({"rolled_back"}),
    "rejected": frozenset(), "expired": frozenset(), "failed": frozenset(),
}
"""Legal transitions; ``kept -> rolled_back`` only by an operator's ``rollback``;
``rolled_back <-> manual_intervention_required`` only as its restore fails or is confirmed."""
ENDED: frozenset[str] = frozenset({"rolled_back", "rejected", "expired", "failed"})
"""The verdicts of a change that was tried or refused (the search learns from them)."""
ACTIVE: frozenset[str] = frozenset({"proposed", "approved", "applying", "observing"})
IN_FLIGHT: frozenset[str] = frozenset({"applying", "observing"})
PRECISION_ORDER = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""Higher index = lower precision; lowering one is a risky change (snapshot first)."""
PRUNED = "pruned by the search"
STOPPED = "the sidecar stopped"
"""Why a change in flight ends when its sidecar shuts down: the job's lease lapses to the
baseline anyway, and no sidecar of a fleet would ever finish the change otherwise."""


class RolloutError(SeedanceError):
    """A change cannot be proposed or moved as asked."""


class IllegalTransition(RolloutError):
    """The state machine does not allow this move."""



@dataclass(frozen=True, kw_only=True)
class Change:
    """Config A -> B for one job; ``values`` are the knobs it sets, ``baseline`` what it left.

    ``plan`` is the observation's progress (window arms, index, version in force, acked);
    ``windows`` what each window measured; ``comparison`` the verdict's numbers.
    ``traceparent`` is the W3C context of the change's root span; ``spans`` the spans open
    across ticks (``apply``, ``observe``): name -> traceparent, start_ns and attributes.
    """

    id: str
    job: str
    state: State
    source: Source
    reason: str
    risk: str
    scope: str
    values: Mapping[str, KnobValue]
    baseline: Mapping[str, KnobValue]
    created_at_s: float
    expires_at_s: float
    approved_by: str | None = None
    traceparent: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)
    spans: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    plan: Mapping[str, Any] = field(default_factory=dict)
    windows: tuple[Window, ...] = ()
    comparison: Mapping[str, Any] | None = None

    @property
    def candidate(self) -> dict[str, KnobValue]:
        return {**self.baseline, **self.values}

    @property
    def continued_ratios(self) -> tuple[float, ...]:
        """The pair ratios of the earlier, undecided trial this change continues (its meta's
        ``continues``: that change's baseline, candidate and ratios), when it measured this
        very candidate against this very baseline; () otherwise, so a baseline kept since
        never mixes pairs of two questions."""
        earlier = self.meta.get("continues")
        if not earlier or not all(_same(a, b) for a, b in (
                (earlier.get("baseline"), self.baseline),
                (earlier.get("candidate"), self.candidate))):
            return ()
        return tuple(float(r) for r in earlier.get("pair_ratios", ()))

    def arm_of(self, version: int) -> str | None:
        """Which arm config ``version`` ran as in this change (None: not one of its windows)."""
        if self.plan.get("version") == version:
            return str(self.plan["arms"][int(self.plan["index"])])
        return next((w.arm for w in self.windows if w.version == version), None)

    def json_body(self) -> dict[str, Any]:
        """The object ``to_json`` encodes (mappings of any kind inside, encoded as dicts)."""
        body = {k: v for k, v in self.__dict__.items() if k != "windows"}
        body["windows"] = [w.to_json() for w in self.windows]
        return body

    def to_json(self) -> str:
        return json.dumps(self.json_body(), sort_keys=True, default=dict)

    @classmethod
    def from_json(cls, text: str) -> Change:
        body = json.loads(text)
        body["windows"] = tuple(windows_from_json(body.get("windows", ())))
        return cls(**body)


def _same(a: Any, b: Any) -> bool:
    """Two configs are equal as the journal stores them (JSON)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@dataclass(frozen=True)
class ChangeCursor:
    """Where a page of changes ended: the last change's place in the journal's order."""

    created_at_ns: int
    id: str

    def to_text(self) -> str:
        return f"{self.created_at_ns}-{self.id}"

    @classmethod
    def parse(cls, text: str) -> ChangeCursor:
        """A cursor from :meth:`to_text`; ``RolloutError`` naming what is wrong otherwise."""
        at, _, change_id = text.partition("-")
        if not at.isdigit() or not change_id:
            raise RolloutError(f"after={text!r} is not a cursor: use the one in the previous "
                               "page's Link header")
        return cls(int(at), change_id)


@dataclass(frozen=True, kw_only=True)
class Trip:
    """A guardrail fired: roll back now, of this kind (``group`` for a local rollback)."""

    kind: RollbackKind
    reason: str
    group: str | None = None
    job_failed: bool = False
    """The job itself reported the config failing (it raised there): never to be tried again."""
    inconclusive: bool = False
    """The test ran out of pairs or time without an answer: the config may still pay."""



def precision_lowered(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Precision knobs (``precision`` or ``precision.<group>``) whose value gets lower."""
    def rank(v: Any) -> int:
        return PRECISION_ORDER.index(v) if v in PRECISION_ORDER else -1
    return sorted(k for k, v in after.items()
                  if (k == "precision" or k.startswith("precision."))
                  and rank(v) > rank(before.get(k)))


