"""The search's records go through Optuna's public storage API; this fails first if an Optuna
release changes what the tuner relies on (trial attributes by number from any process, study
system attributes, ids by name and number, ended trials staying ended)."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.trial import TrialState, create_trial
from sqlalchemy import event

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


def _statements(engine: Any) -> list[str]:
    """Every statement ``engine`` runs from now on (a list that grows)."""
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute",
                 lambda _conn, _cursor, statement, *_rest: seen.append(statement))
    return seen


def test_a_started_trial_is_what_optunas_own_creation_writes_in_a_few_statements(
        state_db_url: str) -> None:
    # 8 knobs, as a real job's space has: Optuna writes each param with two reads before it
    storage = optuna.storages.RDBStorage(state_db_url)
    optuna.create_study(study_name="same", storage=storage)
    space: dict[str, optuna.distributions.BaseDistribution] = {
        **{f"k{i}": optuna.distributions.IntDistribution(0, 8) for i in range(4)},
        "lr": optuna.distributions.FloatDistribution(1e-5, 1e-1, log=True),
        **{f"c{i}": optuna.distributions.CategoricalDistribution(["a", "b", None])
           for i in range(3)}}
    params = {"k0": 1, "k1": 2, "k2": 3, "k3": 8, "lr": 3e-4, "c0": "b", "c1": None, "c2": "a"}
    user, system = {"why": "a move", "n": [1, 2]}, {"seedance:lease_until_s": 99.5}
    records = StudyRecords(storage, "same")
    theirs = storage.get_trial(storage.create_new_trial(records.study_id, create_trial(
        state=TrialState.RUNNING, params=params, distributions=space, user_attrs=user,
        system_attrs=system)))

    statements = _statements(storage.engine)
    number = records.start_trial(params, space, user_attrs=user, system_attrs=system)
    written = len(statements)
    ours = records.trial(number)

    assert (ours.number, theirs.number) == (1, 0)
    for field in ("state", "params", "distributions", "user_attrs", "system_attrs",
                  "intermediate_values", "values"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.datetime_start is not None and theirs.datetime_start is not None
    assert abs((ours.datetime_start - theirs.datetime_start).total_seconds()) < 60
    assert written <= 7, statements  # Optuna's own: 2 per param and attribute, and then some


def test_a_started_trial_with_a_distribution_the_study_cannot_take_writes_nothing(
        state_db_url: str) -> None:
    storage = optuna.storages.RDBStorage(state_db_url)
    study = optuna.create_study(study_name="clash", storage=storage)
    study.enqueue_trial({"x": 1})
    study.ask({"x": optuna.distributions.IntDistribution(0, 3)})
    records = StudyRecords(storage, "clash")
    with pytest.raises(ValueError, match="distribution"):  # as Optuna's own creation refuses it
        records.start_trial({"x": "a"},
                            {"x": optuna.distributions.CategoricalDistribution(["a", "b"])},
                            user_attrs={}, system_attrs={})
    assert [t.number for t in study.get_trials()] == [0]


@pytest.mark.parametrize("storage_kind", ["rdb", "in-memory"])
def test_a_completed_trial_is_what_study_tell_writes_in_a_few_statements(
        state_db_url: str, storage_kind: str) -> None:
    storage = (optuna.storages.RDBStorage(state_db_url) if storage_kind == "rdb"
               else optuna.storages.InMemoryStorage())
    study = optuna.create_study(study_name="told", storage=storage, direction="maximize")
    space = {"x": optuna.distributions.IntDistribution(0, 3)}
    records = StudyRecords(storage, "told")
    attrs = {"seedance:revisitable_measured_at_s": 5.5, "pairs": {"ratios": [1.1, 0.9]}}
    theirs, ours = (records.start_trial({"x": x}, space, user_attrs={"why": "a move"},
                                        system_attrs={}) for x in (1, 2))
    for key, value in attrs.items():
        records.set_trial_attr(theirs, key, value)
    study.tell(theirs, 104.25)

    statements = _statements(storage.engine) if storage_kind == "rdb" else []
    assert records.complete_trial(ours, 104.25, user_attrs=attrs)
    written = len(statements)
    told, completed = records.trial(theirs), records.trial(ours)
    for field in ("state", "values", "user_attrs", "system_attrs", "intermediate_values"):
        assert getattr(completed, field) == getattr(told, field), field
    assert completed.datetime_complete is not None and told.datetime_complete is not None
    assert abs((completed.datetime_complete - told.datetime_complete).total_seconds()) < 60
    assert study.best_trial.number in (theirs, ours)  # Optuna reads it as its own
    assert written <= 5, statements  # Study.tell: 18, and 3 more per attribute

    # an ended trial stays as it ended: nothing is written
    assert not records.complete_trial(ours, 1.0, user_attrs={"late": True})
    assert records.trial(ours).values == [104.25]
    assert "late" not in records.trial(ours).user_attrs
