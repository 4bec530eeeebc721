"""The search space of a job's knobs as Optuna sees it, and the single moves a live search
takes from the baseline: neighbours one step away, the policy engine's suggestions first."""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from policies import Finding
from policies.detectors import EXPECTED_GAIN
from tuner._knobs import Knob, KnobError, KnobSpace, KnobValue

log = logging.getLogger(__name__)

_ENUMERATE_LIMIT = 100_000


def config_key(values: Mapping[str, Any]) -> str:
    """A canonical string for a config (sorted JSON), what dedupe compares."""
    return json.dumps({k: values[k] for k in sorted(values)}, sort_keys=True)


def distribution(knob: Knob) -> BaseDistribution:
    """The Optuna distribution of the part of a knob's domain a search may propose (its
    ``search_excludes`` left out, its default always in)."""
    if knob.choices is not None:
        return CategoricalDistribution(tuple(
            c for c in knob.choices if c == knob.default or c not in knob.search_excludes))
    assert knob.low is not None and knob.high is not None
    if knob.integer:
        return IntDistribution(int(knob.low), int(knob.high), log=knob.log)
    return FloatDistribution(knob.low, knob.high, log=knob.log)


def search_space(space: KnobSpace, names: Sequence[str] | None = None
                 ) -> dict[str, BaseDistribution]:
    """Distributions of the named knobs (default: every knob), in the space's order."""
    chosen = list(space.knobs) if names is None else list(names)
    return {name: distribution(space.knobs[name]) for name in chosen}


def within_bounds(space: KnobSpace, bounds: Mapping[str, Any]) -> KnobSpace:
    """``space`` narrowed to the operator's auto-approval ``bounds`` (``RolloutConfig.
    auto_bounds``: (low, high) or a set of allowed values per knob), so a search in auto mode
    only proposes what may auto-approve. A knob's default always stays in its domain; a knob
    left with nothing but its default is dropped (nothing to search)."""
    kept: list[Knob] = []
    for knob in space.knobs.values():
        bound = bounds.get(knob.name)
        if bound is None:
            kept.append(knob)
            continue
        if knob.choices is not None:
            allowed = () if isinstance(bound, tuple) else tuple(bound)
            choices = tuple(c for c in knob.choices if c == knob.default or (
                c in allowed if allowed else bound[0] <= c <= bound[1]))  # type: ignore[operator]
            if len(choices) > 1:
                kept.append(replace(knob, choices=choices))
        elif isinstance(bound, tuple):
            assert knob.low is not None and knob.high is not None
            low = min(max(knob.low, bound[0]), float(knob.default))  # type: ignore[arg-type]
            high = max(min(knob.high, bound[1]), float(knob.default))  # type: ignore[arg-type]
            if low < high:
                kept.append(replace(knob, low=low, high=high))
        else:  # a number knob with a set of allowed values: those values, as choices
            choices = tuple(sorted({knob.default, *(
                v for v in bound if isinstance(v, int | float) and not isinstance(v, bool)
                and knob.low is not None and knob.high is not None
                and knob.low <= v <= knob.high)}))  # type: ignore[type-var]
            if len(choices) > 1:
                kept.append(replace(knob, choices=choices, low=None, high=None, log=False))
    return KnobSpace.of(kept)


def neighbours(values: Mapping[str, Any], space: Mapping[str, BaseDistribution]
               ) -> Iterator[dict[str, Any]]:
    """Configs one knob one step away: the adjacent choice (numeric choices are ordered,
    others are all neighbours); for numbers, x2 and /2 on a log or wide domain (a cache of
    256 MiB moves to 512 or 128, not by a tenth of a 64 GiB range), else +-1 for ints and
    +-10% of the range for floats; up before down, knobs in order."""
    for name, dist in space.items():
        value = values[name]
        steps: list[Any] = []
        if isinstance(dist, CategoricalDistribution):
            choices = list(dist.choices)
            ordered = all(isinstance(c, int | float) and not isinstance(c, bool)
                          for c in choices)
            if ordered:
                ranked = sorted(choices, key=lambda c: float(c))  # type: ignore[arg-type]
                i = ranked.index(value)
                steps = [ranked[j] for j in (i + 1, i - 1) if 0 <= j < len(ranked)]
            else:
                steps = [c for c in choices if c != value]
        elif isinstance(dist, IntDistribution):
            wide = dist.log or dist.high - dist.low > 16
            steps = ([max(value * 2, value + 1), value // 2] if wide
                     else [value + 1, value - 1])
            steps = [v for v in steps if dist.low <= v <= dist.high and v != value]
        elif isinstance(dist, FloatDistribution):
            wide = dist.log or (dist.low >= 0 and dist.high > 10 * max(dist.low, 1e-12)
                                and dist.high - dist.low > 10)
            if wide and value > 0:
                steps = [value * 2, value / 2]
            else:
                steps = [value + 0.1 * (dist.high - dist.low),
                         value - 0.1 * (dist.high - dist.low)]
            steps = [min(dist.high, max(dist.low, v)) for v in steps]
            steps = [v for v in steps if v != value]
        for v in steps:
            yield {**values, name: v}


@dataclass(frozen=True, kw_only=True)
class Move:
    """One step from the job's baseline: the knobs it sets, the gain a prior expects of it
    (None: no prior), and why it is tried. A prior ``once`` is tried from one baseline only:
    it is a whole config another job kept, not a direction worth trying from every baseline
    (a compute prior's "this group is faster in bf16")."""

    values: dict[str, KnobValue]
    expected_gain: float | None = None
    why: str = ""
    once: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"values": self.values, "expected_gain": self.expected_gain, "why": self.why,
                "once": self.once}


