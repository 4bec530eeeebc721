"""The search's records go through Optuna's public storage API; this fails first if an Optuna
release changes what the tuner relies on (trial attributes by number from any process, study
system attributes, ids by name and number, ended trials staying ended)."""

from __future__ import annotations

import optuna
import pytest

from tuner._study_records import StudyRecords


def test_records_round_trip_on_a_real_study_by_trial_number(state_db_url: str) -> None:
    storage = optuna.storages.RDBStorage(state_db_url)
    study = optuna.create_study(study_name="records", storage=storage)
    trial = study.ask({"x": optuna.distributions.IntDistribution(0, 3)})

    records = StudyRecords(storage, "records")
    records.set_attr("seedance:unsafe:x=1", "the job died")
    records.set_trial_attr(trial.number, "seedance:fail_reason", "the job died")
    records.set_trial_system_attr(trial.number, "seedance:lease_until", 12.5)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        records.set_trial_attr(trial.number, "late", True)  # an ended trial stays as it ended

    # another process's view: a fresh storage on the same file
    again = StudyRecords(optuna.storages.RDBStorage(state_db_url), "records")
    assert again.attrs()["seedance:unsafe:x=1"] == "the job died"
    ended = again.trial(trial.number)
    assert ended.state == optuna.trial.TrialState.FAIL
    assert ended.user_attrs == {"seedance:fail_reason": "the job died"}
    assert ended.system_attrs["seedance:lease_until"] == 12.5
    assert again.trial_id(trial.number) == ended._trial_id  # the id Optuna itself uses


@pytest.mark.parametrize("storage_kind", ["rdb", "in-memory"])
def test_a_started_trial_runs_with_exactly_its_params_and_attributes(
        state_db_url: str, storage_kind: str) -> None:
    storage = (optuna.storages.RDBStorage(state_db_url) if storage_kind == "rdb"
               else optuna.storages.InMemoryStorage())
    study = optuna.create_study(study_name="started", storage=storage)
    space = {"x": optuna.distributions.IntDistribution(0, 3),
             "mode": optuna.distributions.CategoricalDistribution(["a", "b"])}
    study.enqueue_trial({"x": 0, "mode": "a"})  # someone else's trial comes first
    records = StudyRecords(storage, "started")
    numbers = [records.start_trial({"x": x, "mode": "b"}, space, user_attrs={"why": f"x={x}"},
                                   system_attrs={"seedance:lease_until_s": 99.0})
               for x in (2, 3)]
    assert numbers == [1, 2]
    for number, x in zip(numbers, (2, 3), strict=True):
        started = records.trial(number)
        assert started.state == optuna.trial.TrialState.RUNNING
        assert started.params == {"x": x, "mode": "b"}
        assert started.user_attrs == {"why": f"x={x}"}
        assert started.system_attrs["seedance:lease_until_s"] == 99.0
    study.tell(numbers[0], 1.5)
    assert records.trial(numbers[0]).value == 1.5
