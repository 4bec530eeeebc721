from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import StoreReader
from collectors._store import TimeSeriesStore
from policies._findings import Evidence, Finding
from policies.detectors import NON_FINITE
from tests.tuner._simjob import SimJob
from tuner._change import TRANSITIONS, Change, IllegalTransition, RolloutError, Trip
from tuner._guardrails import GradientCollapseFindings, Guardrail, NonFiniteValues
from tuner._lease import JobRegistry
from tuner._rollout import RolloutController
from tuner._verdict import RolloutConfig
from tuner._windows import MeasureConfig

MEASURE = MeasureConfig(warmup_steps=2, min_steps=4, min_window_s=0.3)
CONFIG = RolloutConfig(min_pairs=3, max_pairs=8, proposal_ttl_s=100.0, measure=MEASURE)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def parts(tmp_path: Path, state_db_url: str) -> Iterator[dict[str, Any]]:
    """A registry, a store and a state DB (SQLite, then PostgreSQL)."""
    clock = Clock()
    registry = JobRegistry(lease_ttl_s=30.0, clock=clock)
    store = TimeSeriesStore(tmp_path / "metrics.db")
    yield {"clock": clock, "registry": registry, "store": store,
           "url": state_db_url, "tmp": tmp_path}
    store.close()


def controller(parts: dict[str, Any], **kwargs: Any) -> RolloutController:
    kwargs.setdefault("config", CONFIG)
    return RolloutController(parts["registry"], parts["store"], db_url=parts["url"],
                             clock=parts["clock"], **kwargs)


def fast_micro_batch(values: Any) -> float:
    return 0.10 if values["micro_batch"] == 4 else 0.13


def drive(ctl: RolloutController, job: SimJob, change_id: str, rounds: int = 40) -> Change:
    for _ in range(rounds):
        ctl.tick()
        change = ctl.get(change_id)
        if change.state not in ("approved", "applying", "observing"):
            return change
        job.run(8)
    raise AssertionError(f"change still {ctl.get(change_id).state}")


def test_transition_table_is_closed_and_terminal_states_stay() -> None:
    states = set(TRANSITIONS)
    assert all(targets <= states for targets in TRANSITIONS.values())
    for terminal in ("rejected", "expired", "failed"):
        assert not TRANSITIONS[terminal]
    # a rollback leaves its state only while its restore is unconfirmed
    assert TRANSITIONS["rolled_back"] == {"manual_intervention_required"}
    assert TRANSITIONS["manual_intervention_required"] == {"rolled_back"}


def test_illegal_transitions_raise(parts: dict[str, Any]) -> None:
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="test", source="operator")
    ctl.reject(change.id, "alice", "not now")
    with pytest.raises(IllegalTransition):
        ctl.approve(change.id, "bob")
    with pytest.raises(RolloutError):
        ctl.propose(job.job, {"micro_batch": 8}, reason="no-op", source="operator")
    kinds = [e["kind"] for e in ctl.events(change_id=change.id)]
    assert kinds == ["proposed", "rejected"]
    rejected = ctl.events(change_id=change.id)[-1]
    assert (rejected["actor"], rejected["reason"]) == ("alice", "not now")


def test_faster_config_is_kept_and_becomes_the_baseline(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts)
    ctl.set_mode(job.job, "auto", by="alice")
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="trial", source="trial")
    assert change.state == "approved" and change.approved_by == "auto"
    done = drive(ctl, job, change.id)
    assert done.state == "kept", ctl.events(change_id=change.id)[-1]
    assert done.comparison is not None and done.comparison["ci_low"] > 0
    assert registry.status(job.job).baseline.values["micro_batch"] == 4
    arms = [w.arm for w in done.windows]
    assert arms == ["candidate", "baseline"] * 3
    assert len({w.version for w in done.windows}) == 6  # every window a fresh version
    events = ctl.events(change_id=change.id)
    states = [e["to_state"] for e in events if e["to_state"]]
    assert states == ["proposed", "approved", "applying", "observing", "kept"]
    applies = [e for e in events if e["kind"] == "desired"]
    assert all(e["version_after"] for e in applies)