_PRECISION_RANK = {"fp32": 0, "tf32": 1, "bf16": 2, "fp16": 3, "fp8": 4}


def _move_order(name: str, before: Any, after: Any) -> int:
    """Without a prior, the moves most likely to pay come first: a lower precision, more
    threads, a bigger micro-batch (fewer, larger kernels), then anything else, then the moves
    that usually cost (a higher precision, fewer threads, a smaller micro-batch)."""
    if name == "precision" or name.startswith("precision."):
        return 0 if _PRECISION_RANK.get(after, 0) > _PRECISION_RANK.get(before, 0) else 5
    if name in ("threads", "micro_batch"):
        return (1 if name == "threads" else 2) if after > before else 6
    return 3


def single_moves(baseline: Mapping[str, Any], space: Mapping[str, BaseDistribution],
                 priors: Sequence[Move] = ()) -> list[Move]:
    """The next trials from ``baseline``, one knob at a time: the priors' moves by expected
    gain, then every neighbour (``neighbours``) in ``_move_order``. A multi-knob config is
    only ever reached by keeping single moves one after another."""
    moves: list[Move] = []
    seen: set[str] = set()
    for prior in sorted(priors, key=lambda m: -(m.expected_gain or 0.0)):
        values = {k: v for k, v in prior.values.items()
                  if k in space and baseline.get(k) != v}
        if values and config_key(values) not in seen:
            seen.add(config_key(values))
            moves.append(replace(prior, values=values))
    ranked = []
    for i, config in enumerate(neighbours({k: baseline[k] for k in space}, space)):
        (name, value), = ((k, v) for k, v in config.items() if baseline[k] != v)
        ranked.append((_move_order(name, baseline[name], value), i, name, value))
    for _, _, name, value in sorted(ranked):
        key = config_key({name: value})
        if key not in seen:
            seen.add(key)
            moves.append(Move(values={name: value}, why=f"one step of {name}"))
    return moves


def grid(space: Mapping[str, BaseDistribution]) -> list[dict[str, Any]] | None:
    """Every config of a finite space (categorical and int knobs), or None if too large."""
    axes: list[list[Any]] = []
    for dist in space.values():
        if isinstance(dist, CategoricalDistribution):
            axes.append(list(dist.choices))
        elif isinstance(dist, IntDistribution) and not dist.log:
            axes.append(list(range(dist.low, dist.high + 1, dist.step)))
        else:
            return None
    if math.prod(len(a) for a in axes) > _ENUMERATE_LIMIT:
        return None
    return [dict(zip(space, combo, strict=True)) for combo in itertools.product(*axes)]


def suggestions(findings: Sequence[Finding], baseline: Mapping[str, Any],
                space: KnobSpace) -> list[Move]:
    """The policy engine's suggested changes as moves from ``baseline`` (knobs outside
    ``space``, values outside their domain and values the baseline already holds left out),
    with the gain each finding expects (its ``expected_gain`` measurement, if any)."""
    out: list[Move] = []
    for finding in findings:
        values: dict[str, KnobValue] = {}
        for suggested in finding.suggested_changes:
            knob = space.knobs.get(suggested.knob)
            if knob is None:
                continue
            try:
                value = knob.validate(suggested.value)
            except KnobError:
                log.info("finding %s suggests %s = %r outside its domain; skipped",
                         finding.id, suggested.knob, suggested.value)
                continue
            if baseline.get(suggested.knob) != value:
                values[suggested.knob] = value
        if not values:
            continue
        try:
            expected: float | None = finding.evidence.value(EXPECTED_GAIN)
        except KeyError:
            expected = None
        move = Move(values=values, expected_gain=expected,
                    why=f"{finding.detector}: {finding.evidence.summary}")
        if move not in out:
            out.append(move)
    return out


