"""What a live tuning session measured: its trials as the rollout controller judged them, and
the session's result (the kept config re-measured against the first baseline).

Read from the operator API's change JSON; nothing here judges anything again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from seedancectl._api_types import ChangeJSON


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One live trial as the controller judged it: the candidate's knobs against the baseline
    in force then; tokens/s are the means of its candidate and baseline windows."""

    change_id: str
    trial: int | None
    state: str
    values: dict[str, Any]
    baseline: dict[str, Any]
    candidate_tokens_per_s: float
    baseline_tokens_per_s: float
    gain: float
    ci_low: float
    ci_high: float
    windows: int
    ended_because: str | None
    origin: str = ""
    """Why the search proposed it (``tuner.Proposal.origin``): "again: ...", "revisit: ..."."""

    @classmethod
    def from_change(cls, change: Mapping[str, Any]) -> Trial:
        """The trial a change of the search (or the re-measurement) was; NaN where unmeasured."""
        comparison = change.get("comparison") or {}
        windows = change.get("windows") or []

        def mean(arm: str) -> float:
            values = [float(w["tokens_per_s"]) for w in windows if w["arm"] == arm]
            return sum(values) / len(values) if values else math.nan

        return cls(change_id=change["id"], trial=(change.get("meta") or {}).get("trial"),
                   state=change["state"], values={**change["baseline"], **change["values"]},
                   baseline=dict(change["baseline"]),
                   candidate_tokens_per_s=mean("candidate"),
                   baseline_tokens_per_s=mean("baseline"),
                   gain=_float(comparison.get("gain")),
                   ci_low=_float(comparison.get("ci_low")),
                   ci_high=_float(comparison.get("ci_high")), windows=len(windows),
                   ended_because=(change.get("plan") or {}).get("ended_because"),
                   origin=str((change.get("meta") or {}).get("origin") or ""))

    @property
    def measured(self) -> bool:
        """Judged on at least one candidate/baseline pair (not failed before measuring)."""
        return (self.state in ("kept", "rolled_back") and math.isfinite(self.gain)
                and math.isfinite(self.candidate_tokens_per_s))


@dataclass(frozen=True, kw_only=True)
class SessionResult:
    """What a session did. ``baseline``: the job's config when tuning began; ``kept``: its
    baseline when tuning stopped. ``remeasure``: the controller's interleaved comparison of the
    first baseline (candidate arm) against the kept config (baseline arm), None when nothing
    was kept (the two are the same config)."""

    baseline: dict[str, Any]
    kept: dict[str, Any]
    trials: list[Trial]
    changes: list[ChangeJSON]
    remeasure: Trial | None
    wall_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def kept_tokens_per_s(self) -> float:
        """The kept config's tokens/s in the re-measurement (NaN when nothing was kept)."""
        return self.remeasure.baseline_tokens_per_s if self.remeasure else math.nan

    @property
    def baseline_tokens_per_s(self) -> float:
        """The first baseline's tokens/s in the re-measurement (NaN when nothing was kept)."""
        return self.remeasure.candidate_tokens_per_s if self.remeasure else math.nan

    def to_json(self) -> dict[str, Any]:
        """The result as strict JSON (non-finite numbers become null); the changes are left out."""
        def trial(t: Trial | None) -> dict[str, Any] | None:
            return None if t is None else {k: _json_float(v) for k, v in t.__dict__.items()}
        return {"baseline": self.baseline, "kept": self.kept,
                "trials": [trial(t) for t in self.trials], "remeasure": trial(self.remeasure),
                "kept_tokens_per_s": _json_float(self.kept_tokens_per_s),
                "baseline_tokens_per_s": _json_float(self.baseline_tokens_per_s),
                "wall_s": round(self.wall_s, 1), "notes": self.notes}


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _json_float(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


__all__ = ["SessionResult", "Trial"]
