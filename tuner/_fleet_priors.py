"""Fleet priors: a new job's first trials are the best configs measured on the past jobs most
like it.

Every sidecar sharing a state database writes the fingerprint of each job that attaches
(``tuner._fleet_jobs``) and journals its changes. When a job's search is set up, the past
jobs whose fingerprints are near (``tuner._fleet_distance``) and that kept a config are its
sources, nearest first. A source's kept config is what its kept changes set, at the values of
its last one (the job's final baseline), and its gain is their measured gains compounded (the
kept config over the job's launch config). A source may also have measured a config faster
than its kept one that it did not keep: a candidate rolled back as a tie (a point gain over
its baseline, not a measured loss, no loss, latency or quality check failed), below the gain
worth a change there. Ranking a past study's configs by what they measured, as
meta-learned warm starts do, that tie leads: a config the source could not tell apart from
its kept one is as likely to win here, and the new job's own rollout decides. Each lead
becomes a prior ``Move`` of the knobs that differ from the new job's baseline and that its
search may set, expecting the source's gain: ``SearchDriver.add_priors`` stores it in the
study, and ``single_moves`` tries it first, once (``Move.once``: a config that led elsewhere
and regressed here is not tried again from the next baseline). A prior that regresses or
fails here is judged like any trial.

A new job at least ``HALVE_AT_SIZE_RATIO`` times the source's parameters also gets the
source's kept config at half its final micro-batch (rounded up), right after it. A bigger model
of the family holds more activation memory per sample (between the square root of the
parameter ratio, wider layers, and the ratio itself, more layers), so on a GPU the source's
micro-batch may not fit it at all, and the half is the config that runs. On a CPU the best
micro-batch may move either way: in ``bench/fleet_priors.py`` the base CNN and LSTM were
fastest at half the small size's micro-batch, the base ViT and wide transformer at twice it
(``docs/tuning.md``). No job gets a doubled lead: twice the micro-batch is an early step of
its own search, and for a bigger model the one that could run out of memory.
A source whose search kept nothing (its launch config measured best there) still gives a much
bigger job its launch config at half the micro-batch: a cold search tries a smaller
micro-batch last, as the move that usually costs.
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
"""Fleet priors a search gets at most: the nearest sources' leads, one trial each."""
HALVE_AT_SIZE_RATIO = 2.0
"""A new job this many times a source's parameters or more also tries the source's kept config
at half its micro-batch (module docstring)."""
MAX_SOURCES = 10
"""Near past jobs read for a new one: enough that a few still move it after those whose kept
config it already runs are left out."""
FLEET_WHY = "fleet: kept by job"
"""How the ``why`` of a fleet prior of a source's kept config begins (the trial's origin says
it too)."""
FLEET_TIE_WHY = "fleet: measured best by job"
"""How the ``why`` of a fleet prior of a source's best measured config begins, when the source
rolled it back as a tie."""
FLEET_HALVED_WHY = "fleet: half the micro-batch kept by job"
"""How the ``why`` of a fleet prior of a source's kept config at half its micro-batch begins,
for a job much bigger than the source."""


class NoFingerprintError(SeedanceError):
    """The job has no fingerprint in the state database: unknown there, or its client sent
    none."""