def test_a_sidecar_sharing_the_journal_leaves_another_sidecars_changes_alone(
        parts: dict[str, Any]) -> None:
    """Two controllers on one state DB, the job owned by one (the fleet's claim, which a
    sidecar hands its controller as ``owns``): the other's ticks touch neither the change in
    flight nor the one approved after it."""
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    mine = controller(parts)
    other = RolloutController(JobRegistry(lease_ttl_s=30.0, clock=parts["clock"]),
                              parts["store"], db_url=parts["url"], clock=parts["clock"],
                              config=CONFIG, owns=lambda name: name != job.job)
    change = mine.propose(job.job, {"micro_batch": 4}, reason="r", source="operator")
    mine.approve(change.id, "alice")
    mine.tick()
    queued = mine.propose(job.job, {"prefetch": 4}, reason="r", source="operator")
    mine.approve(queued.id, "alice")
    for _ in range(3):
        other.tick()
        job.run(8)
    assert mine.get(change.id).state in ("applying", "observing")
    assert mine.get(queued.id).state == "approved"
    assert drive(mine, job, change.id).state == "kept"
    other.close()


def test_slower_config_is_rolled_back_without_an_action(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=lambda v: 0.2 if v["micro_batch"] == 1 else 0.1)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"micro_batch": 1}, reason="trial", source="trial")
    ctl.approve(change.id, "alice", "try it")
    done = drive(ctl, job, change.id)
    assert done.state == "rolled_back"
    assert done.plan["rollback"] == "config"
    assert "regression" in done.plan["ended_because"]
    assert len(done.windows) < 6  # stopped early after enough pairs
    assert not [a for a in job.actions if a["kind"] == "rollback"]
    assert registry.status(job.job).desired.values["micro_batch"] == 8


def test_no_measurable_gain_is_rolled_back(parts: dict[str, Any]) -> None:
    job = SimJob(parts["registry"], parts["store"], step_s=lambda v: 0.1, noise=0.05)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"prefetch": 4}, reason="trial", source="trial")
    ctl.approve(change.id, "alice")
    done = drive(ctl, job, change.id)
    assert done.state == "rolled_back"
    assert done.comparison is not None and done.comparison["ci_low"] <= 0


def test_approval_by_mode_risk_scope_and_bounds(parts: dict[str, Any]) -> None:
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    config = RolloutConfig(measure=MEASURE, auto_bounds={"prefetch": (1, 4)})
    ctl = controller(parts, config=config)
    assert ctl.mode(job.job) == "suggest"
    assert ctl.propose(job.job, {"prefetch": 3}, reason="r", source="trial").state == "proposed"
    ctl.set_mode(job.job, "auto", by="alice")
    assert ctl.propose(job.job, {"prefetch": 3}, reason="r", source="trial").state == "approved"
    assert ctl.propose(job.job, {"prefetch": 6}, reason="r", source="trial").state == "proposed"
    high = ctl.propose(job.job, {"precision": "bf16"}, reason="r", source="finding")
    assert (high.risk, high.state) == ("high", "proposed")
    restart = ctl.propose(job.job, {"threads": 1}, reason="r", source="operator")
    assert (restart.scope, restart.state) == ("restart", "proposed")
    ctl.set_mode(job.job, "off", by="alice")
    off = ctl.propose(job.job, {"prefetch": 3}, reason="r", source="trial")
    assert off.state == "rejected"
    modes = [e for e in ctl.events(job=job.job) if e["kind"] == "mode"]
    assert [(e["detail"]["from"], e["detail"]["to"]) for e in modes] == [
        ("suggest", "auto"), ("auto", "off")]


def test_proposals_expire(parts: dict[str, Any]) -> None:
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="r", source="finding")
    ctl.tick()
    assert ctl.get(change.id).state == "proposed"
    parts["clock"].now += CONFIG.proposal_ttl_s + 1
    ctl.tick()
    assert ctl.get(change.id).state == "expired"


def test_nonfinite_loss_forces_a_full_rollback(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch,
                 loss=lambda v, step: float("inf") if v["micro_batch"] == 4 else 3.0)
    ctl = controller(parts, guardrails=[NonFiniteValues()])
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="r", source="trial")
    ctl.approve(change.id, "alice")
    done = drive(ctl, job, change.id)
    assert done.state == "rolled_back" and done.plan["rollback"] == "full"
    job.run(1)
    assert {"kind": "rollback", "scope": "full", "change_id": change.id} in job.actions
    assert registry.status(job.job).desired.values["micro_batch"] == 8


