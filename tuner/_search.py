"""The search driver: which config a live job measures next, and what its changes tell the study.

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
  (``NeighbourhoodSampler`` around the best trial, then TPE).

The trials live in the study (``tuner._study_trials``: repeats answered from it, pruning, the
trial lease); a trial's value is the drift-cancelled objective (``tuner._objective``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import optuna
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from tuner._ceilings import above_ceiling
from tuner._change import PRUNED, STOPPED, Change
from tuner._knobs import KnobSpace
from tuner._objective import DriftCancelledObjective
from tuner._rollout import RolloutController
from tuner._sampler import seen_keys, unsafe_keys
from tuner._search_config import Proposal, SearchConfig
from tuner._space import Move, config_key, single_moves
from tuner._study_records import (
    AGAIN,
    LEASE_ATTR,
    MEASURED_AT_ATTR,
    ORIGIN_ATTR,
    PRIORS_ATTR,
    RETRY_ATTR,
    SEEN_PREFIX,
    UNDECIDED_GAIN_ATTR,
    UNDECIDED_PAIRS_ATTR,
)
from tuner._study_trials import StudyTrials
from tuner._windows import Comparison

log = logging.getLogger(__name__)


class SearchDriver(StudyTrials):
    """Ask-and-tell over ``space`` (only ``knobs`` if given) in an RDB study at ``storage_url``,
    proposing single moves from a job's baseline first (module docstring).

    Not thread-safe by itself: call it from the rollout thread (its ChangeObserver hooks run
    there too). State lives in the study, so a new driver on the same study continues it.
    """

    def __init__(self, space: KnobSpace, *, storage_url: str, config: SearchConfig,
                 knobs: Sequence[str] | None = None, clock: Callable[[], float] = time.time,
                 sampler: BaseSampler | None = None,
                 pruner: optuna.pruners.BasePruner | None = None,
                 ceilings: Callable[[], Mapping[str, float]] = dict) -> None:
        super().__init__(space, storage_url=storage_url, config=config, knobs=knobs,
                         clock=clock, sampler=sampler, pruner=pruner)
        self.ceilings = ceilings
        """The job's observed ceilings (``tuner._ceilings``), read at each proposal."""
        self._objective = DriftCancelledObjective(self.records, self._key)
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

    def priors(self, attrs: Mapping[str, Any] | None = None) -> list[Move]:
        """The policy engine's moves, from the study's attributes (``attrs`` if read already)."""
        attrs = self.records.attrs() if attrs is None else attrs
        return [Move(values=dict(m["values"]), expected_gain=m.get("expected_gain"),
                     why=str(m.get("why", "")), once=bool(m.get("once", False)))
                for m in attrs.get(PRIORS_ATTR, ())]

    # ---- the rollout controller's side ---------------------------------------------------------

    def next_move(self, baseline: Mapping[str, Any], knobs: KnobSpace, *,
                  low_risk_only: bool = False) -> Proposal | None:
        """The first single move from ``baseline`` not measured, running or unsafe (with
        ``low_risk_only``, not a high-risk one either), as a leased trial; None when every
        single move from it was tried. Under the study's lock: chosen and started by one
        sidecar at a time."""
        params = {k: baseline[k] for k in self.distributions}
        with self._locks.held(self._lock_name):
            # the study's attributes and trials, read once: each read is statements that
            # wait their turn on a busy database, with the lock held
            attrs = self.records.attrs()
            trials = self.study.get_trials(deepcopy=False)
            moves = [m for m in self._moves(params, attrs=attrs, trials=trials)
                     if not (low_risk_only and knobs.risk_of(m.values) == "high")]
            reaped = set(self.reap(trials))
            seen = seen_keys([t for t in trials if t.number not in reaped], self.records,
                             attrs=attrs)
            for move in moves:
                config = {**params, **move.values}
                if config_key(config) not in seen:
                    return self._start(config, move.why)
            return self._revisit(params, moves)

    def _moves(self, params: Mapping[str, Any], *, attrs: Mapping[str, Any] | None = None,
               trials: Sequence[FrozenTrial] | None = None) -> list[Move]:
        """``single_moves`` less those above a ceiling the job's telemetry shows, and less the
        priors to try ``once`` that a trial tried already (its origin is their ``why``); the
        study's ``attrs`` and ``trials`` when the caller read them already."""
        ceilings = self.ceilings()
        priors = self.priors(attrs)
        if any(p.once for p in priors):
            if trials is None:
                trials = self.study.get_trials(deepcopy=False)
            tried = {t.user_attrs.get(ORIGIN_ATTR) for t in trials
                     if t.state != TrialState.WAITING
                     and not (t.state == TrialState.FAIL and t.user_attrs.get(RETRY_ATTR))}
            priors = [p for p in priors if not (p.once and p.why in tried)]
        return [m for m in single_moves(params, self.distributions, priors)
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
        ended: dict[str, FrozenTrial] = {}  # config -> its newest trial that ended for good
        busy = unsafe_keys(self.records)
        for t in self.study.get_trials(deepcopy=False):  # in trial-number order
            key = config_key(t.params)
            if t.state in (TrialState.RUNNING, TrialState.WAITING):
                busy.add(key)
            elif t.state == TrialState.COMPLETE and t.value is not None:
                newest[key] = t
            if t.state.is_finished() and not t.user_attrs.get(RETRY_ATTR):
                ended[key] = t
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
            # once: not when it is an again trial, nor when one ran since (pruned, failed)
            again = (float(last.user_attrs.get(UNDECIDED_GAIN_ATTR, 0.0)) > 0
                     and last.user_attrs.get(ORIGIN_ATTR, "").split(":")[0] != AGAIN
                     and ended[key] is last)
            if again or now - at >= self.config.revisit_after_s:
                stale.append((again, float(last.value), at, config))  # type: ignore[arg-type]
        if not stale:
            return None
        again, value, at, config = max(stale, key=lambda item: item[:2])
        if again:
            earlier = newest[config_key(config)].user_attrs.get(UNDECIDED_PAIRS_ATTR)
            return self._start(config, f"{AGAIN}: undecided when its time ran out "
                                       f"(objective {value:.4g})", continues=earlier)
        return self._start(config, f"revisit: last measured {now - at:.0f} s ago "
                                   f"(objective {value:.4g})")

    def _start(self, config: dict[str, Any], why: str,
               continues: Mapping[str, Any] | None = None) -> Proposal:
        """A leased trial of ``config``, started RUNNING with its lease (the caller holds the
        study's lock: nobody else starts this config meanwhile)."""
        now = self._clock()
        number = self.records.start_trial(
            config, {k: self.distributions[k] for k in config},
            user_attrs={ORIGIN_ATTR: why},
            system_attrs={LEASE_ATTR: now + self.config.trial_lease_s})
        self._mine[number] = None  # its Trial is made when first reported to
        self._renewed[number] = now
        return Proposal(number=number, values=dict(config), origin=why, continues=continues)

    def moves_left(self, baseline: Mapping[str, Any]) -> int:
        """How many single moves from ``baseline`` were not tried yet (0: the search waits)."""
        params = {k: baseline[k] for k in self.distributions}
        seen = seen_keys(self.study.get_trials(deepcopy=False), self.records)
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
                      "origin": proposal.origin,
                      **({"continues": proposal.continues} if proposal.continues else {})})
        except Exception as exc:
            # never renewed from now on: if the state DB cannot fail it now, its lease
            # expires and the next reap fails it, free to be tried again
            self._mine.pop(proposal.number, None)
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
        value = self._objective.candidate(change, comparison.gain)
        if value is None:
            return False
        pruned = self.report(number, comparison.pairs, value)
        # a trial that continues an undecided one answers an open question: the median of
        # other trials' first pairs does not cut it short
        return pruned and not change.continued_ratios

    def on_finished(self, change: Change) -> None:
        number = self._number_of(change)
        if number is None:
            return
        anchor = self._objective.anchor(change)
        gain = float((change.comparison or {}).get("gain", math.nan))
        value = self._objective.candidate(change, gain, anchor)
        if change.state == "kept" and value is not None and anchor is not None:
            self._objective.set_level(change.candidate, value / anchor[0])
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
        elif change.plan.get("ended_because") == STOPPED:  # rolled back or withdrawn
            self.fail(number, reason=STOPPED, unsafe=False, retry=True)
        elif change.state in ("kept", "rolled_back") and value is not None:
            # worth measuring again later: kept, or not answered in time (a measured
            # regression or a gain too small to want is settled)
            undecided = bool(change.plan.get("inconclusive"))
            self.tell(number, value, revisit=change.state == "kept" or undecided,
                      undecided_gain=gain if undecided else None,
                      undecided_pairs={
                          "change": change.id, "baseline": dict(change.baseline),
                          "candidate": change.candidate,
                          "pair_ratios": list((change.comparison or {}).get("pair_ratios", ()))
                      } if undecided else None)
        elif change.state == "failed":
            self.fail(number, reason=f"change {change.id} failed: the job died", unsafe=True)
        else:
            self.fail(number, reason=f"change {change.id} {change.state} before measuring",
                      unsafe=False)

    # ---- helpers -------------------------------------------------------------------------------

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

    def _number_of(self, change: Change) -> int | None:
        if change.source != "trial" or change.meta.get("study") != self.config.study_name:
            return None
        return int(change.meta["trial"])