@dataclass(frozen=True, kw_only=True)
class FleetSource:
    """A near past job with a kept config: how far it is, the knobs its kept changes set (at
    their kept values), what that config measured over its launch config, and which changes
    kept it; and, when it measured a faster config it rolled back as a tie, that config
    (``best``, the knobs that differ from its launch) and its estimated gain over the launch
    config; its final micro-batch (None: the job has no such knob) and how many times its
    parameters the new job has (``size_ratio``)."""

    job: str
    distance: float
    values: Mapping[str, KnobValue]
    gain: float | None
    changes: tuple[str, ...]
    best: Mapping[str, KnobValue] | None = None
    best_gain: float | None = None
    micro_batch: KnobValue | None = None
    size_ratio: float = 1.0

    def leads(self) -> list[tuple[str, Mapping[str, KnobValue], float | None]]:
        """The configs this source gives a new job, best measured first: each with the prior's
        ``why`` (the trial's origin) and its expected gain over the launch config; for a much
        bigger job, the kept config at half the micro-batch after it (module docstring), also
        where the source kept nothing (its launch config at half the micro-batch)."""
        where = f"{self.job} (distance {self.distance:.2f})"
        out = [] if self.best is None else [(f"{FLEET_TIE_WHY} {where}", self.best,
                                             self.best_gain)]
        if self.values:
            out.append((f"{FLEET_WHY} {where}", self.values, self.gain))
        mb = self.micro_batch
        if self.size_ratio >= HALVE_AT_SIZE_RATIO and isinstance(mb, int) \
                and not isinstance(mb, bool) and mb > 1:
            out.append((f"{FLEET_HALVED_WHY} {where}", {**self.values, "micro_batch": (mb + 1) // 2},
                        self.gain))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "distance": round(self.distance, 4), "values": dict(self.values),
                "gain": self.gain, "changes": list(self.changes),
                "best": None if self.best is None else dict(self.best),
                "best_gain": self.best_gain, "micro_batch": self.micro_batch,
                "size_ratio": round(self.size_ratio, 3)}


def kept_config(journal: ChangeJournal, job: str
                ) -> tuple[dict[str, KnobValue], float | None, tuple[str, ...]] | None:
    """The knobs the job's kept changes set, at its final baseline's values (a knob moved and
    moved back left out), their compounded measured gain (None: none measured) and the
    changes' ids; None when nothing was kept."""
    return _kept_config(journal.changes(job=job, states=("kept",)))


def best_tie(journal: ChangeJournal, job: str
             ) -> tuple[dict[str, KnobValue], float] | None:
    """The job's fastest measured config that it rolled back as a tie, when that measured
    faster than its kept config: the knobs that differ from its launch config, and its gain
    over it (the baseline's compounded gain times the candidate's point gain); None when no
    tie beat the kept config."""
    return _best_tie(journal.changes(job=job))


def _kept_config(changes: Sequence[Change]
                 ) -> tuple[dict[str, KnobValue], float | None, tuple[str, ...]] | None:
    """``kept_config`` of a job's changes in order (any states)."""
    kept = [c for c in changes if c.state == "kept"]
    if not kept:
        return None
    final, launch = kept[-1].candidate, kept[0].baseline
    values = {k: final[k] for c in kept for k in c.values
              if k in final and launch.get(k) != final[k]}
    return values, compounded_gain(kept), tuple(c.id for c in kept)


def _best_tie(changes: Sequence[Change]) -> tuple[dict[str, KnobValue], float] | None:
    """``best_tie`` of a job's changes in order."""
    kept = [c for c in changes if c.state == "kept"]
    if not kept:
        return None
    launch, final = kept[0].baseline, kept[-1].candidate
    relative, best_relative = 1.0, 1.0 + (compounded_gain(kept) or 0.0)
    best: dict[str, KnobValue] | None = None
    for change in changes:
        gain = _measured_gain(change)
        if change.state == "kept":
            relative *= 1.0 + (gain or 0.0)
        elif change.state == "rolled_back" and gain is not None and gain > 0 \
                and _a_tie(change.comparison or {}) and relative * (1.0 + gain) > best_relative \
                and change.candidate != final:
            best_relative = relative * (1.0 + gain)
            best = {k: v for k, v in change.candidate.items() if launch.get(k) != v}
    return None if not best else (best, best_relative - 1.0)


def _measured_gain(change: Change) -> float | None:
    gain = (change.comparison or {}).get("gain")
    return float(gain) if isinstance(gain, int | float) and math.isfinite(gain) else None


