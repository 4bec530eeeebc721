"""Several sidecars on one PostgreSQL: real processes asking and telling one study and proposing
and moving changes in one journal at once. No trial is given twice or failed by a sidecar
that did not own it, no config runs twice, no change or event is lost or doubled, and the
lock waits and lost races are counted."""

from __future__ import annotations

import json
import multiprocessing
import queue
import threading
from dataclasses import replace
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState
from sqlalchemy.pool import NullPool

from collectors import StateLocks
from seedancectl._state_schema import migrate
from tests.tuner._simjob import KNOBS
from tuner import Change, ChangeJournal, RolloutError
from tuner._knobs import KnobSpace
from tuner._search import SearchDriver
from tuner._search_config import SearchConfig
from tuner._space import config_key

SPACE = KnobSpace.of(KNOBS)
TUNED = ("micro_batch", "prefetch", "precision")  # 4 x 8 x 2 = 64 configs
BASELINE = {"micro_batch": 8, "prefetch": 2, "precision": "fp32"}
STUDY = "shared"
WORKERS = 4
ROUNDS = 4
CHANGES = 15
OWNER_ATTR = "test:owner"
FAIL_REASON = "seedance:fail_reason"


def search(url: str, seed: int) -> SearchDriver:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return SearchDriver(SPACE, storage_url=url, knobs=TUNED, config=SearchConfig(
        study_name=STUDY, seed=seed, trial_lease_s=3600.0, revisit_after_s=None))


def study_worker(url: str, worker: int, start: Any, results: Any) -> None:
    """One sidecar's search: single moves from one baseline while there are any, then the
    sampler; every third trial it ends fails (as a job that died would), the rest complete."""
    driver = search(url, worker)
    got: list[tuple[int, str]] = []
    start.wait()
    for round_ in range(ROUNDS):
        proposal = driver.next_move(BASELINE, SPACE) or driver.ask()
        if proposal is None:
            break
        got.append((proposal.number, config_key(proposal.values)))
        driver.records.set_trial_attr(proposal.number, OWNER_ATTR, worker)
        if round_ % 3 == 2:
            driver.fail(proposal.number, reason=f"worker {worker}", unsafe=False)
        else:
            driver.tell(proposal.number, float(worker * 100 + round_))
    results.put({"worker": worker, "got": got, "waits": driver.lock_waits})
    driver.close()


def a_change(change_id: str) -> Change:
    return Change(id=change_id, job="train", state="proposed", source="trial", reason="r",
                  risk="low", scope="live", values={"micro_batch": 4},
                  baseline={"micro_batch": 8}, created_at_s=100.0, expires_at_s=160.0)


def journal_worker(url: str, worker: int, start: Any, results: Any) -> None:
    """One sidecar's controller and one operator's web page: each change it proposes, it
    approves, while it rejects its neighbour's change of the same round (a race, one wins);
    all set one new job's mode at once."""
    journal = ChangeJournal(url, clock=lambda: 100.0)  # one timestamp: order from the lock
    won, lost = 0, 0
    start.wait()
    journal.set_mode("fresh", "auto", actor=f"w{worker}", reason="", old="suggest")
    for i in range(CHANGES):
        change = a_change(f"w{worker}-{i}")
        journal.add(change, actor=f"w{worker}", reason="r", version_before=None, detail={})
        moves = [(change, "approved"), (f"w{(worker + 1) % WORKERS}-{i}", "rejected")]
        for target, state in moves:
            try:
                before = target if isinstance(target, Change) else journal.get(target)
                if before.state == "proposed":
                    journal.move(before, replace(before, state=state), actor=f"w{worker}",
                                 reason=state)
                    won += 1
                    continue
            except RolloutError:  # not proposed yet, or moved under us (IllegalTransition)
                pass
            lost += 1
    results.put({"worker": worker, "won": won, "lost": lost})
    journal.close()


def run_workers(target: Any, url: str) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(WORKERS), context.Queue()
    processes = [context.Process(target=target, args=(url, w, start, results))
                 for w in range(WORKERS)]
    for process in processes:
        process.start()
    found: list[dict[str, Any]] = []
    while len(found) < len(processes):
        try:
            found.append(results.get(timeout=1))
        except queue.Empty:
            died = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            assert not died, f"a sidecar process died (exit codes {died}); see its traceback"
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return sorted(found, key=lambda r: r["worker"])