def test_gradient_collapse_finding_rolls_back_the_group_locally(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    findings: list[Finding] = []
    ctl = controller(parts, guardrails=[GradientCollapseFindings(lambda: findings)])
    change = ctl.propose(job.job, {"precision.ffn": "bf16", "micro_batch": 4}, reason="r",
                         source="finding")
    ctl.approve(change.id, "alice")
    ctl.tick()
    job.run(8)
    assert job.actions[0] == {"kind": "snapshot", "change_id": change.id}  # before lowering
    ctl.tick()
    assert ctl.get(change.id).state == "observing"
    findings.append(Finding(
        detector="gradient_collapse", job=job.job, severity="critical",
        resource={"module_group": "ffn"}, id="f1",
        opened_at_ns=int(parts["clock"].now * 1e9) + 1,
        evidence=Evidence(summary="grad norm ratio < 0.05 for 3 steps", model="seed 3.3")))
    ctl.tick()
    done = ctl.get(change.id)
    assert done.state == "rolled_back" and done.plan["rollback"] == "local"
    job.run(1)
    assert {"kind": "rollback", "scope": "local", "group": "ffn",
            "change_id": change.id} in job.actions
    status = registry.status(job.job)
    assert status.desired.values["precision.ffn"] == "fp32"
    assert status.desired.values["micro_batch"] == 8


def test_a_non_finite_gradient_finding_rolls_everything_back(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    findings: list[Finding] = []
    ctl = controller(parts, guardrails=[GradientCollapseFindings(lambda: findings)])
    change = ctl.propose(job.job, {"precision.ffn": "bf16"}, reason="r", source="trial")
    ctl.approve(change.id, "alice")
    ctl.tick()
    job.run(8)
    ctl.tick()
    findings.append(Finding(
        detector=NON_FINITE, job=job.job, severity="critical",
        resource={"module_group": "ffn"}, id="f2",  # named, yet the optimizer stepped on NaNs
        opened_at_ns=int(parts["clock"].now * 1e9) + 1,
        evidence=Evidence(summary="non-finite gradients", model="non-finite")))
    ctl.tick()
    done = ctl.get(change.id)
    assert done.state == "rolled_back" and done.plan["rollback"] == "full"


class RaisingGuardrail(Guardrail):
    def check(self, change: Change, version: int, reader: StoreReader) -> Trip | None:
        raise ConnectionError("store unreachable")


def test_a_guardrail_that_raises_fails_closed(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts, guardrails=[RaisingGuardrail(), NonFiniteValues()])
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="r", source="trial")
    ctl.approve(change.id, "alice")
    done = drive(ctl, job, change.id)
    assert done.state == "rolled_back" and done.plan["rollback"] == "full"
    assert any("RaisingGuardrail could not check" in (e["reason"] or "")
               for e in ctl.events(change_id=change.id))
    assert registry.status(job.job).desired.values["micro_batch"] == 8


def blows_up_at_micro_batch_4(values: Any, step: int) -> float:
    return float("inf") if values["micro_batch"] == 4 else 3.0


def rolled_back_by_a_nan(parts: dict[str, Any]) -> tuple[SimJob, RolloutController, Change]:
    """A trial whose loss blows up, rolled back in full; its restore not yet acked."""
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch,
                 loss=blows_up_at_micro_batch_4)
    ctl = controller(parts, guardrails=[NonFiniteValues()])
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="r", source="trial")
    ctl.approve(change.id, "alice")
    assert drive(ctl, job, change.id).state == "rolled_back"
    return job, ctl, change


def test_a_rollback_counts_once_the_job_acks_its_baseline_and_ran_the_rollback(
        parts: dict[str, Any]) -> None:
    job, ctl, change = rolled_back_by_a_nan(parts)
    assert not ctl.get(change.id).plan["restore"]["confirmed"]
    nxt = ctl.propose(job.job, {"prefetch": 4}, reason="next", source="trial")
    ctl.approve(nxt.id, "alice")
    ctl.tick()
    assert ctl.get(nxt.id).state == "approved"  # waits: the job is not back on its baseline
    job.run(1)
    ctl.tick()
    assert ctl.get(change.id).plan["restore"]["confirmed"]
    assert "restore_confirmed" in [e["kind"] for e in ctl.events(change_id=change.id)]
    ctl.tick()
    assert ctl.get(nxt.id).state == "applying"


