from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from collectors._points import Point
from collectors._store import TimeSeriesStore
from policies._state_db import sqlite_url
from tests.tuner._simjob import KNOBS, SimJob
from tuner._change import STOPPED
from tuner._knobs import KnobSpace
from tuner._lease import JobRegistry
from tuner._rollout import RolloutController
from tuner._search import SearchDriver
from tuner._search_config import SearchConfig
from tuner._space import Move, config_key, neighbours, search_space, single_moves
from tuner._study_records import LEASE_ATTR
from tuner._verdict import RolloutConfig
from tuner._windows import MeasureConfig

SPACE = KnobSpace.of(KNOBS)
TUNED = ("micro_batch", "precision")  # 4 x 2 = 8 configs


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def quiet_optuna() -> Iterator[None]:
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    optuna.logging.set_verbosity(level)


def driver(url: str, clock: Clock | None = None, **kwargs: Any) -> SearchDriver:
    """A driver on the study "s" in the state DB at ``url`` (tests that take ``state_db_url``
    run on SQLite and on PostgreSQL)."""
    config = SearchConfig(study_name="s", seed=3, trial_lease_s=60.0, **kwargs)
    return SearchDriver(SPACE, storage_url=url, config=config,
                        knobs=TUNED, clock=clock or Clock())


def throughput(values: dict[str, Any]) -> float:
    return {1: 100.0, 2: 180.0, 4: 260.0, 8: 240.0}[values["micro_batch"]] * (
        1.2 if values["precision"] == "bf16" else 1.0)


def test_search_space_and_neighbours_follow_the_knobs() -> None:
    space = search_space(SPACE, ["micro_batch", "prefetch", "precision"])
    assert isinstance(space["prefetch"], optuna.distributions.IntDistribution)
    near = list(neighbours({"micro_batch": 2, "prefetch": 1, "precision": "fp32"}, space))
    assert {"micro_batch": 4, "prefetch": 1, "precision": "fp32"} in near
    assert {"micro_batch": 1, "prefetch": 1, "precision": "fp32"} in near
    assert {"micro_batch": 2, "prefetch": 2, "precision": "fp32"} in near
    assert {"micro_batch": 2, "prefetch": 1, "precision": "bf16"} in near
    assert len(near) == 4  # prefetch 0 is outside the domain


def test_never_repeats_a_config_and_stops_when_exhausted(state_db_url: str) -> None:
    search = driver(state_db_url)
    seen = []
    while (proposal := search.ask()) is not None:
        seen.append(config_key(proposal.values))
        search.tell(proposal.number, throughput(proposal.values))
        assert len(seen) <= 8
    assert len(seen) == len(set(seen)) == 8
    best = search.best()
    assert best is not None and best[0] == {"micro_batch": 4, "precision": "bf16"}


def test_repeats_are_answered_from_the_cache(state_db_url: str) -> None:
    search = driver(state_db_url)
    first = search.ask()
    assert first is not None
    search.tell(first.number, 123.0)
    search.study.enqueue_trial(first.values)  # the sampler asks for the same config again
    second = search.ask()
    assert second is not None and second.values != first.values
    cached = [t for t in search.study.trials if "seedance:cached_from" in t.user_attrs]
    assert len(cached) == 1 and cached[0].value == 123.0


def test_priors_come_first_by_expected_gain_then_one_knob_moves(state_db_url: str) -> None:
    search = driver(state_db_url)
    baseline = {"micro_batch": 8, "precision": "fp32"}
    assert search.add_priors([Move(values={"micro_batch": 4}, expected_gain=0.1),
                        Move(values={"precision": "bf16"}, expected_gain=0.4),
                        Move(values={"precision": "bf16"}, expected_gain=0.2)]) == 2
    asked = []
    while (proposal := search.next_move(baseline, SPACE)) is not None:
        asked.append(proposal.values)
        search.tell(proposal.number, throughput(proposal.values))
    # by expected gain; micro_batch 2 is not one step from 8, so it is never tried from here
    assert asked == [{**baseline, "precision": "bf16"}, {**baseline, "micro_batch": 4}]
    kept = {**baseline, "micro_batch": 4}  # once 4 is kept, 2 is one step away
    proposal = search.next_move(kept, SPACE)
    assert proposal is not None and proposal.values == {**kept, "precision": "bf16"}