@pytest.mark.integration
def test_sidecars_sharing_a_study_never_take_or_fail_each_others_trials(
        postgres_url: str) -> None:
    migrate(postgres_url)
    search(postgres_url, 0).close()  # the study exists before the race
    results = run_workers(study_worker, postgres_url)
    given = [pair for r in results for pair in r["got"]]
    numbers = [number for number, _ in given]
    assert len(given) == WORKERS * ROUNDS
    assert len(set(numbers)) == len(numbers), "a trial was given to two sidecars"
    assert len({key for _, key in given}) == len(given), "a config was started twice"
    owner = {number: r["worker"] for r in results for number, _ in r["got"]}
    trials = optuna.load_study(study_name=STUDY, storage=postgres_url).get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    for trial in trials:
        reason = trial.user_attrs.get(FAIL_REASON, "")
        if trial.number in owner:  # a trial a sidecar ran: ended by that sidecar only
            assert trial.user_attrs[OWNER_ATTR] == owner[trial.number]
            assert reason in ("", f"worker {owner[trial.number]}"), (trial.number, reason)
        else:  # a repeat the asker answered itself from the study, never another's trial
            assert reason == "" or reason.startswith("duplicate of trial"), (trial.number,
                                                                             reason)
    waits = sum(r["waits"] for r in results)
    print(f"study: {len(trials)} trials, {len(given)} run by {WORKERS} sidecars, "
          f"{waits} lock waits")


@pytest.mark.integration
def test_sidecars_sharing_a_journal_lose_and_double_nothing(postgres_url: str) -> None:
    migrate(postgres_url)
    results = run_workers(journal_worker, postgres_url)
    journal = ChangeJournal(postgres_url)
    changes = journal.changes()
    events = journal.events()
    assert len(changes) == WORKERS * CHANGES
    assert len({c.id for c in changes}) == len(changes)
    # each change moved exactly once, by whoever won the race; every lost race left no trace
    assert sum(r["won"] for r in results) == len(changes)
    assert all(c.state in ("approved", "rejected") for c in changes)
    by_change: dict[str, list[str]] = {}
    for event in events:
        if event["change_id"] is not None:
            by_change.setdefault(event["change_id"], []).append(event["kind"])
    assert by_change == {c.id: ["proposed", c.state] for c in changes}
    assert [e["kind"] for e in events if e["change_id"] is None] == ["mode"] * WORKERS
    assert journal.mode("fresh") == "auto"
    engine = sa.create_engine(postgres_url, poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT state, body, created_at_ns FROM changes")).all()
    engine.dispose()
    assert all(json.loads(body)["state"] == state for state, body, _ in rows)
    assert len({at for _, _, at in rows}) == len(rows), "two changes share a place in order"
    journal.close()
    lost = sum(r["lost"] for r in results)
    print(f"journal: {len(changes)} changes, {len(events)} events, {lost} races lost")


@pytest.mark.integration
def test_a_trial_another_sidecar_enqueued_is_left_to_it(postgres_url: str) -> None:
    """Sidecar B enqueued its trial and has not asked yet; sidecar A's next move waits for B's
    lock, then starts another config, and B gets its own trial."""
    migrate(postgres_url)
    a, b = search(postgres_url, 1), search(postgres_url, 2)
    first_move = {**BASELINE, "precision": "bf16"}
    got: dict[str, Any] = {}
    engine = sa.create_engine(postgres_url, poolclass=NullPool)
    locks = StateLocks(postgres_url)
    with locks.held(f"seedance:study:{STUDY}"):  # what B's next move holds
        b.study.enqueue_trial(first_move)  # B, between its enqueue and its ask
        waiter = threading.Thread(target=lambda: got.update(a=a.next_move(BASELINE, SPACE)))
        waiter.start()
        with engine.connect() as conn:  # until A is queued on the lock
            while waiter.is_alive() and not conn.execute(sa.text("SELECT count(*) FROM pg_locks WHERE "
                                           "locktype = 'advisory' AND NOT granted")).scalar():
                conn.rollback()
        mine = b.study.ask(b.distributions)
        b.renew(mine.number)  # its lease, as B's next move takes it
    waiter.join(timeout=60)
    engine.dispose()
    locks.close()
    assert mine.params == first_move
    assert got["a"] is not None and got["a"].values != first_move
    assert a.lock_waits == 1
    trial = b.records.trial(mine.number)
    assert trial.state == TrialState.RUNNING and FAIL_REASON not in trial.user_attrs
    a.close()
    b.close()
