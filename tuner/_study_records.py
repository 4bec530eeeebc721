"""The search's records in its Optuna study, through Optuna's storage API (one private call).

The tuner writes onto trials by number, whoever asked them (another sidecar sharing the study,
or this one before a restart): why one failed, when it was measured, its lease. It keeps
study-wide records (priors, barred configs, the reference rate) as system attributes. Optuna 5's
``Study`` can do neither without private attributes (``_storage``, ``_study_id``,
``_trial_id``); the storage (``optuna.storages.BaseStorage``) can, given ids the storage itself
resolves from the study's name and a trial's number. One call is private: ``start_trial`` on an
``RDBStorage`` (see there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState, create_trial

__all__ = ["StudyRecords"]

LEASE_ATTR = "seedance:lease_until_s"
UNSAFE_PREFIX = "seedance:unsafe:"
ORIGIN_ATTR = "seedance:origin"
RETRY_ATTR = "seedance:retryable"
MEASURED_AT_ATTR = "seedance:revisitable_measured_at_s"
"""When a config that may be measured again (kept, a baseline, inconclusive) was measured."""
UNDECIDED_GAIN_ATTR = "seedance:undecided_gain"
"""The gain estimate of a trial that ran out of time undecided."""
AGAIN = "again"
"""Origin of a trial that measures an undecided, promising one again at once."""
SEEN_PREFIX = "seedance:measured_at_s:"
"""Study attribute per config: when a change last measured it, in either arm."""
REFERENCE_ATTR = "seedance:reference"
PRIORS_ATTR = "seedance:priors"
LEVEL_PREFIX = "seedance:level:"


class StudyRecords:
    """One study's system attributes and its trials' attributes, by trial number."""

    def __init__(self, storage: BaseStorage, study_name: str) -> None:
        self._storage = storage
        self.study_id = storage.get_study_id_from_name(study_name)

    def attrs(self) -> dict[str, Any]:
        return self._storage.get_study_system_attrs(self.study_id)

    def set_attr(self, key: str, value: Any) -> None:
        self._storage.set_study_system_attr(self.study_id, key, value)

    def start_trial(self, params: Mapping[str, Any],
                    distributions: Mapping[str, BaseDistribution], *,
                    user_attrs: Mapping[str, Any], system_attrs: Mapping[str, Any]) -> int:
        """A RUNNING trial of exactly ``params``, written in one transaction; its number.
        Enqueue then ask wrote it in about three times the statements, each a round trip that
        waits on a busy database."""
        template = create_trial(
            state=TrialState.RUNNING, params=dict(params), distributions=dict(distributions),
            user_attrs=dict(user_attrs), system_attrs=dict(system_attrs))
        if isinstance(self._storage, RDBStorage):
            # the one private call (the one Optuna's own cache layer makes): it returns the
            # trial, number included; the public call returns the id, and reading the number
            # back is a whole trial read, six more statements
            return self._storage._create_new_trial(self.study_id, template).number
        return self._storage.get_trial_number_from_id(
            self._storage.create_new_trial(self.study_id, template))

    def trial_id(self, number: int) -> int:
        return self._storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def trial(self, number: int) -> FrozenTrial:
        return self._storage.get_trial(self.trial_id(number))

    def set_trial_attr(self, number: int, key: str, value: Any) -> None:
        """A user attribute; the trial must still be running (Optuna refuses ended ones)."""
        self._storage.set_trial_user_attr(self.trial_id(number), key, value)

    def set_trial_system_attr(self, number: int, key: str, value: Any) -> None:
        self._storage.set_trial_system_attr(self.trial_id(number), key, value)