def test_single_moves_change_one_knob_and_try_what_usually_pays_first() -> None:
    space = search_space(SPACE, ["micro_batch", "prefetch", "precision"])
    baseline = {"micro_batch": 4, "prefetch": 4, "precision": "fp32"}
    moves = [m.values for m in single_moves(baseline, space)]
    assert all(len(m) == 1 for m in moves)
    assert moves[0] == {"precision": "bf16"}  # a lower precision first
    assert moves.index({"micro_batch": 8}) < moves.index({"micro_batch": 2})  # bigger first
    assert {"micro_batch": 1} not in moves  # far from the current micro-batch: never a step


def test_wide_numeric_knobs_move_by_doubling_not_by_a_tenth_of_the_range() -> None:
    from tuner.prefix_cache import PREFIX_CACHE_KNOBS
    space = search_space(KnobSpace.of(PREFIX_CACHE_KNOBS))
    values = KnobSpace.of(PREFIX_CACHE_KNOBS).defaults()
    moved = {k: v[k] for v in neighbours(values, space) for k in v if v[k] != values[k]}
    assert moved["prefix_cache.capacity_mib"] in (512.0, 128.0)
    assert moved["prefix_cache.prewarm_top_k"] == 1  # from 0, the smallest step up


def test_a_high_risk_move_is_skipped_when_only_low_risk_ones_may_run(tmp_path: Path) -> None:
    from tuner._knobs import Knob
    space = KnobSpace.of((Knob(name="micro_batch", default=8, choices=(1, 2, 4, 8)),
                          Knob(name="precision", default="fp32",
                               choices=("fp32", "bf16", "fp16"), risky_values=("fp16",))))
    search = SearchDriver(space, storage_url=sqlite_url(tmp_path / "state.db"),
                          config=SearchConfig(study_name="risk", seed=0))
    baseline = space.defaults()
    seen = []
    while (p := search.next_move(baseline, space, low_risk_only=True)) is not None:
        seen.append(p.values["precision"])
        search.tell(p.number, 1.0)
    assert "fp16" not in seen and "bf16" in seen
    assert space.risk_of({"precision": "fp16"}) == "high"
    assert space.risk_of({"precision": "bf16"}) == "low"


def test_dead_trials_are_failed_by_the_lease(state_db_url: str) -> None:
    clock = Clock()
    first = driver(state_db_url, clock)
    proposal = first.ask()
    assert proposal is not None
    clock.now += 30
    first.heartbeat()
    clock.now += 45  # renewed at +30: still held at +75
    assert first.reap() == []
    # the sidecar dies; a new driver on the same study finds the trial after its lease ran out
    clock.now += 120
    second = driver(state_db_url, clock)
    assert second.reap() == [proposal.number]
    (trial,) = [t for t in second.study.trials if t.number == proposal.number]
    assert trial.state == TrialState.FAIL
    assert not second.study.get_trials(states=(TrialState.RUNNING,))


def test_a_config_that_killed_its_job_is_never_proposed_again(state_db_url: str) -> None:
    search = driver(state_db_url)
    proposal = search.ask()
    assert proposal is not None
    search.fail(proposal.number, reason="job died", unsafe=True)
    again = driver(state_db_url)  # the mark survives a restart: it is in the study
    seen = []
    while (p := again.ask()) is not None:
        seen.append(p.values)
        again.tell(p.number, throughput(p.values))
    assert proposal.values not in seen and len(seen) == 7


def test_hopeless_trials_are_pruned(state_db_url: str) -> None:
    search = driver(state_db_url, pruner_startup_trials=2)
    for value in (200.0, 210.0):
        p = search.ask()
        assert p is not None
        for step in (1, 2, 3):
            assert not search.report(p.number, step, value)
        search.tell(p.number, value)
    slow = search.ask()
    assert slow is not None
    assert not search.report(slow.number, 1, 50.0)  # two pairs are no evidence yet
    assert not search.report(slow.number, 2, 50.0)
    assert search.report(slow.number, 3, 50.0)


