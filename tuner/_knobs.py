"""Knobs and configs: the vocabulary the tuner, the rollout controller and the job share.

A knob is one setting with a domain, a scope (`live`: applied at a step boundary; `restart`:
needs the job restarted, so it always waits for a person) and a risk (of the knob, or of some
of its values only: fp16 is risky where bf16 of the same precision knob is not). A knob that
only injects faults for drills is not ``searchable``: no search ever proposes it; a value in a
knob's ``search_excludes`` (a precision measured slower than fp32 on the job's device) is never
proposed by a search either, though an operator may still set it. A config assigns every
knob of a job and carries a version; every apply of a config, the baseline included, gets a new
version, so a measurement window selected by version never straddles a switch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from collectors import SeedanceError

Scope = Literal["live", "restart"]
Risk = Literal["low", "high"]
KnobValue = bool | int | float | str


class KnobError(SeedanceError):
    """A knob definition or a value for it is invalid."""


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One setting. Exactly one of `choices` or (`low`, `high`) defines the domain."""

    name: str
    default: KnobValue
    choices: tuple[KnobValue, ...] | None = None
    low: float | None = None
    high: float | None = None
    integer: bool = False
    log: bool = False
    scope: Scope = "live"
    risk: Risk = "low"
    risky_values: tuple[KnobValue, ...] = ()
    search_excludes: tuple[KnobValue, ...] = ()
    searchable: bool = True
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not all(part.isidentifier() for part in self.name.split(".")):
            raise KnobError(f"knob name {self.name!r}: use dotted identifiers (precision.ffn)")
        ranged = self.low is not None or self.high is not None
        if (self.choices is None) == (not ranged):
            raise KnobError(f"knob {self.name}: give either choices or low and high")
        if ranged and (self.low is None or self.high is None or not self.low < self.high):
            raise KnobError(f"knob {self.name}: low must be below high")
        if self.choices is not None and len(set(self.choices)) != len(self.choices):
            raise KnobError(f"knob {self.name}: choices repeat")
        if self.scope not in ("live", "restart"):
            raise KnobError(f"knob {self.name}: scope must be 'live' or 'restart'")
        if self.risk not in ("low", "high"):
            raise KnobError(f"knob {self.name}: risk must be 'low' or 'high'")
        for value in (*self.risky_values, *self.search_excludes):
            self.validate(value)
        self.validate(self.default)

    def risk_of(self, value: KnobValue) -> Risk:
        """High when the knob is, or when ``value`` is one of its ``risky_values`` (fp16
        without a loss scaler, say: one precision of a knob whose others are safe)."""
        return "high" if self.risk == "high" or value in self.risky_values else "low"

    def validate(self, value: Any) -> KnobValue:
        """The value, normalised, or KnobError naming the knob and the domain."""
        if self.choices is not None:
            if value not in self.choices:
                raise KnobError(f"knob {self.name}: {value!r} is not one of {list(self.choices)}")
            return value  # type: ignore[no-any-return]
        assert self.low is not None and self.high is not None
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise KnobError(f"knob {self.name}: {value!r} is not a number")
        if self.integer and value != int(value):
            raise KnobError(f"knob {self.name}: {value!r} is not an integer")
        if not self.low <= value <= self.high:
            raise KnobError(f"knob {self.name}: {value!r} is outside [{self.low}, {self.high}]")
        return int(value) if self.integer else float(value)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Knob:
        data = dict(data)
        for name in ("choices", "risky_values", "search_excludes"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        try:
            return cls(**data)
        except TypeError as exc:
            raise KnobError(f"knob definition {data.get('name')!r}: {exc}") from None


@dataclass(frozen=True)
class KnobSpace:
    """The knobs of one job, by name; the source of defaults and validation."""

    knobs: Mapping[str, Knob] = field(default_factory=dict)

    @classmethod
    def of(cls, knobs: Iterable[Knob]) -> KnobSpace:
        by_name: dict[str, Knob] = {}
        for knob in knobs:
            if knob.name in by_name:
                raise KnobError(f"knob {knob.name} is declared twice")
            by_name[knob.name] = knob
        return cls(by_name)

    def defaults(self) -> dict[str, KnobValue]:
        return {name: knob.default for name, knob in self.knobs.items()}

    def validate(self, values: Mapping[str, Any], *, partial: bool = False) -> dict[str, KnobValue]:
        """Normalised values; a full assignment unless `partial` (then only what is given)."""
        unknown = sorted(set(values) - set(self.knobs))
        if unknown:
            raise KnobError(f"unknown knob(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(self.knobs)) or 'none'}")
        checked = {name: self.knobs[name].validate(value) for name, value in values.items()}
        if partial:
            return checked
        return {**self.defaults(), **checked}

    def scope_of(self, changed: Sequence[str]) -> Scope:
        return "restart" if any(self.knobs[n].scope == "restart" for n in changed) else "live"

    def risk_of(self, changed: Mapping[str, KnobValue]) -> Risk:
        """High when any changed knob, at its new value, is high risk."""
        return "high" if any(self.knobs[n].risk_of(v) == "high"
                             for n, v in changed.items()) else "low"

    def searchable(self) -> KnobSpace:
        """The knobs a search may move: live, and not fault-injection switches."""
        return KnobSpace({n: k for n, k in self.knobs.items()
                          if k.searchable and k.scope == "live"})


@dataclass(frozen=True)
class Config:
    """A full assignment of a job's knobs; `version` is unique per apply within a job."""

    version: int
    values: Mapping[str, KnobValue]

    def changed_from(self, other: Config) -> list[str]:
        return sorted(k for k in self.values if self.values.get(k) != other.values.get(k))

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "values": dict(self.values)}


SCHEDULER_KNOBS: tuple[Knob, ...] = (
    Knob(name="scheduler.policy", default="static", choices=("static", "dynamic-topo"),
         scope="restart", risk="high",
         description="placement policy (seed truth 1): static binding or topology-aware"),
    Knob(name="scheduler.rdma", default=False, choices=(False, True), scope="restart",
         risk="high", description="use RDMA for cross-node collectives"),
    Knob(name="scheduler.numa_aware", default=False, choices=(False, True), scope="restart",
         risk="high", description="pin workers to the GPU's NUMA node"),
)
"""The seed's `scheduler set --policy --rdma-enable --numa-aware` group: takes effect at the
job's next start, so it always waits for a person."""