def test_a_rollback_the_job_cannot_carry_out_is_retried_then_waits_for_a_person(
        parts: dict[str, Any]) -> None:
    job, ctl, change = rolled_back_by_a_nan(parts)
    job.action_error = "CheckpointError: no snapshot to return to"
    for _ in range(CONFIG.restore_attempts):
        job.run(1)
        ctl.tick()
    stuck = ctl.get(change.id)
    assert stuck.state == "manual_intervention_required"
    assert "no snapshot to return to" in stuck.plan["restore"]["problem"]
    kinds = [e["kind"] for e in ctl.events(change_id=change.id)]
    assert kinds.count("restore_retry") == CONFIG.restore_attempts - 1
    assert kinds[-1] == "manual_intervention_required"
    nxt = ctl.propose(job.job, {"prefetch": 4}, reason="next", source="trial")
    ctl.approve(nxt.id, "alice")
    for _ in range(3):
        job.run(1)
        ctl.tick()
    assert ctl.get(nxt.id).state == "approved"  # nothing else is tried on that job
    assert ctl.get(change.id).state == "manual_intervention_required"  # no more retries

    job.action_error = None  # the operator fixed the cause and tries again
    ctl.rollback(job.job, "bob", "snapshot store remounted")
    job.run(1)
    ctl.tick()
    done = ctl.get(change.id)
    assert done.state == "rolled_back" and done.plan["restore"]["confirmed"]
    ctl.tick()
    assert ctl.get(nxt.id).state == "applying"


def test_a_baseline_the_job_refuses_or_never_acks_is_sent_again(parts: dict[str, Any]) -> None:
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="r", source="operator")
    ctl.approve(change.id, "alice")
    assert drive(ctl, job, change.id).state == "kept"
    ctl.rollback(job.job, "bob", "paged")
    job.refuse = lambda values: "RuntimeError: out of memory" if values["micro_batch"] == 8 \
        else None
    job.run(1)
    ctl.tick()
    retry = [e for e in ctl.events(change_id=change.id) if e["kind"] == "restore_retry"]
    assert len(retry) == 1 and "out of memory" in retry[0]["reason"]
    job.refuse = lambda values: None
    parts["clock"].now += CONFIG.ack_timeout_s + 1  # the job went quiet: no ack in time
    ctl.tick()
    retry = [e for e in ctl.events(change_id=change.id) if e["kind"] == "restore_retry"]
    assert len(retry) == 2 and "no ack" in retry[1]["reason"]
    job.run(1)
    ctl.tick()
    assert ctl.get(change.id).plan["restore"]["confirmed"]
    assert parts["registry"].status(job.job).baseline.values["micro_batch"] == 8


def test_a_job_whose_lease_lapsed_after_its_rollback_never_needs_a_person(
        parts: dict[str, Any]) -> None:
    """A job that went away returns to its baseline itself (the lease protocol): its silence
    is no failed rollback, however long it lasts."""
    job, ctl, change = rolled_back_by_a_nan(parts)
    parts["clock"].now += 31
    assert parts["registry"].reap() == [job.job]
    for _ in range(CONFIG.restore_attempts + 1):
        parts["clock"].now += CONFIG.ack_timeout_s + 1
        ctl.tick()
    assert ctl.get(change.id).state == "rolled_back"
    assert "restore_retry" not in [e["kind"] for e in ctl.events(change_id=change.id)]


def test_an_unconfirmed_restore_is_watched_again_after_a_restart(parts: dict[str, Any]) -> None:
    job, ctl, change = rolled_back_by_a_nan(parts)
    ctl.close()
    again = controller(parts, guardrails=[NonFiniteValues()])
    again.recover()
    job.run(1)
    again.tick()
    assert again.get(change.id).plan["restore"]["confirmed"]


def test_lapsed_lease_fails_the_change(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="r", source="trial")
    ctl.approve(change.id, "alice")
    ctl.tick()
    job.run(8)
    ctl.tick()
    parts["clock"].now += 31
    assert registry.reap() == [job.job]
    assert ctl.get(change.id).state == "failed"