@pytest.fixture
def rollout(tmp_path: Path, state_db_url: str) -> Iterator[dict[str, Any]]:
    clock = Clock()
    registry = JobRegistry(lease_ttl_s=30.0, clock=clock)
    with TimeSeriesStore(tmp_path / "metrics.db") as store:
        job = SimJob(registry, store, step_s=lambda v: 1.0 / throughput(v), tokens_per_step=1)
        url = state_db_url
        ctl = RolloutController(registry, store, db_url=url, clock=clock, config=(
            RolloutConfig(min_pairs=3, max_pairs=8, measure=MeasureConfig(
                warmup_steps=2, min_steps=4, min_window_s=0.01))))
        ctl.set_mode(job.job, "auto", by="test")
        yield {"clock": clock, "registry": registry, "job": job, "ctl": ctl, "url": url,
               "dir": tmp_path}


def test_heartbeats_write_a_lease_only_once_a_quarter_of_it_has_passed(
        state_db_url: str) -> None:
    """The rollout loop heartbeats every second; each renewal is a write to the shared state
    DB, and a fleet's sidecars did sixteen a second for leases of 15 minutes."""
    clock = Clock()
    search = driver(state_db_url, clock)  # trial_lease_s = 60
    proposal = search.ask()
    assert proposal is not None

    def lease() -> float:
        (trial,) = [t for t in search.study.get_trials(deepcopy=False)
                    if t.number == proposal.number]
        return float(trial.system_attrs[LEASE_ATTR])

    started = lease()
    for _ in range(14):
        clock.now += 1
        search.heartbeat()
    assert lease() == started  # 14 s of 60: not renewed yet
    clock.now += 1
    search.heartbeat()
    assert lease() == clock.now + 60
    clock.now += 30
    assert search.reap() == []  # still held


def test_driver_runs_trials_through_the_rollout_controller(rollout: dict[str, Any],
                                                           tmp_path: Path) -> None:
    ctl, job = rollout["ctl"], rollout["job"]
    search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=("micro_batch",),
                          config=SearchConfig(study_name="live", seed=0), clock=rollout["clock"])
    ctl.add_observer(search)
    search.add_priors([Move(values={"micro_batch": 4})])
    change = search.propose_next(ctl, job.job)
    assert change is not None and change.state == "approved"  # low risk, auto mode
    for _ in range(30):
        ctl.tick()
        search.heartbeat()
        if ctl.get(change.id).state not in ("approved", "applying", "observing"):
            break
        job.run(8)
    done = ctl.get(change.id)
    assert done.state == "kept"
    trial, baseline = search.study.trials
    assert trial.state == baseline.state == TrialState.COMPLETE
    assert baseline.params == {"micro_batch": 8}  # measured by the baseline windows
    assert baseline.user_attrs["seedance:origin"].startswith("baseline windows")
    assert trial.value == pytest.approx(throughput({"micro_batch": 4, "precision": "fp32"}),
                                        rel=0.05)
    assert trial.intermediate_values  # one report per candidate window


def _driver_trying_micro_batch_2(rollout: dict[str, Any], study: str) -> SearchDriver:
    """A search on the rollout's controller whose first proposal is micro_batch=2."""
    search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=("micro_batch",),
                          config=SearchConfig(study_name=study, seed=0), clock=rollout["clock"])
    rollout["ctl"].add_observer(search)
    search.add_priors([Move(values={"micro_batch": 2})])
    return search


def test_a_sidecar_that_stops_rolls_back_its_change_in_flight_and_the_trial_may_run_again(
        rollout: dict[str, Any]) -> None:
    ctl, job = rollout["ctl"], rollout["job"]
    search = _driver_trying_micro_batch_2(rollout, "drain")
    change = search.propose_next(ctl, job.job)
    assert change is not None
    ctl.tick()
    job.run(8)
    ctl.tick()
    assert ctl.get(change.id).state in ("applying", "observing")
    (drained,) = ctl.drain()
    assert drained.id == change.id and ctl.get(change.id).state == "rolled_back"
    assert ctl.events(change_id=change.id)[-2]["actor"] == "shutdown"
    assert not ctl.drain()  # nothing is left in flight
    (trial,) = search.study.trials
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["seedance:fail_reason"] == STOPPED
    from tuner._sampler import unsafe_keys
    assert config_key({"micro_batch": 2}) not in unsafe_keys(search.records)
    again = search.propose_next(ctl, job.job)  # the sidecar's next process tries it again
    assert again is not None and again.values == {"micro_batch": 2}


