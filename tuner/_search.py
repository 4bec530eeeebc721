"""The Optuna driver: ask-and-tell over a job's knob space, stored in the state database.

How it searches a live job, where each trial costs a minute of the job's time and a bad one
could hurt it (``single_moves``):

- one knob at a time, from the job's baseline (the config last kept): first the moves the
  policy engine's findings expect to pay, by expected gain (``add_priors``, ``suggestions``: "72% of
  step time is in group ffn, bf16 measured 2.3x faster here"), then each neighbour of the
  baseline (one step of one knob), the moves that usually pay first. A kept move becomes the
  baseline, so multi-knob configs are reached by combining single moves that were kept, never
  by random start-up trials. A micro-batch far from the current one is never a step away.
  Once every single move from the baseline was tried, the search waits (a new baseline, kept
  by an operator, opens new moves); with ``sample_after_moves`` the sampler takes over
  (``NeighbourhoodSampler`` around the best trial, then TPE);
- no repeats: a config already measured is answered from the study (the trial is told the
  cached value, or pruned again if it was pruned, never re-run); a config that killed its job
  is unsafe and never proposed again; a failed trial is not retried unless its lease expired
  (its sidecar died: the config is not to blame);
- pruning: each measured pair reports an intermediate value; a median pruner, from the third
  pair on, stops trials doing worse than the median of earlier trials at the same pair.

The objective is drift-cancelled tokens/s: the study's reference (the first baseline's measured
tokens/s) times the config's level relative to it, and a candidate's level is its baseline's
level times (1 + its paired gain over that baseline). A kept candidate's level becomes known, so
later trials, measured against it, stay comparable with earlier ones; raw window means are not
(a busier box or a warmer cache moves them all), and a pruner fed raw means prunes on drift.

Optuna's heartbeat does not cover ask-and-tell, so trials hold our own lease (a trial system
attribute, renewed by ``heartbeat``): ``reap`` fails (TrialState.FAIL) every RUNNING trial whose
lease expired, so a trial whose sidecar died is never left RUNNING.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import optuna
from optuna.samplers import BaseSampler, TPESampler
from optuna.trial import FrozenTrial, Trial, TrialState

from collectors import ConfigError
from tuner._ceilings import above_ceiling
from tuner._change import PRUNED, Change
from tuner._knobs import KnobSpace, KnobValue
from tuner._rollout import RolloutController
from tuner._sampler import NeighbourhoodSampler, seen_keys, unsafe_keys
from tuner._space import Move, config_key, grid, search_space, single_moves
from tuner._study_records import (
    AGAIN,
    LEASE_ATTR,
    LEVEL_PREFIX,
    MEASURED_AT_ATTR,
    ORIGIN_ATTR,
    PRIORS_ATTR,
    REFERENCE_ATTR,
    RETRY_ATTR,
    SEEN_PREFIX,
    UNDECIDED_GAIN_ATTR,
    UNSAFE_PREFIX,
    StudyRecords,
)
from tuner._windows import Comparison

log = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """The driver's settings; ``trial_lease_s`` must outlast the longest gap between
    heartbeats (one rollout window). ``sample_after_moves``: once every single move from the
    baseline was tried, let the sampler propose (multi-knob configs); off by default, since a
    live job pays for every trial and a sampled config may move many knobs at once."""

    study_name: str
    direction: Literal["maximize", "minimize"] = "maximize"
    trial_lease_s: float = 900.0
    tpe_startup_trials: int = 2
    pruner_startup_trials: int = 2
    max_ask_attempts: int = 20
    seed: int | None = None
    sample_after_moves: bool = False
    revisit_after_s: float | None = 300.0
    """Once every single move from the baseline was tried, a neighbour measured longer ago than
    this is measured again, the best measured first (None: never). A config kept while a
    neighbour process loaded the box can lose once it is gone: a step back is one move."""

    def __post_init__(self) -> None:
        if not self.study_name:
            raise ConfigError("SearchConfig.study_name must not be empty")
        if self.revisit_after_s is not None and not self.revisit_after_s > 0:
            raise ConfigError("SearchConfig.revisit_after_s must be > 0 or None")
        if self.direction not in ("maximize", "minimize"):
            raise ConfigError(f"SearchConfig.direction must be maximize or minimize, "
                             f"got {self.direction!r}")
        if not self.trial_lease_s > 0:
            raise ConfigError("SearchConfig.trial_lease_s must be > 0")
        if self.max_ask_attempts < 1:
            raise ConfigError("SearchConfig.max_ask_attempts must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """A config to measure: the study's trial ``number`` and the knob ``values``."""

    number: int
    values: dict[str, KnobValue]
    origin: str = ""
    """Why this config: a prior's finding, a single move, "again: ..." or "revisit: ..."."""


