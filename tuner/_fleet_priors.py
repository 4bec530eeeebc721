"""Fleet priors: a new job's first trials are the configs kept by the past jobs most like it.

Every sidecar sharing a state database writes the fingerprint of each job that attaches
(``tuner._fleet_jobs``) and journals its changes. When a job's search is set up, the past
jobs whose fingerprints are near (``tuner._fleet_distance``) and that kept a config are its
sources, nearest first. A source's kept config is what its kept changes set, at the values of
its last one (the job's final baseline), and its gain is their measured gains compounded (the
kept config over the job's launch config). Each becomes a prior ``Move`` of the knobs that
differ from the new job's baseline and that its search may set, expecting the source's gain:
``SearchDriver.add_priors`` stores it in the study, and ``single_moves`` tries it first, once
(``Move.once``: a config kept elsewhere that regressed here is not tried again from the next
baseline). A prior that regresses or fails here is judged like any trial.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from collectors import JobFingerprint, SeedanceError
from tuner._change import Change
from tuner._fleet_distance import NEAR_DISTANCE, fingerprint_distance
from tuner._fleet_jobs import FleetJobs
from tuner._journal import ChangeJournal
from tuner._knobs import KnobValue
from tuner._space import Move

MAX_FLEET_PRIORS = 3
"""Fleet priors a search gets at most: the nearest sources' kept configs, one trial each."""
MAX_SOURCES = 10
"""Near past jobs read for a new one: enough that a few still move it after those whose kept
config it already runs are left out."""
FLEET_WHY = "fleet: kept by job"
"""How a fleet prior's ``why`` begins (the trial's origin says it too)."""


class NoFingerprintError(SeedanceError):
    """The job has no fingerprint in the state database: unknown there, or its client sent
    none."""


@dataclass(frozen=True, kw_only=True)
class FleetSource:
    """A near past job with a kept config: how far it is, the knobs its kept changes set (at
    their kept values), what that config measured over its launch config, and which changes
    kept it."""

    job: str
    distance: float
    values: Mapping[str, KnobValue]
    gain: float | None
    changes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "distance": round(self.distance, 4), "values": dict(self.values),
                "gain": self.gain, "changes": list(self.changes)}


def kept_config(journal: ChangeJournal, job: str
                ) -> tuple[dict[str, KnobValue], float | None, tuple[str, ...]] | None:
    """The knobs the job's kept changes set, at its final baseline's values (a knob moved and
    moved back left out), their compounded measured gain (None: none measured) and the
    changes' ids; None when nothing was kept."""
    kept = journal.changes(job=job, states=("kept",))
    if not kept:
        return None
    final, launch = kept[-1].candidate, kept[0].baseline
    values = {k: final[k] for c in kept for k in c.values
              if k in final and launch.get(k) != final[k]}
    return values, compounded_gain(kept), tuple(c.id for c in kept)


def compounded_gain(kept: Iterable[Change]) -> float | None:
    """The kept changes' measured gains compounded (each measured against the baseline the one
    before it left): the kept config over the launch config; None when none carries a finite
    gain."""
    gains = [g for g in ((c.comparison or {}).get("gain") for c in kept)
             if isinstance(g, int | float) and math.isfinite(g)]
    return math.prod(1.0 + g for g in gains) - 1.0 if gains else None


class FleetPriors:
    """Reads the fleet's fingerprints (``jobs``) and the changes its jobs kept (``journal``),
    both on one state database; their owner closes them."""

    def __init__(self, jobs: FleetJobs, journal: ChangeJournal) -> None:
        self._jobs = jobs
        self._journal = journal

    def fingerprint(self, job: str) -> JobFingerprint:
        """The job's stored fingerprint; ``NoFingerprintError`` when there is none."""
        found = self._jobs.fingerprints().get(job)
        if found is not None:
            return found
        if not self._jobs.known(job):
            raise NoFingerprintError(f"unknown job {job!r}: no sidecar sharing this state "
                                     "database has seen it attach")
        raise NoFingerprintError(f"job {job!r} has no fingerprint yet (its client sent none: "
                                 "an older seedance-tuner in the job?)")

    def sources(self, job: str, fingerprint: JobFingerprint | None = None, *,
                limit: int = MAX_SOURCES) -> list[FleetSource]:
        """The other jobs near ``fingerprint`` (default: the job's stored one) that kept a
        config, nearest first, at most ``limit`` (each is one read of the journal)."""
        fingerprints = self._jobs.fingerprints()
        mine = fingerprint if fingerprint is not None else self.fingerprint(job)
        near = sorted((fingerprint_distance(mine, theirs), other)
                      for other, theirs in fingerprints.items() if other != job)
        out: list[FleetSource] = []
        for distance, other in near:
            if distance >= NEAR_DISTANCE or len(out) >= limit:
                break
            kept = kept_config(self._journal, other)
            if kept is not None and kept[0]:
                values, gain, changes = kept
                out.append(FleetSource(job=other, distance=distance, values=values, gain=gain,
                                       changes=changes))
        return out


def fleet_moves(sources: Sequence[FleetSource], baseline: Mapping[str, Any],
                space: Mapping[str, BaseDistribution], *,
                limit: int = MAX_FLEET_PRIORS) -> list[Move]:
    """The first ``limit`` sources (nearest first) that move this job as prior moves, each to
    be tried once: the source's knobs that ``space`` holds with its value in their domain and
    that differ from ``baseline``, expecting the source's gain."""
    moves: list[Move] = []
    for source in sources:
        values = {k: v for k, v in source.values.items()
                  if k in space and _in_domain(space[k], v) and baseline.get(k) != v}
        if values and all(m.values != values for m in moves):
            moves.append(Move(values=values, expected_gain=source.gain, once=True,
                              why=f"{FLEET_WHY} {source.job} (distance {source.distance:.2f})"))
        if len(moves) == limit:
            break
    return moves


def fleet_source_of(origin: str) -> str | None:
    """The source job of a trial whose origin is a fleet prior's ``why`` (None: another)."""
    if not origin.startswith(FLEET_WHY + " "):
        return None
    return origin.removeprefix(FLEET_WHY + " ").rpartition(" (distance ")[0] or None


def _in_domain(dist: BaseDistribution, value: Any) -> bool:
    """Whether the search may propose ``value`` (another job's domain may be wider)."""
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(dist, IntDistribution):
        return float(value).is_integer() and dist.low <= value <= dist.high
    return isinstance(dist, FloatDistribution) and dist.low <= value <= dist.high