def test_a_sidecar_that_stops_withdraws_its_own_unapplied_approvals_but_keeps_a_persons(
        rollout: dict[str, Any]) -> None:
    ctl, job = rollout["ctl"], rollout["job"]
    search = _driver_trying_micro_batch_2(rollout, "withdraw")
    auto = search.propose_next(ctl, job.job)
    assert auto is not None and auto.state == "approved" and auto.approved_by == "auto"
    ctl.set_mode(job.job, "suggest", by="test")
    asked = ctl.propose(job.job, {"micro_batch": 4}, reason="on-call asked", source="operator")
    persons = ctl.approve(asked.id, by="alice")
    (drained,) = ctl.drain()  # neither was applied: no tick ran
    assert drained.id == auto.id and ctl.get(auto.id).state == "rejected"
    assert ctl.events(change_id=auto.id)[-1]["actor"] == "shutdown"
    assert ctl.get(persons.id).state == "approved"  # the next owner carries it out
    (trial,) = search.study.trials
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["seedance:fail_reason"] == STOPPED
    ctl.reject(persons.id, by="alice", reason="changed my mind")
    ctl.set_mode(job.job, "auto", by="test")
    again = search.propose_next(ctl, job.job)  # the next process tries it again
    assert again is not None and again.values == {"micro_batch": 2}


def test_a_search_that_stops_releases_its_running_trials_to_be_tried_again(
        state_db_url: str) -> None:
    search = SearchDriver(SPACE, storage_url=state_db_url, knobs=("micro_batch",),
                          config=SearchConfig(study_name="release", seed=0))
    baseline = {"micro_batch": 8, "precision": "fp32"}
    first = search.next_move(baseline, SPACE)
    assert first is not None
    assert search.release(reason=STOPPED) == [first.number]
    assert search.study.trials[first.number].state == TrialState.FAIL
    assert search.release(reason=STOPPED) == []
    again = SearchDriver(SPACE, storage_url=state_db_url, knobs=("micro_batch",),
                         config=SearchConfig(study_name="release", seed=0))
    retried = again.next_move(baseline, SPACE)  # the next process of the sidecar
    assert retried is not None and retried.values == first.values


def test_a_lapsed_job_fails_the_trial_and_bars_its_config(rollout: dict[str, Any]) -> None:
    ctl, job, clock = rollout["ctl"], rollout["job"], rollout["clock"]
    search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=("micro_batch",),
                          config=SearchConfig(study_name="lapse", seed=0), clock=clock)
    ctl.add_observer(search)
    search.add_priors([Move(values={"micro_batch": 2})])
    change = search.propose_next(ctl, job.job)
    assert change is not None
    ctl.tick()
    job.run(8)
    clock.now += 31
    rollout["registry"].reap()
    assert ctl.get(change.id).state == "failed"
    (trial,) = search.study.trials
    assert trial.state == TrialState.FAIL
    from tuner._sampler import unsafe_keys
    assert config_key({"micro_batch": 2}) in unsafe_keys(search.records)