def _a_tie(comparison: Mapping[str, Any]) -> bool:
    """Rolled back for want of a gain worth a change, not for a measured loss or a failed
    check."""
    return comparison.get("pairs", 1) > 0 and not comparison.get("ci_high", 0.0) < 0 \
        and all(comparison.get(check, True) for check in ("loss_ok", "latency_ok", "quality_ok"))


def compounded_gain(kept: Iterable[Change]) -> float | None:
    """The kept changes' measured gains compounded (each measured against the baseline the one
    before it left): the kept config over the launch config; None when none carries a finite
    gain."""
    gains = [g for g in map(_measured_gain, kept) if g is not None]
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
        """The other jobs near ``fingerprint`` (default: the job's stored one) that lead it
        somewhere (``FleetSource.leads``: a kept config, or for a job twice their size or more,
        half the micro-batch they ended at, kept or launched with), nearest first, at most
        ``limit`` (each is one read of the journal)."""
        fingerprints = self._jobs.fingerprints()
        mine = fingerprint if fingerprint is not None else self.fingerprint(job)
        near = sorted((fingerprint_distance(mine, theirs), other)
                      for other, theirs in fingerprints.items() if other != job)
        out: list[FleetSource] = []
        for distance, other in near:
            if distance >= NEAR_DISTANCE or len(out) >= limit:
                break
            history = self._journal.changes(job=other)  # one read for both
            if not history:
                continue
            values, gain, changes = _kept_config(history) or ({}, 0.0, ())
            best, best_gain = _best_tie(history) or (None, None)
            final = next((c.candidate for c in reversed(history) if c.state == "kept"),
                         history[0].baseline)
            theirs = fingerprints[other].params
            source = FleetSource(
                job=other, distance=distance, values=values, gain=gain, changes=changes,
                best=best, best_gain=best_gain, micro_batch=final.get("micro_batch"),
                size_ratio=mine.params / theirs if theirs > 0 else 1.0)
            if source.leads():
                out.append(source)
        return out


def fleet_moves(sources: Sequence[FleetSource], baseline: Mapping[str, Any],
                space: Mapping[str, BaseDistribution], *,
                limit: int = MAX_FLEET_PRIORS) -> list[Move]:
    """The first ``limit`` leads of the sources (nearest source first, each source's best
    measured config first) that move this job, as prior moves each to be tried once: the
    lead's knobs that ``space`` holds with its value in their domain and that differ from
    ``baseline``, expecting the lead's gain."""
    moves: list[Move] = []
    for why, lead, gain in (lead for source in sources for lead in source.leads()):
        values = {k: v for k, v in lead.items()
                  if k in space and _in_domain(space[k], v) and baseline.get(k) != v}
        if values and all(m.values != values for m in moves):
            moves.append(Move(values=values, expected_gain=gain, once=True, why=why))
        if len(moves) == limit:
            break
    return moves


LEAD_KINDS = {FLEET_WHY: "kept", FLEET_TIE_WHY: "tie", FLEET_HALVED_WHY: "kept mb/2"}
"""What a fleet prior is, by how its ``why`` begins: the source's kept config, its faster tie,
or its kept config at half the micro-batch."""


def fleet_source_of(origin: str) -> str | None:
    """The source job of a trial whose origin is a fleet prior's ``why`` (None: another)."""
    for why in LEAD_KINDS:
        if origin.startswith(why + " "):
            return origin.removeprefix(why + " ").rpartition(" (distance ")[0] or None
    return None


def lead_kind(origin: str) -> str | None:
    """``LEAD_KINDS``' word for a fleet prior's ``why`` (None: not a fleet prior)."""
    return next((kind for why, kind in LEAD_KINDS.items() if origin.startswith(why + " ")),
                None)


def _in_domain(dist: BaseDistribution, value: Any) -> bool:
    """Whether the search may propose ``value`` (another job's domain may be wider)."""
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(dist, IntDistribution):
        return float(value).is_integer() and dist.low <= value <= dist.high
    return isinstance(dist, FloatDistribution) and dist.low <= value <= dist.high
