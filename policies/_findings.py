"""Findings: a detector's verdict with the evidence behind it and the changes it suggests.

Everything here is a frozen value that round-trips through JSON (the state database stores it
that way) and renders to one paragraph of plain words (the approval page and the weekly report
show that paragraph).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")
"""Severities from least to most urgent."""

Comparison = Literal[">", ">=", "<", "<=", "=="]
_COMPARISON_WORDS: dict[str, str] = {
    ">": "above", ">=": "at or above", "<": "below", "<=": "at or below", "==": "equal to",
}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _fmt(value: float, unit: str) -> str:
    number = f"{value:.4g}" if math.isfinite(value) else str(value)
    return f"{number} {unit}".rstrip() if unit and unit != "1" else number


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One number a detector read or derived from the window (unit in UCUM, "1" = none)."""

    name: str
    value: float
    unit: str = "1"


@dataclass(frozen=True, slots=True, kw_only=True)
class Threshold:
    """The bound a measurement was judged against: ``measurement comparison value``."""

    measurement: str
    comparison: Comparison
    value: float
    unit: str = "1"

    def __post_init__(self) -> None:
        _check(self.comparison in _COMPARISON_WORDS,
               f"comparison must be one of {sorted(_COMPARISON_WORDS)}, got {self.comparison!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """Why a finding holds: the numbers, the model that judged them, and the bounds crossed.

    ``summary`` is one sentence of what was seen; ``model`` names the cost model or rule and
    its formula (``"bandwidth saturation f = 1 - exp(-k x/B), k = 0.8"``).
    """

    summary: str
    model: str
    measurements: tuple[Measurement, ...] = ()
    thresholds: tuple[Threshold, ...] = ()

    def __post_init__(self) -> None:
        _check(bool(self.summary.strip()), "summary must not be empty")
        names = {m.name for m in self.measurements}
        for threshold in self.thresholds:
            _check(threshold.measurement in names,
                   f"thresholds: {threshold.measurement!r} is not among the measurements")

    def value(self, name: str) -> float:
        """The value of the named measurement (KeyError if absent)."""
        for measurement in self.measurements:
            if measurement.name == name:
                return measurement.value
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite numbers become the strings "nan", "inf", "-inf")."""
        return {
            "summary": self.summary,
            "model": self.model,
            "measurements": [
                {"name": m.name, "value": _json_number(m.value), "unit": m.unit}
                for m in self.measurements
            ],
            "thresholds": [
                {"measurement": t.measurement, "comparison": t.comparison,
                 "value": _json_number(t.value), "unit": t.unit}
                for t in self.thresholds
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evidence:
        """The inverse of :meth:`to_dict`."""
        return cls(
            summary=data["summary"],
            model=data["model"],
            measurements=tuple(
                Measurement(name=m["name"], value=float(m["value"]), unit=m["unit"])
                for m in data.get("measurements", ())
            ),
            thresholds=tuple(
                Threshold(measurement=t["measurement"], comparison=t["comparison"],
                          value=float(t["value"]), unit=t["unit"])
                for t in data.get("thresholds", ())
            ),
        )

    def render(self) -> str:
        """One paragraph of plain words: what was seen, the numbers, the model, the bounds."""
        parts = [self.summary.rstrip(".") + "."]
        if self.measurements:
            measured = ", ".join(f"{m.name} = {_fmt(m.value, m.unit)}" for m in self.measurements)
            parts.append(f"Measured: {measured}.")
        parts.append(f"Judged by {self.model.rstrip('.')}.")
        for t in self.thresholds:
            seen = _fmt(self.value(t.measurement), t.unit)
            parts.append(f"{t.measurement} ({seen}) is {_COMPARISON_WORDS[t.comparison]} the "
                         f"threshold {_fmt(t.value, t.unit)}.")
        return " ".join(parts)


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class SuggestedChange:
    """A knob setting the detector proposes and what it expects the change to do."""

    knob: str
    value: Any
    expected_effect: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """A detector's verdict about one resource of one job.

    Detectors return findings with ``id`` empty and no times; the engine assigns both when the
    finding opens (after hysteresis) and sets ``closed_at_ns`` when it closes. ``resource`` names
    where: any of ``gpu``, ``rank``, ``module_group``, ``replica`` (string values).
    """

    detector: str
    job: str
    severity: Severity
    evidence: Evidence
    resource: Mapping[str, str] = field(default_factory=dict)
    suggested_changes: tuple[SuggestedChange, ...] = ()
    id: str = ""
    opened_at_ns: int | None = None
    closed_at_ns: int | None = None

    def __post_init__(self) -> None:
        _check(self.severity in SEVERITIES,
               f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        _check(bool(self.detector), "detector must not be empty")
        _check(bool(self.job), "job must not be empty")
        object.__setattr__(self, "resource", {str(k): str(v) for k, v in self.resource.items()})
        object.__setattr__(self, "suggested_changes", tuple(self.suggested_changes))

    @property
    def key(self) -> tuple[str, str, str]:
        """What hysteresis and dedup count by: (detector, job, resource as sorted JSON)."""
        return (self.detector, self.job, resource_key(self.resource))

    @property
    def active(self) -> bool:
        """Opened and not yet closed."""
        return self.opened_at_ns is not None and self.closed_at_ns is None

    def render(self) -> str:
        """One paragraph: who, where, how bad, why, and what to try."""
        where = ", ".join(f"{k} {v}" for k, v in sorted(self.resource.items()))
        head = f"[{self.severity}] {self.detector} on job {self.job}"
        text = f"{head} ({where}): " if where else f"{head}: "
        text += self.evidence.render()
        if self.suggested_changes:
            text += " Suggested: " + "; ".join(
                f"set {c.knob} = {c.value!r} ({c.expected_effect.rstrip('.')})"
                for c in self.suggested_changes
            ) + "."
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return {
            "id": self.id,
            "detector": self.detector,
            "job": self.job,
            "resource": dict(self.resource),
            "severity": self.severity,
            "opened_at_ns": self.opened_at_ns,
            "closed_at_ns": self.closed_at_ns,
            "evidence": self.evidence.to_dict(),
            "suggested_changes": [
                {"knob": c.knob, "value": c.value, "expected_effect": c.expected_effect}
                for c in self.suggested_changes
            ],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string (strict: no NaN literals)."""
        return json.dumps(self.to_dict(), allow_nan=False, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        """The inverse of :meth:`to_dict`."""
        return cls(
            id=data.get("id", ""),
            detector=data["detector"],
            job=data["job"],
            resource=data.get("resource", {}),
            severity=data["severity"],
            opened_at_ns=data.get("opened_at_ns"),
            closed_at_ns=data.get("closed_at_ns"),
            evidence=Evidence.from_dict(data["evidence"]),
            suggested_changes=tuple(SuggestedChange(**c) for c in data.get("suggested_changes", ())),
        )

    @classmethod
    def from_json(cls, text: str) -> Finding:
        """The inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> Finding:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return replace(self, **changes)


def resource_key(resource: Mapping[str, str]) -> str:
    """A canonical string for a resource dict, stable across runs (sorted JSON)."""
    return json.dumps({str(k): str(v) for k, v in resource.items()}, sort_keys=True)


def more_severe(a: Severity, b: Severity) -> Severity:
    """The more urgent of two severities."""
    return a if SEVERITIES.index(a) >= SEVERITIES.index(b) else b