def test_tuning_loop_runs_distinct_trials_and_learns_the_baseline(
        rollout: dict[str, Any]) -> None:
    from policies._findings import Evidence, Finding, SuggestedChange
    from tuner._space import suggestions
    from tuner._tuning_loop import TuningLoop
    ctl, job, registry = rollout["ctl"], rollout["job"], rollout["registry"]
    search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=("micro_batch",),
                          config=SearchConfig(study_name="loop", seed=1), clock=rollout["clock"])
    finding = Finding(detector="d", job=job.job, severity="warning",
                      evidence=Evidence(summary="s", model="m"), suggested_changes=(
                          SuggestedChange(knob="micro_batch", value=4, expected_effect="e"),
                          SuggestedChange(knob="nonexistent", value=1, expected_effect="e")))
    baseline = dict(registry.status(job.job).baseline.values)
    priors = suggestions([finding], baseline, SPACE)
    assert [m.values for m in priors] == [{"micro_batch": 4}]
    search.add_priors(priors)
    loop = TuningLoop(ctl)
    loop.add_search(job.job, search)
    for _ in range(60):
        loop.step()
        job.run(8)
    finished = [c for c in ctl.changes(job=job.job) if c.state in ("kept", "rolled_back")]
    assert finished and finished[0].values == {"micro_batch": 4}  # the suggestion first
    tried = [c.candidate["micro_batch"] for c in ctl.changes(job=job.job)]
    assert len(tried) == len(set(tried))  # never the same candidate twice
    origins = [t.user_attrs.get("seedance:origin", "") for t in search.study.trials]
    assert any(o.startswith("baseline windows") for o in origins)
    assert registry.status(job.job).baseline.values["micro_batch"] == 4, [  # the fastest
        (c.candidate["micro_batch"], c.state, c.plan.get("ended_because")) for c in ctl.changes(job=job.job)]


def test_trial_values_cancel_a_box_that_keeps_slowing_down(rollout: dict[str, Any]) -> None:
    # Every step is 0.4% slower than the one before (another job ramping up on the box): raw
    # window means of a later trial would look ~30% worse than they are.
    ctl, job = rollout["ctl"], rollout["job"]
    steps = iter(range(10**6))
    job.step_s = lambda v: (1 + 0.004 * next(steps)) / throughput(v)
    search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=("micro_batch",),
                          config=SearchConfig(study_name="drift", seed=0,
                                              pruner_startup_trials=100),
                          clock=rollout["clock"])
    ctl.add_observer(search)
    search.add_priors([Move(values={"micro_batch": 4}, expected_gain=0.2),
                 Move(values={"micro_batch": 2}, expected_gain=0.1)])
    for _ in range(2):
        change = search.propose_next(ctl, job.job)
        assert change is not None
        for _ in range(40):
            ctl.tick()
            if ctl.get(change.id).state not in ("approved", "applying", "observing"):
                break
            job.run(8)
        assert ctl.get(change.id).state in ("kept", "rolled_back")
    value = {t.params["micro_batch"]: t.value for t in search.study.trials
             if t.state == TrialState.COMPLETE}
    assert value[4] / value[8] == pytest.approx(260 / 240, rel=0.03)
    assert value[2] / value[8] == pytest.approx(180 / 240, rel=0.03)
    first, second = ctl.changes(job=job.job)
    raw = [w.tokens_per_s for w in second.windows if w.arm == "candidate"]
    base = [w.tokens_per_s for w in first.windows if w.arm == "baseline"]
    assert sum(raw) / len(raw) / (sum(base) / len(base)) < 0.9 * 180 / 240  # drift is real


def test_a_proposal_waiting_for_a_person_does_not_stall_the_low_risk_moves(
        rollout: dict[str, Any]) -> None:
    from tuner._tuning_loop import TuningLoop
    ctl, job = rollout["ctl"], rollout["job"]
    search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=TUNED,
                          config=SearchConfig(study_name="stall", seed=0), clock=rollout["clock"])
    loop = TuningLoop(ctl)
    loop.add_search(job.job, search)
    for _ in range(40):
        loop.step()
        job.run(8)
    changes = ctl.changes(job=job.job)
    waiting = [c for c in changes if c.state == "proposed"]
    assert [c.values for c in waiting] == [{"precision": "bf16"}]  # high risk: a person's
    ran = [c for c in changes if c.state in ("kept", "rolled_back")]
    assert ran and all(set(c.values) == {"micro_batch"} for c in ran)  # went on meanwhile
    # approved later, it runs on the baseline of then, not the one it was proposed over
    ctl.approve(waiting[0].id, "alice")
    for _ in range(40):
        loop.step()
        if ctl.get(waiting[0].id).state in ("kept", "rolled_back"):
            break
        job.run(8)
    done = ctl.get(waiting[0].id)
    assert done.state in ("kept", "rolled_back")
    baseline_then = [c for c in ran if c.state == "kept"][-1].candidate
    assert done.baseline == baseline_then  # rebased: the kept micro-batch stays
    assert "rebased" in [e["kind"] for e in ctl.events(change_id=done.id)]