class SearchDriver:
    """Ask-and-tell over ``space`` (only ``knobs`` if given) in an RDB study at ``storage_url``.

    Not thread-safe by itself: call it from the rollout thread (its ChangeObserver hooks run
    there too). State lives in the study, so a new driver on the same study continues it.
    """

    def __init__(self, space: KnobSpace, *, storage_url: str, config: SearchConfig,
                 knobs: Sequence[str] | None = None, clock: Callable[[], float] = time.time,
                 sampler: BaseSampler | None = None,
                 pruner: optuna.pruners.BasePruner | None = None,
                 ceilings: Callable[[], Mapping[str, float]] = dict) -> None:
        self.config = config
        self.ceilings = ceilings
        """The job's observed ceilings (``tuner._ceilings``), read at each proposal."""
        self.distributions = search_space(space, knobs)
        self._clock = clock
        self._storage = optuna.storages.RDBStorage(storage_url)
        self.study = optuna.create_study(
            study_name=config.study_name, storage=self._storage, load_if_exists=True,
            direction=config.direction,
            sampler=sampler or NeighbourhoodSampler(
                self.distributions, storage=self._storage, seed=config.seed,
                fallback=TPESampler(seed=config.seed,
                                    n_startup_trials=config.tpe_startup_trials)),
            pruner=pruner or optuna.pruners.MedianPruner(
                n_startup_trials=config.pruner_startup_trials, n_warmup_steps=3))
        self.records = StudyRecords(self._storage, config.study_name)
        self._mine: dict[int, Trial] = {}
        self._converged = ""

    # ---- priors --------------------------------------------------------------------------------

    def add_priors(self, priors: Sequence[Move]) -> int:
        """Remember the policy engine's moves (with the gain each expects) for ``single_moves``
        to try first, in the study so every sidecar sharing it sees them; a move already
        known keeps its larger expected gain. Returns how many were new."""
        known = {config_key(m.values): m for m in self.priors()}
        added = 0
        for move in priors:
            values = {k: v for k, v in move.values.items() if k in self.distributions}
            if not values:
                continue
            key = config_key(values)
            old = known.get(key)
            if old is None:
                added += 1
            if old is None or (move.expected_gain or 0.0) > (old.expected_gain or 0.0):
                known[key] = replace(move, values=values)
        self.records.set_attr(PRIORS_ATTR,
                                            [m.to_json() for m in known.values()])
        return added

    def priors(self) -> list[Move]:
        attrs = self.records.attrs()
        return [Move(values=dict(m["values"]), expected_gain=m.get("expected_gain"),
                     why=str(m.get("why", ""))) for m in attrs.get(PRIORS_ATTR, ())]

    # ---- ask / tell ----------------------------------------------------------------------------

    def ask(self) -> Proposal | None:
        """The next config to measure, never one measured, running or unsafe; None when the
        space is exhausted. Repeats the sampler offers are answered from the study's cache."""
        self.reap()
        if grid(self.distributions) is not None and not self._untried():
            return None  # a finite space, every config measured, running or unsafe
        for _ in range(self.config.max_ask_attempts):
            trial = self.study.ask(self.distributions)
            if self._answered(trial):
                continue
            return self._lease(trial)
        untried = self._untried()
        if not untried:
            return None
        index = int(np.random.default_rng(self.config.seed).integers(len(untried)))
        self.study.enqueue_trial(untried[index], user_attrs={ORIGIN_ATTR: "untried"})
        trial = self.study.ask(self.distributions)
        return None if self._answered(trial) else self._lease(trial)

    def report(self, number: int, step: int, value: float) -> bool:
        """Report an intermediate value (one window); True when the trial should be pruned."""
        trial = self._trial(number)
        trial.report(value, step)
        self.renew(number)
        return bool(trial.should_prune())

    def tell(self, number: int, value: float, *, revisit: bool = False,
             undecided_gain: float | None = None) -> None:
        """Complete the trial; with ``revisit`` its config may be measured again once stale
        (``SearchConfig.revisit_after_s``); an ``undecided_gain`` above zero (it ran out of
        time with the estimate on the candidate's side) may be measured again at once."""
        if revisit:
            self.records.set_trial_attr(number, MEASURED_AT_ATTR,
                                              self._clock())
        if undecided_gain is not None and math.isfinite(undecided_gain):
            self.records.set_trial_attr(number, UNDECIDED_GAIN_ATTR,
                                              undecided_gain)
        self.study.tell(number, value, skip_if_finished=True)
        self._mine.pop(number, None)

    def prune(self, number: int) -> None:
        self.study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
        self._mine.pop(number, None)

    def fail(self, number: int, *, reason: str, unsafe: bool) -> None:
        """Fail the trial; ``unsafe`` (its job died) bars its config from ever being proposed."""
        frozen = self.records.trial(number)
        self.records.set_trial_attr(number, "seedance:fail_reason", reason)
        if unsafe:
            self.mark_unsafe(frozen.params, reason=reason)
        self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        self._mine.pop(number, None)

    def mark_unsafe(self, values: Mapping[str, Any], *, reason: str) -> None:
        params = {k: values[k] for k in self.distributions}
        self.records.set_attr(UNSAFE_PREFIX + config_key(params), reason)

    def best(self) -> tuple[dict[str, Any], float] | None:
        complete = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not complete:
            return None
        best = self.study.best_trial
        return dict(best.params), float(best.value)  # type: ignore[arg-type]

    # ---- the trial lease -----------------------------------------------------------------------

    def renew(self, number: int) -> None:
        self.records.set_trial_system_attr(number, LEASE_ATTR,
                                            self._clock() + self.config.trial_lease_s)

    def heartbeat(self) -> None:
        """Renew the lease of every trial this driver runs (call it from the rollout loop)."""
        for number in list(self._mine):
            self.renew(number)

    def reap(self) -> list[int]:
        """Fail every RUNNING trial whose lease expired (its sidecar or driver died)."""
        now = self._clock()
        failed = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            until = t.system_attrs.get(LEASE_ATTR)
            if until is None or float(until) < now:
                self.records.set_trial_attr(t.number, "seedance:fail_reason",
                                                  "trial lease expired")
                self.records.set_trial_attr(t.number, RETRY_ATTR, True)
                self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
                self._mine.pop(t.number, None)
                failed.append(t.number)
        if failed:
            log.warning("search %s: failed trials %s whose lease expired",
                        self.config.study_name, failed)
        return failed

    # ---- the rollout controller's side ---------------------------------------------------------

    def next_move(self, baseline: Mapping[str, Any], knobs: KnobSpace, *,
                  low_risk_only: bool = False) -> Proposal | None:
        """The first single move from ``baseline`` not measured, running or unsafe (with
        ``low_risk_only``, not a high-risk one either), as a leased trial; None when every
        single move from it was tried."""
        self.reap()
        params = {k: baseline[k] for k in self.distributions}
        seen = seen_keys(self.study, self.records)
        moves = [m for m in self._moves(params)
                 if not (low_risk_only and knobs.risk_of(m.values) == "high")]
        for move in moves:
            config = {**params, **move.values}
            if config_key(config) not in seen:
                return self._start(config, move.why)
        return self._revisit(params, moves)

    def _moves(self, params: Mapping[str, Any]) -> list[Move]:
        """``single_moves`` less those above a ceiling the job's telemetry shows."""
        ceilings = self.ceilings()
        return [m for m in single_moves(params, self.distributions, self.priors())
                if not above_ceiling(m.values, ceilings)]

    def _revisit(self, params: Mapping[str, Any], moves: Sequence[Move]) -> Proposal | None:
        """Once every move was tried: the neighbour that may be measured again (kept, once a
        baseline, or inconclusive) and whose newest measurement is older than
        ``revisit_after_s``, the best measured first; None when there is none. A neighbour
        whose trial ran out of time undecided with its gain estimate above zero is measured
        again at once, a single time: more data for an open question, not a stale answer."""
        if self.config.revisit_after_s is None:
            return None
        now = self._clock()
        newest: dict[str, FrozenTrial] = {}  # config -> its newest measurement
        busy = unsafe_keys(self.records)
        for t in self.study.get_trials(deepcopy=False):  # in trial-number order
            key = config_key(t.params)
            if t.state in (TrialState.RUNNING, TrialState.WAITING):
                busy.add(key)
            elif t.state == TrialState.COMPLETE and t.value is not None:
                newest[key] = t
        attrs = self.records.attrs()
        # (again at once, value, measured at, config)
        stale: list[tuple[bool, float, float, dict[str, Any]]] = []
        for config in ({**params, **m.values} for m in moves):
            key = config_key(config)
            last = newest.get(key)
            if last is None or MEASURED_AT_ATTR not in last.user_attrs or key in busy:
                continue
            # as a baseline arm it may have been measured since its own trial
            at = max(float(last.user_attrs[MEASURED_AT_ATTR]), attrs.get(SEEN_PREFIX + key, 0))
            again = (float(last.user_attrs.get(UNDECIDED_GAIN_ATTR, 0.0)) > 0
                     and last.user_attrs.get(ORIGIN_ATTR, "").split(":")[0] != AGAIN)
            if again or now - at >= self.config.revisit_after_s:
                stale.append((again, float(last.value), at, config))  # type: ignore[arg-type]
        if not stale:
            return None
        again, value, at, config = max(stale, key=lambda item: item[:2])
        if again:
            return self._start(config, f"{AGAIN}: undecided when its time ran out "
                                       f"(objective {value:.4g})")
        return self._start(config, f"revisit: last measured {now - at:.0f} s ago "
                                   f"(objective {value:.4g})")

    def _start(self, config: dict[str, Any], why: str) -> Proposal:
        """A leased trial of ``config`` (enqueued, so its params are exactly these)."""
        self.study.enqueue_trial(config, user_attrs={ORIGIN_ATTR: why},
                                 skip_if_exists=False)
        while True:
            trial = self.study.ask(self.distributions)
            if config_key(trial.params) == config_key(config):
                return self._lease(trial)
            # a stale enqueued trial (a crash between enqueue and ask): not this baseline's
            self.records.set_trial_attr(trial.number, "seedance:fail_reason",
                                              "stale enqueued trial")
            self.records.set_trial_attr(trial.number, RETRY_ATTR, True)
            self.study.tell(trial, state=TrialState.FAIL)

    def moves_left(self, baseline: Mapping[str, Any]) -> int:
        """How many single moves from ``baseline`` were not tried yet (0: the search waits)."""
        params = {k: baseline[k] for k in self.distributions}
        seen = seen_keys(self.study, self.records)
        return sum(config_key({**params, **m.values}) not in seen
                   for m in self._moves(params))

    def propose_next(self, controller: RolloutController, job: str, *,
                     low_risk_only: bool = False) -> Change | None:
        """Propose the job's next trial (source "trial"): a single move from its baseline
        (``next_move``); once none is left, what the sampler asks for."""
        status = controller.registry.status(job)
        baseline = dict(status.baseline.values)
        proposal = self.next_move(baseline, status.knobs, low_risk_only=low_risk_only)
        if proposal is None and not low_risk_only and self.config.sample_after_moves:
            proposal = self._sampled(baseline)
        if proposal is None:
            if self._converged != config_key(baseline):
                self._converged = config_key(baseline)
                log.info("search %s: every single move from the baseline was tried; it "
                         "waits for a new baseline", self.config.study_name)
            return None
        try:
            return controller.propose(
                job, proposal.values, source="trial", by=f"optuna:{self.config.study_name}",
                reason=f"trial {proposal.number} of study {self.config.study_name}"
                       + (f" ({proposal.origin})" if proposal.origin else ""),
                meta={"study": self.config.study_name, "trial": proposal.number,
                      "origin": proposal.origin})
        except Exception as exc:
            self.fail(proposal.number, reason=f"could not propose: {exc}", unsafe=False)
            raise

    def _sampled(self, baseline: Mapping[str, Any]) -> Proposal | None:
        for _ in range(self.config.max_ask_attempts):
            proposal = self.ask()
            if proposal is None:
                return None
            if any(baseline.get(k) != v for k, v in proposal.values.items()):
                return proposal
            # the job runs it already: every change's baseline windows measure it
            self.fail(proposal.number, reason="the baseline; measured by baseline windows",
                      unsafe=False)
        return None

    def on_window(self, change: Change, comparison: Comparison) -> bool:
        number = self._number_of(change)
        if number is None:
            return False
        value = self._candidate_objective(change, comparison.gain)
        return False if value is None else self.report(number, comparison.pairs, value)

    def on_finished(self, change: Change) -> None:
        number = self._number_of(change)
        if number is None:
            return
        anchor = self._anchor(change)
        gain = float((change.comparison or {}).get("gain", math.nan))
        value = self._candidate_objective(change, gain, anchor)
        if change.state == "kept" and value is not None and anchor is not None:
            self._set_level(change.candidate, value / anchor[0])
        self._record_baseline(change, anchor)
        if change.windows:  # both arms were measured just now
            for values in (change.baseline, change.candidate):
                self.records.set_attr(SEEN_PREFIX + self._key(values), self._clock())
        last = self.records.trial(number)
        if last.state.is_finished():
            return
        rollback = change.plan.get("rollback")
        if change.state == "rolled_back" and (rollback in ("full", "local")
                                              or change.plan.get("job_failed")):
            self.fail(number, reason=f"guardrail: {change.plan.get('ended_because')}",
                      unsafe=True)
        elif change.state == "rolled_back" and change.plan.get("ended_because") == PRUNED:
            self.prune(number)
        elif change.state in ("kept", "rolled_back") and value is not None:
            # worth measuring again later: kept, or not answered in time (a measured
            # regression or a gain too small to want is settled)
            undecided = bool(change.plan.get("inconclusive"))
            self.tell(number, value, revisit=change.state == "kept" or undecided,
                      undecided_gain=gain if undecided else None)
        elif change.state == "failed":
            self.fail(number, reason=f"change {change.id} failed: the job died", unsafe=True)
        else:
            self.fail(number, reason=f"change {change.id} {change.state} before measuring",
                      unsafe=False)

    # ---- helpers -------------------------------------------------------------------------------

    def _answered(self, trial: Trial) -> bool:
        """Answer a repeat from the study instead of running it; True if told.

        Measured -> its value; pruned -> pruned; running, unsafe or failed (unless the failure
        is retryable: its lease expired) -> failed as a duplicate."""
        key = config_key(trial.params)
        same = [t for t in self.study.get_trials(deepcopy=False)
                if t.number != trial.number and t.params and config_key(t.params) == key]
        complete = [t for t in same if t.state == TrialState.COMPLETE]
        if complete:
            self.records.set_trial_attr(trial.number, "seedance:cached_from",
                                              complete[0].number)
            self.study.tell(trial, complete[0].value)
            return True
        if any(t.state == TrialState.PRUNED for t in same):  # measured hopeless
            self.study.tell(trial, state=TrialState.PRUNED)
            return True
        blocking = [t for t in same if t.state == TrialState.RUNNING or (
            t.state == TrialState.FAIL and not t.user_attrs.get(RETRY_ATTR))]
        if key in unsafe_keys(self.records) or blocking:
            self.records.set_trial_attr(trial.number, "seedance:fail_reason",
                "unsafe" if key in unsafe_keys(self.records) else
                f"duplicate of trial {blocking[0].number} ({blocking[0].state.name})")
            self.study.tell(trial, state=TrialState.FAIL)
            return True
        return False

    # ---- the drift-cancelled objective -------------------------------------------------------

    def _baseline_tokens_per_s(self, change: Change) -> float | None:
        measured = [w.tokens_per_s for w in change.windows if w.arm == "baseline"]
        return float(np.mean(measured)) if measured else None

    def _anchor(self, change: Change) -> tuple[float, float] | None:
        """(the study's reference tokens/s, the change's baseline level relative to it); None
        before the change measured a baseline window. The first change with one sets the
        reference (its baseline is level 1). A baseline's level is known when it is the first
        baseline or a kept candidate; else (an operator moved it) it is its windows' raw
        ratio to the reference."""
        measured = self._baseline_tokens_per_s(change)
        if measured is None:
            return None
        attrs = self.records.attrs()
        if REFERENCE_ATTR not in attrs:
            self.records.set_attr(REFERENCE_ATTR, measured)
            self._set_level(change.baseline, 1.0)
            return measured, 1.0
        reference = float(attrs[REFERENCE_ATTR])
        level = attrs.get(LEVEL_PREFIX + self._key(change.baseline))
        return reference, float(level) if level is not None else measured / reference

    def _candidate_objective(self, change: Change, gain: float,
                             anchor: tuple[float, float] | None = None) -> float | None:
        """Drift-cancelled tokens/s of the candidate; None before a pair was measured."""
        anchor = anchor or self._anchor(change)
        if anchor is None or not math.isfinite(gain):
            return None
        reference, level = anchor
        return reference * level * (1 + gain)

    def _set_level(self, values: Mapping[str, Any], level: float) -> None:
        self.records.set_attr(LEVEL_PREFIX + self._key(values), level)

    def _key(self, values: Mapping[str, Any]) -> str:
        return config_key({k: values[k] for k in self.distributions})

    def _record_baseline(self, change: Change, anchor: tuple[float, float] | None) -> None:
        """The baseline windows measured the baseline config: add it as a complete trial."""
        params = {k: change.baseline[k] for k in self.distributions}
        key = config_key(params)
        if anchor is None or any(config_key(t.params) == key for t in self.study.get_trials(
                deepcopy=False, states=(TrialState.COMPLETE,))):
            return
        reference, level = anchor
        self.study.add_trial(optuna.trial.create_trial(
            params=params, distributions=self.distributions, value=reference * level,
            user_attrs={ORIGIN_ATTR: f"baseline windows of change {change.id}",
                        MEASURED_AT_ATTR: self._clock()}))

    def _lease(self, trial: Trial) -> Proposal:
        self._mine[trial.number] = trial
        self.renew(trial.number)
        return Proposal(number=trial.number, values=dict(trial.params),
                        origin=str(trial.user_attrs.get(ORIGIN_ATTR, "")))

    def _untried(self) -> list[dict[str, Any]]:
        configs = grid(self.distributions) or []
        seen = seen_keys(self.study, self.records)
        return [c for c in configs if config_key(c) not in seen]

    def _trial(self, number: int) -> Trial:
        trial = self._mine.get(number)
        if trial is None:
            trial = self._mine[number] = Trial(self.study, self.records.trial_id(number))
        return trial

    def _number_of(self, change: Change) -> int | None:
        if change.source != "trial" or change.meta.get("study") != self.config.study_name:
            return None
        return int(change.meta["trial"])


