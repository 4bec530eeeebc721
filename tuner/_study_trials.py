"""The search's trials in its Optuna study: ask and tell, repeats answered, trials leased.

- no repeats: a config already measured is answered from the study (the trial is told the
  cached value, or pruned again if it was pruned, never re-run); a config that killed its job
  is unsafe and never proposed again; a failed trial is not retried unless its lease expired
  (its sidecar died: the config is not to blame);
- pruning: each measured pair reports an intermediate value; a median pruner, from the third
  pair on, stops trials doing worse than the median of earlier trials at the same pair.

Optuna's heartbeat does not cover ask-and-tell, so trials hold our own lease (a trial system
attribute, renewed by ``heartbeat``): ``reap`` fails (TrialState.FAIL) every RUNNING trial whose
lease expired, so a trial whose sidecar died is never left RUNNING.

Several sidecars may share a study (one PostgreSQL). Choosing a config (is it measured or
running yet?) then starting it spans many statements, and Optuna's ``ask`` takes the oldest
WAITING trial, whoever enqueued it; so both run under the study's lock (``StateLocks``), one
sidecar at a time: two sidecars never start the same config. A single move starts its trial
RUNNING in one storage call (``StudyRecords.start_trial``); the sampler's trials are enqueued
and asked.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.samplers import BaseSampler, TPESampler
from optuna.trial import FrozenTrial, Trial, TrialState

from collectors import StateLocks, state_engine_options
from tuner._knobs import KnobSpace
from tuner._sampler import NeighbourhoodSampler, seen_keys, unsafe_keys
from tuner._search_config import Proposal, SearchConfig
from tuner._space import config_key, grid, search_space
from tuner._study_records import (
    LEASE_ATTR,
    MEASURED_AT_ATTR,
    ORIGIN_ATTR,
    RETRY_ATTR,
    UNDECIDED_GAIN_ATTR,
    UNDECIDED_PAIRS_ATTR,
    UNSAFE_PREFIX,
    StudyRecords,
)

log = logging.getLogger(__name__)


class StudyTrials:
    """Ask-and-tell over ``space`` (only ``knobs`` if given) in an RDB study at ``storage_url``.

    State lives in the study, so a new one on the same study continues it; ``SearchDriver``
    decides which configs to measure on top of it.
    """

    def __init__(self, space: KnobSpace, *, storage_url: str, config: SearchConfig,
                 knobs: Sequence[str] | None = None, clock: Callable[[], float] = time.time,
                 sampler: BaseSampler | None = None,
                 pruner: optuna.pruners.BasePruner | None = None) -> None:
        self.config = config
        self.distributions = search_space(space, knobs)
        self._clock = clock
        self._storage = optuna.storages.RDBStorage(
            storage_url, engine_kwargs=state_engine_options(storage_url))
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
        self._own_sampler = sampler is None
        """The default samplers (no constraints): their ``after_trial`` keeps nothing, so a
        trial may be completed without ``Study.tell`` reading it twice."""
        self._mine: dict[int, Trial | None] = {}
        """The trials this driver runs (their Trial, once one was needed)."""
        self._renewed: dict[int, float] = {}
        """When this driver last wrote the lease of each of its trials (clock seconds)."""
        self._locks = StateLocks(storage_url)
        self._lock_name = f"seedance:study:{config.study_name}"

    @property
    def lock_waits(self) -> int:
        """How many times this driver waited for another holding the study's lock."""
        return self._locks.waits

    def close(self) -> None:
        """Release the lock's connections; a second call is harmless."""
        self._locks.close()

    # ---- ask / tell ----------------------------------------------------------------------------

    def ask(self) -> Proposal | None:
        """The next config to measure, never one measured, running or unsafe; None when the
        space is exhausted. Repeats the sampler offers are answered from the study's cache."""
        with self._locks.held(self._lock_name):
            return self._ask()

    def _ask(self) -> Proposal | None:
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
             undecided_gain: float | None = None,
             undecided_pairs: Mapping[str, Any] | None = None) -> None:
        """Complete the trial (an ended one stays as it ended); with ``revisit`` its config
        may be measured again once stale (``SearchConfig.revisit_after_s``); an
        ``undecided_gain`` above zero (it ran out of time with the estimate on the candidate's
        side) may be measured again at once, continuing its ``undecided_pairs``
        (``UNDECIDED_PAIRS_ATTR``)."""
        attrs: dict[str, Any] = {}
        if revisit:
            attrs[MEASURED_AT_ATTR] = self._clock()
        if undecided_gain is not None and math.isfinite(undecided_gain):
            attrs[UNDECIDED_GAIN_ATTR] = undecided_gain
            if undecided_pairs is not None:
                attrs[UNDECIDED_PAIRS_ATTR] = dict(undecided_pairs)
        if self._own_sampler and math.isfinite(value):
            # the default samplers' after_trial does nothing: 5 statements, not 18 and more
            self.records.complete_trial(number, value, user_attrs=attrs)
        else:
            for key, attr in attrs.items():
                self.records.set_trial_attr(number, key, attr)
            self.study.tell(number, value, skip_if_finished=True)
        self._mine.pop(number, None)

    def prune(self, number: int) -> None:
        self.study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
        self._mine.pop(number, None)

    def fail(self, number: int, *, reason: str, unsafe: bool, retry: bool = False) -> None:
        """Fail the trial; ``unsafe`` (its job died) bars its config from ever being proposed,
        ``retry`` (nothing was learned about it) lets it be proposed again."""
        frozen = self.records.trial(number)
        self.records.set_trial_attr(number, "seedance:fail_reason", reason)
        if retry:
            self.records.set_trial_attr(number, RETRY_ATTR, True)
        if unsafe:
            self.mark_unsafe(frozen.params, reason=reason)
        self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        self._mine.pop(number, None)

    def release(self, *, reason: str) -> list[int]:
        """Fail every trial this driver still runs, each free to be tried again (the search
        stops: nothing was learned about them); returns their numbers."""
        released = []
        for number in list(self._mine):
            self.fail(number, reason=reason, unsafe=False, retry=True)
            released.append(number)
        return released

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
        now = self._clock()
        self.records.set_trial_system_attr(number, LEASE_ATTR, now + self.config.trial_lease_s)
        self._renewed[number] = now

    def heartbeat(self) -> None:
        """Renew the lease of every trial this driver runs once a quarter of it has passed
        (call it from the rollout loop, every second): each renewal is a write to the shared
        state DB, and a fleet's sidecars made one a second each for a 15-minute lease. Three
        quarters of a lease are always left, as before, so nothing is reaped sooner."""
        now = self._clock()
        self._renewed = {n: at for n, at in self._renewed.items() if n in self._mine}
        for number in list(self._mine):
            if now - self._renewed.get(number, -math.inf) >= self.config.trial_lease_s / 4:
                self.renew(number)

    def reap(self, trials: Sequence[FrozenTrial] | None = None) -> list[int]:
        """Fail every RUNNING trial whose lease expired (its sidecar or driver died), of the
        study's ``trials`` when the caller read them already. Returns their numbers."""
        now = self._clock()
        failed = []
        running = (self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if trials is None else [t for t in trials if t.state == TrialState.RUNNING])
        for t in running:
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

    def _lease(self, trial: Trial) -> Proposal:
        self._mine[trial.number] = trial
        self.renew(trial.number)
        return Proposal(number=trial.number, values=dict(trial.params),
                        origin=str(trial.user_attrs.get(ORIGIN_ATTR, "")))

    def _untried(self) -> list[dict[str, Any]]:
        configs = grid(self.distributions) or []
        seen = seen_keys(self.study.get_trials(deepcopy=False), self.records)
        return [c for c in configs if config_key(c) not in seen]

    def _trial(self, number: int) -> Trial:
        trial = self._mine.get(number)
        if trial is None:
            trial = self._mine[number] = Trial(self.study, self.records.trial_id(number))
        return trial

    def _key(self, values: Mapping[str, Any]) -> str:
        return config_key({k: values[k] for k in self.distributions})