def test_no_trial_is_proposed_to_a_job_that_is_gone(rollout: dict[str, Any]) -> None:
    from tuner._tuning_loop import TuningLoop
    ctl, job, clock, registry = (rollout["ctl"], rollout["job"], rollout["clock"],
                                 rollout["registry"])
    search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=("micro_batch",),
                          config=SearchConfig(study_name="gone", seed=0), clock=clock)
    loop = TuningLoop(ctl)
    loop.add_search(job.job, search)
    clock.now += 31
    registry.reap()  # the job stopped renewing its lease
    for _ in range(5):
        loop.step()
    assert ctl.changes(job=job.job) == []
    job.session, job.config = registry.attach(job.job, knobs=KNOBS, baseline={})  # back
    loop.step()
    assert len(ctl.changes(job=job.job)) == 1


def test_a_precision_slower_than_fp32_here_is_never_proposed(tmp_path: Path) -> None:
    from tuner._knobs import Knob
    space = KnobSpace.of((Knob(name="precision.ffn", default="fp32",
                               choices=("fp32", "bf16", "fp16"), search_excludes=("fp16",)),))
    search = SearchDriver(space, storage_url=sqlite_url(tmp_path / "state.db"),
                          config=SearchConfig(study_name="slow", seed=0))
    proposed = []
    while (p := search.next_move(space.defaults(), space)) is not None \
            or (p := search.ask()) is not None:
        proposed.append(p.values["precision.ffn"])
        search.tell(p.number, 1.0)
    assert "fp16" not in proposed and "bf16" in proposed
    assert space.validate({"precision.ffn": "fp16"})  # an operator may still set it


def test_a_config_the_job_reports_failing_is_rolled_back_and_never_proposed_again(
        rollout: dict[str, Any]) -> None:
    # the job applied the candidate, then a step raised under it: the client skipped the step,
    # went back to its baseline and acked the version again as failed
    ctl, job, registry = rollout["ctl"], rollout["job"], rollout["registry"]
    search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=("micro_batch",),
                          config=SearchConfig(study_name="raised", seed=0),
                          clock=rollout["clock"])
    ctl.add_observer(search)
    search.add_priors([Move(values={"micro_batch": 4})])
    change = search.propose_next(ctl, job.job)
    assert change is not None
    ctl.tick()
    job.run(8)
    ctl.tick()
    version = int(ctl.get(change.id).plan["version"])
    registry.ack(job.job, job.session, version=version, step=job.step, status="failed",
                 error="RuntimeError: expected scalar type Half but found Float")
    ctl.tick()
    done = ctl.get(change.id)
    assert done.state == "rolled_back" and done.plan["job_failed"], done.plan
    assert "expected scalar type Half" in done.plan["ended_because"]
    from tuner._sampler import unsafe_keys
    assert config_key({"micro_batch": 4}) in unsafe_keys(search.records)


