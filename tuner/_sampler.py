"""The study-backed sampler: the untried neighbours of the best trial first, never a config
measured, running or barred as unsafe."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, TPESampler
from optuna.storages import BaseStorage
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from tuner._space import config_key, neighbours
from tuner._study_records import RETRY_ATTR, UNSAFE_PREFIX, StudyRecords


def seen_keys(trials: Sequence[FrozenTrial], records: StudyRecords, *,
              attrs: Mapping[str, Any] | None = None) -> set[str]:
    """Configs not to propose, of the study's ``trials``: measured, pruned, running, failed
    (unless retryable), unsafe (from the study's ``attrs`` if read already)."""
    keys = {config_key(t.params) for t in trials
            if t.state != TrialState.WAITING and t.params
            and not (t.state == TrialState.FAIL and t.user_attrs.get(RETRY_ATTR))}
    return keys | unsafe_keys(records, attrs=attrs)


def unsafe_keys(records: StudyRecords, *, attrs: Mapping[str, Any] | None = None) -> set[str]:
    attrs = records.attrs() if attrs is None else attrs
    return {k[len(UNSAFE_PREFIX):] for k in attrs if k.startswith(UNSAFE_PREFIX)}


class NeighbourhoodSampler(BaseSampler):
    """A prior for small, costly spaces: the untried neighbours of the best complete trial
    first, then ``fallback`` (TPE by default). Enqueued trials keep their fixed params.

    Stateless between calls: everything it needs is read from the study, so several
    sidecars sharing one study sample consistently.
    """

    def __init__(self, space: Mapping[str, BaseDistribution], *, storage: BaseStorage,
                 fallback: BaseSampler | None = None, seed: int | None = None) -> None:
        self.space = dict(space)
        self.storage = storage
        """The study's storage: where the configs barred from proposal are recorded."""
        self.fallback = fallback or TPESampler(seed=seed, n_startup_trials=2)

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return dict(self.space)

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if set(self.space) <= set(t.params)]
        if not complete or not search_space:
            return {}
        maximize = study.direction == StudyDirection.MAXIMIZE
        best = (max if maximize else min)(complete, key=lambda t: t.value)  # type: ignore
        seen = seen_keys(study.get_trials(deepcopy=False),
                         StudyRecords(self.storage, study.study_name))
        for candidate in neighbours({k: best.params[k] for k in self.space}, self.space):
            if config_key(candidate) not in seen:
                return candidate
        return {}

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self.fallback.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self.fallback.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self.fallback.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.fallback.reseed_rng()
