"""The fleet registry on a real state database (a SQLite file, and a real PostgreSQL) shared by
several members: claims, the 409 a live owner causes, stale owners, heartbeats and what the
directory reads back. Time is a clock the test moves (heartbeat ages are compared with it,
never with the wall clock)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies import sqlite_url
from tuner import FleetDirectory, FleetMember, JobClaimedError, JobRegistry, Knob

KNOBS = [Knob(name="threads", default=2, low=1, high=8, integer=True)]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One state database the members share: a SQLite file, or a real PostgreSQL's."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgres_url"))
    return sqlite_url(tmp_path / "state.db")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def member(db: str, clock: Clock, name: str, *, study: str | None = None) -> FleetMember:
    registry = JobRegistry(lease_ttl_s=30)
    found = FleetMember(db, registry, url=f"http://{name}.test:4318", heartbeat_s=1.0,
                        clock=clock, study_of=lambda job: study)
    found.start()
    return found


@pytest.fixture
def members(db: str, clock: Clock) -> Iterator[list[FleetMember]]:
    made = [member(db, clock, name) for name in ("a", "b")]
    yield made
    for m in made:
        m.shutdown()


def attach(m: FleetMember, job: str, threads: int = 2) -> None:
    m._registry.attach(job, knobs=KNOBS, baseline={"threads": threads})


def test_a_live_owner_keeps_its_job_and_the_refusal_names_it(
        members: list[FleetMember], db: str) -> None:
    a, b = members
    attach(a, "gpt", threads=4)
    with pytest.raises(JobClaimedError) as refused:
        attach(b, "gpt")
    assert a.sidecar_id in str(refused.value) and "http://a.test:4318" in str(refused.value)
    assert b._registry.jobs() == []  # the refused attach left nothing behind
    with FleetDirectory(db, heartbeat_s=1.0, clock=lambda: a._clock()) as fleet:
        [job] = fleet.jobs()
    assert job.owner_id == a.sidecar_id and job.owner is not None and job.owner.alive
    assert job.baseline is not None and job.baseline.values == {"threads": 4}
    assert a.owns("gpt") and not b.owns("gpt") and b.owns("never-attached")


def test_a_stale_owner_loses_its_job_to_the_next_claim(
        members: list[FleetMember], db: str, clock: Clock) -> None:
    a, b = members
    attach(a, "gpt")
    clock.now += a.stale_after_s - 0.5
    b.beat()  # b lives on; a is silent
    with pytest.raises(JobClaimedError):
        attach(b, "gpt")
    clock.now += 1.0  # a's heartbeat is now older than STALE_PERIODS periods
    attach(b, "gpt")
    with FleetDirectory(db, heartbeat_s=1.0, clock=clock) as fleet:
        job = fleet.job("gpt")
        assert job is not None and job.owner_id == b.sidecar_id
        assert {s.sidecar_id: s.alive for s in fleet.sidecars()} == {
            a.sidecar_id: False, b.sidecar_id: True}
    a.beat()  # a comes back: it sees it lost the job and stops driving its changes
    assert not a.owns("gpt") and b.owns("gpt")


def test_a_heartbeat_keeps_the_claim_and_refreshes_the_kept_config(
        members: list[FleetMember], db: str, clock: Clock) -> None:
    a, b = members
    attach(a, "gpt")
    for _ in range(5):  # well past the stale age, with a beating all along
        clock.now += 1.0
        a.beat()
    with pytest.raises(JobClaimedError):
        attach(b, "gpt")
    a._registry.set_baseline("gpt", {"threads": 6})
    a.beat()
    with FleetDirectory(db, heartbeat_s=1.0, clock=clock) as fleet:
        job = fleet.job("gpt")
    assert job is not None and job.seen_at == clock.now
    assert job.baseline is not None and job.baseline.values == {"threads": 6}


def test_a_clean_shutdown_frees_the_jobs_at_once(db: str, clock: Clock) -> None:
    a, b = member(db, clock, "a"), member(db, clock, "b")
    try:
        attach(a, "gpt")
        a.shutdown()
        attach(b, "gpt")
        assert b.owns("gpt")
    finally:
        a.shutdown()
        b.shutdown()


def test_a_restarted_sidecar_takes_its_jobs_back_without_waiting(db: str, clock: Clock) -> None:
    first = member(db, clock, "a")
    attach(first, "gpt")
    first._stop.set()  # killed: no clean shutdown, its heartbeat looks fresh
    again = member(db, clock, "a")  # same host and URL, new process
    try:
        assert again.owns("gpt")  # its changes are this process's to recover
        attach(again, "gpt")
    finally:
        again.shutdown()
        first.shutdown()


def test_of_many_simultaneous_claims_exactly_one_wins(db: str, clock: Clock) -> None:
    made = [member(db, clock, f"s{i}") for i in range(6)]
    won: list[str] = []
    refused: list[str] = []
    barrier = threading.Barrier(len(made))

    def claim(m: FleetMember) -> None:
        barrier.wait()
        try:
            m.claim("gpt", "train")
            won.append(m.sidecar_id)
        except JobClaimedError:
            refused.append(m.sidecar_id)

    threads = [threading.Thread(target=claim, args=(m,)) for m in made]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(won) == 1 and len(refused) == len(made) - 1
        with FleetDirectory(db, heartbeat_s=1.0, clock=clock) as fleet:
            job = fleet.job("gpt")
        assert job is not None and job.owner_id == won[0]
    finally:
        for m in made:
            m.shutdown()


def test_the_claim_never_touches_the_fingerprint(members: list[FleetMember], db: str) -> None:
    from sqlalchemy import update

    from tuner._fleet_tables import jobs_table

    a, b = members
    attach(a, "gpt")
    with a._engine.begin() as conn:
        conn.execute(update(jobs_table).values(fingerprint='{"params": 124000000}'))
    a.shutdown()
    attach(b, "gpt")
    with b._engine.connect() as conn:
        assert conn.execute(jobs_table.select()).mappings().one()["fingerprint"] == (
            '{"params": 124000000}')


def test_a_reader_of_a_state_db_without_fleet_tables_reads_empty(tmp_path: Path) -> None:
    with FleetDirectory(sqlite_url(tmp_path / "old.db")) as fleet:
        assert fleet.jobs() == [] and fleet.sidecars() == [] and fleet.job("gpt") is None