def test_a_config_kept_under_a_passing_load_is_left_once_its_measurement_is_stale(
        rollout: dict[str, Any]) -> None:
    # SIMULATED: while a neighbour loads the box, micro-batch 4 runs faster than the job's 8;
    # once it is gone, 8 is faster again. The kept 4 is measured again after revisit_after_s.
    from tuner._tuning_loop import TuningLoop
    ctl, registry, clock = rollout["ctl"], rollout["registry"], rollout["clock"]
    loaded = True

    def step_s(values: Any) -> float:
        fast = 4 if loaded else 8
        return 0.010 if values["micro_batch"] == fast else 0.013

    with TimeSeriesStore(rollout["dir"] / "drift.db") as store:
        job = SimJob(registry, store, job="drift", step_s=step_s, tokens_per_step=1)
        ctl.reader = store
        ctl.set_mode(job.job, "auto", by="test")
        search = SearchDriver(SPACE, storage_url=rollout["url"], knobs=("micro_batch",),
                              config=SearchConfig(study_name="drift", seed=0,
                                                  revisit_after_s=300.0), clock=clock)
        loop = TuningLoop(ctl)
        loop.add_search(job.job, search)

        def run_until(done: Any, rounds: int = 200) -> None:
            for _ in range(rounds):
                loop.step()
                job.run(8)
                if done():
                    return
            raise AssertionError([(c.candidate, c.state) for c in ctl.changes(job=job.job)])

        run_until(lambda: registry.status(job.job).baseline.values["micro_batch"] == 4)
        run_until(lambda: search.moves_left(registry.status(job.job).baseline.values) == 0
                  and not ctl.changes(job=job.job, states=["approved", "applying",
                                                           "observing"]))
        loaded = False
        for _ in range(20):  # fresh results: nothing to revisit yet
            loop.step()
            job.run(8)
        assert registry.status(job.job).baseline.values["micro_batch"] == 4
        clock.now += 301
        run_until(lambda: registry.status(job.job).baseline.values["micro_batch"] == 8)
    revisits = [t for t in search.study.trials
                if str(t.user_attrs.get("seedance:origin", "")).startswith("revisit")]
    assert revisits and revisits[-1].params == {"micro_batch": 8}


def test_top_k_moves_stay_under_the_distinct_prefixes_the_job_reports(tmp_path: Path) -> None:
    """The serving job reports 10 distinct prefixes in its recent look-ups: pinning 16 would
    pin nothing more, so from 8 the search tries 4 only; once traffic holds 40, 16 too."""
    from tuner._ceilings import observed_ceilings
    from tuner.prefix_cache import PREFIX_CACHE_KNOBS

    space = KnobSpace.of(PREFIX_CACHE_KNOBS)
    store = TimeSeriesStore(tmp_path / "metrics.db")
    clock = Clock()
    clock.now = 1.7e9

    def report(prefixes: int, at_s: float) -> None:
        store.write([Point("seedance.serve.prefix_cache.distinct_prefixes", float(prefixes),
                           int(at_s * 1e9), {"service.name": "serve"})])
        store.flush()

    studies = iter(range(100))

    def tried() -> list[int]:  # a fresh study each time
        search = SearchDriver(space, storage_url=sqlite_url(tmp_path / f"{next(studies)}.db"),
                              config=SearchConfig(study_name="topk", seed=0),
                              knobs=["prefix_cache.pin_top_k"], clock=clock,
                              ceilings=lambda: observed_ceilings(store, "serve",
                                                                 now_s=clock.now))
        seen = []
        while (p := search.next_move(space.defaults(), space)) is not None:
            seen.append(int(p.values["prefix_cache.pin_top_k"]))
            search.tell(p.number, 1.0)
        return seen

    try:
        assert sorted(tried()) == [4, 16]  # nothing reported yet: no ceiling
        report(10, clock.now - 60)
        assert tried() == [4]
        report(40, clock.now - 30)
        clock.now += 1
        assert sorted(tried()) == [4, 16]
        clock.now += 600  # the reports are old now: they bound nothing
        assert sorted(tried()) == [4, 16]
    finally:
        store.close()


def test_an_undecided_trial_that_favours_its_candidate_is_measured_again_at_once(
        state_db_url: str) -> None:
    """Out of time undecided at +10%: measured again as soon as the moves are done (once),
    not 300 s later; one undecided at -5% waits its turn like any stale result."""
    clock = Clock()
    search = driver(state_db_url, clock=clock, revisit_after_s=300.0)
    baseline = SPACE.defaults()
    told = {}
    while (p := search.next_move(baseline, SPACE)) is not None and len(told) < 2:
        gain = 0.10 if p.values["micro_batch"] == 4 else -0.05
        search.tell(p.number, 100 * (1 + gain), revisit=True, undecided_gain=gain)
        told[config_key(p.values)] = gain
    assert p is not None and p.values["micro_batch"] == 4  # again, at once
    assert search.study.trials[p.number].user_attrs["seedance:origin"].startswith("again")
    search.tell(p.number, 104.0, revisit=True, undecided_gain=0.04)
    assert search.next_move(baseline, SPACE) is None  # once only; the rest waits
    clock.now += 301
    stale = search.next_move(baseline, SPACE)
    assert stale is not None
    assert search.study.trials[stale.number].user_attrs["seedance:origin"].startswith("revisit")


