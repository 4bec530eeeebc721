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