def test_operator_rolls_back_a_kept_change(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="r", source="operator")
    ctl.approve(change.id, "alice")
    assert drive(ctl, job, change.id).state == "kept"
    undone = ctl.rollback(job.job, "bob", "paged: loss looks odd")
    assert undone.state == "rolled_back"
    assert registry.status(job.job).baseline.values["micro_batch"] == 8
    last = ctl.events(change_id=change.id)[-2]
    assert (last["from_state"], last["actor"]) == ("kept", "bob")


def test_a_rollback_aimed_at_a_change_that_ended_leaves_the_kept_change_alone(
        parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="r", source="operator")
    ctl.approve(change.id, "alice")
    assert drive(ctl, job, change.id).state == "kept"
    with pytest.raises(RolloutError, match="not in flight"):
        ctl.rollback(job.job, "bob", "it was in flight a moment ago", change_id=change.id)
    assert ctl.get(change.id).state == "kept"
    assert registry.status(job.job).baseline.values["micro_batch"] == 4


def test_a_new_controller_rolls_back_changes_left_in_flight(parts: dict[str, Any]) -> None:
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    first = controller(parts)
    change = first.propose(job.job, {"micro_batch": 4}, reason="r", source="trial")
    first.approve(change.id, "alice")
    first.tick()
    assert registry.status(job.job).desired.values["micro_batch"] == 4  # window 0: candidate
    job.run(8)
    first.tick()
    assert first.get(change.id).state == "observing"
    for _ in range(10):  # until window 0 is measured and window 1 sent
        job.run(8)
        first.tick()
        if registry.status(job.job).desired.values["micro_batch"] == 8:
            break
    assert registry.status(job.job).desired.values["micro_batch"] == 8  # window 1: baseline
    # the process dies here; a new controller opens the same database
    second = controller(parts)
    assert second.get(change.id).state == "observing"  # opening it undoes nothing ...
    second.recover()  # ... recovery is an explicit call
    recovered = second.get(change.id)
    assert recovered.state == "rolled_back"
    assert second.events(change_id=change.id)[-2]["actor"] == "recovery"
    assert registry.status(job.job).desired.values["micro_batch"] == 8


_KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    from tuner._lease import JobRegistry
    from tuner._rollout import RolloutController
    from tests.tuner._simjob import KNOBS
    registry = JobRegistry()
    registry.attach("train", knobs=KNOBS, baseline={})
    ctl = RolloutController(registry, lambda *a, **k: None, db_url=sys.argv[1])
    change = ctl.propose("train", {"micro_batch": 4}, reason="r", source="operator")
    ctl.approve(change.id, "alice")
    real = registry.set_desired
    def die(*args, **kwargs):  # killed after the journal write, before the job is told
        os.kill(os.getpid(), signal.SIGKILL)
    registry.set_desired = die
    ctl.tick()
""")


def test_kill_9_mid_transition_leaves_a_journaled_change_that_is_rolled_back(
        parts: dict[str, Any]) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _KILLED_CHILD, parts["url"]], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts)
    ctl.recover()
    (change,) = ctl.changes(job=job.job)
    assert change.state == "rolled_back"
    kinds = [e["kind"] for e in ctl.events(change_id=change.id)]
    assert kinds[:5] == ["proposed", "approved", "applying", "apply", "rolled_back"]


def test_a_config_that_harms_the_job_ends_after_two_slow_pairs(parts: dict[str, Any]) -> None:
    # a candidate 5x slower (threads oversubscribed on a busy box, say), with wild noise
    job = SimJob(parts["registry"], parts["store"], noise=0.3,
                 step_s=lambda v: 0.5 if v["micro_batch"] == 2 else 0.1)
    ctl = controller(parts)
    change = ctl.propose(job.job, {"micro_batch": 2}, reason="trial", source="trial")
    ctl.approve(change.id, "alice")
    done = drive(ctl, job, change.id)
    assert done.state == "rolled_back"
    assert "harms the job" in done.plan["ended_because"], done.plan["ended_because"]
    assert len(done.windows) == 4  # two pairs, not the trial's whole budget