def test_an_again_trial_that_is_pruned_is_not_measured_again_and_again(
        state_db_url: str) -> None:
    """The again trial is once: pruned or failed, the undecided trial before it does not
    bring the config back at once (it waits for its revisit like any stale result)."""
    clock = Clock()
    search = driver(state_db_url, clock=clock, revisit_after_s=300.0)
    baseline = SPACE.defaults()
    while (p := search.next_move(baseline, SPACE)) is not None:
        origin = search.study.trials[p.number].user_attrs["seedance:origin"]
        if origin.startswith("again"):
            search.prune(p.number)
            break
        gain = 0.10 if p.values["micro_batch"] == 4 else -0.05
        search.tell(p.number, 100 * (1 + gain), revisit=True, undecided_gain=gain)
    assert p is not None and p.values["micro_batch"] == 4
    assert search.next_move(baseline, SPACE) is None


def test_an_undecided_trial_measured_again_continues_its_pairs_and_is_kept(
        tmp_path: Path) -> None:
    """SIMULATED job, micro-batch 4 truly +8% with 15% step noise: 8 pairs leave it undecided;
    the again trial pools those 8 pairs with its own (the same candidate against the same
    baseline) and keeps it after 3 pairs that alone would have decided nothing."""
    from tuner._compare import confidence_sequence
    from tuner._tuning_loop import TuningLoop
    clock = Clock()
    registry = JobRegistry(lease_ttl_s=30.0, clock=clock)
    url = sqlite_url(tmp_path / "state.db")
    with TimeSeriesStore(tmp_path / "metrics.db") as store:
        job = SimJob(registry, store, tokens_per_step=1, noise=0.15, seed=4,
                     step_s=lambda v: 1 / (108.0 if v["micro_batch"] == 4 else 100.0))
        measure = MeasureConfig(warmup_steps=2, min_steps=4, min_window_s=0.01)
        ctl = RolloutController(registry, store, db_url=url, clock=clock, config=RolloutConfig(
            min_pairs=3, max_pairs=8, measure=measure))
        ctl.set_mode(job.job, "auto", by="test")
        search = SearchDriver(SPACE, storage_url=url, knobs=("micro_batch",),
                              config=SearchConfig(study_name="again", seed=0), clock=clock)
        loop = TuningLoop(ctl)
        loop.add_search(job.job, search)
        for _ in range(120):
            loop.step()
            job.run(8)
            if any(c.state == "kept" for c in ctl.changes(job=job.job)):
                break
        first, again = ctl.changes(job=job.job)[:2]
    assert (first.state, first.values) == ("rolled_back", {"micro_batch": 4})
    assert first.plan["ended_because"].startswith("no measured gain in 8 pairs")
    assert (again.state, again.values) == ("kept", {"micro_batch": 4})
    assert again.meta["continues"]["change"] == first.id
    comparison = again.comparison or {}
    assert comparison["earlier_pairs"] == 8 and comparison["ci_low"] > 0
    own = np.log(comparison["pair_ratios"])
    low, _ = confidence_sequence(own, alpha=1 - measure.confidence,
                                 planned=measure.planned_pairs, noise_floor=measure.noise_floor)
    assert low <= 0  # its own pairs alone: undecided


def test_pairs_measured_against_another_baseline_are_not_continued() -> None:
    from tuner._change import Change
    earlier = {"change": "c0", "baseline": {"micro_batch": 8, "prefetch": 2},
               "candidate": {"micro_batch": 4, "prefetch": 2}, "pair_ratios": [1.1, 1.2]}

    def change(baseline: dict[str, Any]) -> Change:
        return Change(id="c1", job="j", state="observing", source="trial", reason="r",
                      risk="low", scope="live", values={"micro_batch": 4}, baseline=baseline,
                      created_at_s=0.0, expires_at_s=1.0, meta={"continues": earlier})

    assert change({"micro_batch": 8, "prefetch": 2}).continued_ratios == (1.1, 1.2)
    assert change({"micro_batch": 8, "prefetch": 4}).continued_ratios == ()
