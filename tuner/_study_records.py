"""The search's records in its Optuna study, through Optuna's storage API (one private call).

The tuner writes onto trials by number, whoever asked them (another sidecar sharing the study,
or this one before a restart): why one failed, when it was measured, its lease. It keeps
study-wide records (priors, barred configs, the reference rate) as system attributes. Optuna 5's
``Study`` can do neither without private attributes (``_storage``, ``_study_id``,
``_trial_id``); the storage (``optuna.storages.BaseStorage``) can, given ids the storage itself
resolves from the study's name and a trial's number. Two writes are not through that API:
``start_trial`` and ``complete_trial`` on an ``RDBStorage`` write with Optuna's own ORM models
(``optuna.storages._rdb.models``), each in one transaction (see there);
``tests/tuner/test_study_records.py`` checks they write what Optuna's own trial creation and
``Study.tell`` write, so a release that changes the schema fails there first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    check_distribution_compatibility,
    distribution_to_json,
    json_to_distribution,
)
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages._rdb import models
from optuna.trial import FrozenTrial, TrialState, create_trial
from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

__all__ = ["StudyRecords"]

LEASE_ATTR = "seedance:lease_until_s"
UNSAFE_PREFIX = "seedance:unsafe:"
ORIGIN_ATTR = "seedance:origin"
RETRY_ATTR = "seedance:retryable"
MEASURED_AT_ATTR = "seedance:revisitable_measured_at_s"
"""When a config that may be measured again (kept, a baseline, inconclusive) was measured."""
UNDECIDED_GAIN_ATTR = "seedance:undecided_gain"
"""The gain estimate of a trial that ran out of time undecided."""
UNDECIDED_PAIRS_ATTR = "seedance:undecided_pairs"
"""Its change's baseline, candidate and pair ratios: the trial that measures it again at once
continues those pairs (``Change.continued_ratios``)."""
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
        """A RUNNING trial of exactly ``params``, written in one transaction; its number."""
        if isinstance(self._storage, RDBStorage):
            return _insert_running_trial(self._storage, self.study_id, params, distributions,
                                         user_attrs=user_attrs, system_attrs=system_attrs)
        template = create_trial(
            state=TrialState.RUNNING, params=dict(params), distributions=dict(distributions),
            user_attrs=dict(user_attrs), system_attrs=dict(system_attrs))
        return self._storage.get_trial_number_from_id(
            self._storage.create_new_trial(self.study_id, template))

    def complete_trial(self, number: int, value: float, *,
                       user_attrs: Mapping[str, Any]) -> bool:
        """Set ``user_attrs`` and complete the trial with ``value``, in one transaction on an
        ``RDBStorage`` (see ``_complete_running_trial``); False, writing nothing, when it had
        ended already. What ``Study.tell`` stores, less its sampler hook: the caller calls it
        with ``Study.tell`` when its sampler has one that does something."""
        if isinstance(self._storage, RDBStorage):
            return _complete_running_trial(self._storage, self.study_id, number, value,
                                           user_attrs=user_attrs)
        trial_id = self.trial_id(number)
        try:
            for key, attr in user_attrs.items():
                self._storage.set_trial_user_attr(trial_id, key, attr)
            self._storage.set_trial_state_values(trial_id, TrialState.COMPLETE, [value])
        except UpdateFinishedTrialError:
            return False
        return True

    def trial_id(self, number: int) -> int:
        return self._storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def trial(self, number: int) -> FrozenTrial:
        return self._storage.get_trial(self.trial_id(number))

    def set_trial_attr(self, number: int, key: str, value: Any) -> None:
        """A user attribute; the trial must still be running (Optuna refuses ended ones)."""
        self._storage.set_trial_user_attr(self.trial_id(number), key, value)

    def set_trial_system_attr(self, number: int, key: str, value: Any) -> None:
        self._storage.set_trial_system_attr(self.trial_id(number), key, value)


def _insert_running_trial(storage: RDBStorage, study_id: int, params: Mapping[str, Any],
                          distributions: Mapping[str, BaseDistribution], *,
                          user_attrs: Mapping[str, Any], system_attrs: Mapping[str, Any]) -> int:
    """What ``RDBStorage.create_new_trial`` writes for a RUNNING template, in 7 statements
    whatever the number of params and attributes: Optuna's own writes each param and attribute
    on its own, with a read of the trial before each (17 statements for 3 knobs and 2
    attributes, 34 for 8 knobs and 3), and each statement is a round trip that waits its turn
    on a busy database while the study's lock is held. The same checks: the study's row
    locked for the number, as Optuna locks it (trial numbers count the study's trials), and
    each param's distribution compatible with the ones the study already used."""
    trial_table, param_table = models.TrialModel, models.TrialParamModel
    with Session(storage.engine) as session, session.begin():
        if session.scalar(select(models.StudyModel.study_id)
                          .where(models.StudyModel.study_id == study_id)
                          .with_for_update()) is None:
            raise KeyError(f"no study with id {study_id}")
        used = session.execute(
            select(param_table.param_name, param_table.distribution_json).distinct()
            .join(trial_table, param_table.trial_id == trial_table.trial_id)
            .where(trial_table.study_id == study_id, param_table.param_name.in_(list(params))))
        for name, known in used:
            check_distribution_compatibility(json_to_distribution(known), distributions[name])
        number = session.scalar(select(func.count()).select_from(trial_table)
                                .where(trial_table.study_id == study_id)) or 0
        trial = trial_table(study_id=study_id, number=number, state=TrialState.RUNNING,
                            datetime_start=datetime.now())  # the model converts the time
        session.add(trial)
        session.flush()
        rows = {
            param_table: [{"trial_id": trial.trial_id, "param_name": name,
                           "param_value": distributions[name].to_internal_repr(value),
                           "distribution_json": distribution_to_json(distributions[name])}
                          for name, value in params.items()],
            models.TrialUserAttributeModel: [
                {"trial_id": trial.trial_id, "key": k, "value_json": json.dumps(v)}
                for k, v in user_attrs.items()],
            models.TrialSystemAttributeModel: [
                {"trial_id": trial.trial_id, "key": k, "value_json": json.dumps(v)}
                for k, v in system_attrs.items()]}
        for model, values in rows.items():
            if values:
                session.execute(insert(model), values)  # one executemany per table
        return number


def _complete_running_trial(storage: RDBStorage, study_id: int, number: int, value: float, *,
                            user_attrs: Mapping[str, Any]) -> bool:
    """What ``RDBStorage.set_trial_user_attr`` and ``set_trial_state_values`` write, in 5
    statements: ``Study.tell`` reads the whole trial before it writes (7 statements) and again
    after, for a return value nobody reads (7 more), each attribute costs 3, and on a busy
    shared database each is a round trip that waits its turn. The same checks: the trial's
    row locked, and an ended trial left as it ended."""
    trial_table, attr_table = models.TrialModel, models.TrialUserAttributeModel
    with Session(storage.engine) as session, session.begin():
        trial = session.scalars(
            select(trial_table)
            .where(trial_table.study_id == study_id, trial_table.number == number)
            .with_for_update()).one_or_none()
        if trial is None:
            raise KeyError(f"no trial {number} in study {study_id}")
        if trial.state.is_finished():
            return False
        if user_attrs:
            session.execute(delete(attr_table).where(attr_table.trial_id == trial.trial_id,
                                                     attr_table.key.in_(list(user_attrs))))
            session.execute(insert(attr_table), [
                {"trial_id": trial.trial_id, "key": k, "value_json": json.dumps(v)}
                for k, v in user_attrs.items()])
        stored, value_type = models.TrialValueModel.value_to_stored_repr(value)
        session.execute(insert(models.TrialValueModel), [
            {"trial_id": trial.trial_id, "objective": 0, "value": stored,
             "value_type": value_type}])
        trial.state = TrialState.COMPLETE
        trial.datetime_complete = datetime.now()  # the model converts the time
    return True
