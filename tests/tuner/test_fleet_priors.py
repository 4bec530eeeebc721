"""Fleet priors from a real SQLite state database: two past jobs tuned through the real
rollout controller and search (SIMULATED jobs holding real leases, ``tests.tuner._simjob``),
with the fingerprints of real torch models; a new job's search gets the near job's kept
config as its first trial, and not the far one's."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from sqlalchemy import insert, select

from collectors import JobFingerprint, sqlite_url, state_engine
from collectors._store import TimeSeriesStore
from collectors.torch_fingerprint import job_fingerprint
from tests.tuner._simjob import KNOBS, SimJob
from tuner import (
    FLEET_HALVED_WHY,
    FLEET_TIE_WHY,
    FLEET_WHY,
    Change,
    ChangeJournal,
    FleetJobs,
    FleetPriors,
    KnobSpace,
    NoFingerprintError,
    fleet_moves,
    fleet_source_of,
    lead_kind,
)
from tuner._fleet_priors import best_tie, kept_config
from tuner._fleet_tables import jobs_table
from tuner._lease import JobRegistry
from tuner._rollout import RolloutController
from tuner._search import SearchDriver
from tuner._search_config import SearchConfig
from tuner._space import Move, search_space
from tuner._tuning_loop import TuningLoop
from tuner._verdict import RolloutConfig
from tuner._windows import MeasureConfig
from workloads.families import family

SPACE = KnobSpace.of(KNOBS)
SLOW = {"fp32": 1.0, "bf16": 0.1, "fp16": 0.05}
MLP_SMALL, MLP_BASE, CNN = "mlp-small", "mlp-base", "cnn"


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


def fingerprint(name: str, **build: bool) -> JobFingerprint:
    return job_fingerprint(family(name).build(**build).model, speedups=SLOW)


def throughput(best: int) -> Callable[[Any], float]:
    """tokens/s by micro-batch, fastest at ``best`` (1, 2, 4 or 8)."""
    return lambda values: 100.0 * (1.0 + 0.5 * (values["micro_batch"] == best)
                                   - 0.05 * abs(values["micro_batch"] - best))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A state database in which job mlp-small kept micro_batch 4 and job cnn kept 2, each
    through the real controller and its own search, with their models' fingerprints."""
    clock = Clock()
    registry = JobRegistry(lease_ttl_s=30.0, clock=clock)
    url = sqlite_url(tmp_path / "state.db")
    with TimeSeriesStore(tmp_path / "metrics.db") as store:
        ctl = RolloutController(registry, store, db_url=url, clock=clock, config=(
            RolloutConfig(min_pairs=3, max_pairs=8, measure=MeasureConfig(
                warmup_steps=2, min_steps=4, min_window_s=0.01))))
        jobs = FleetJobs(url)
        loop = TuningLoop(ctl)
        simulated = []
        for job, best, fp in ((MLP_SMALL, 4, fingerprint("mlp", small=True)),
                              (CNN, 2, fingerprint("cnn_bn", small=True))):
            sim = SimJob(registry, store, job=job, step_s=lambda v, b=best: 1 / throughput(b)(v),
                         tokens_per_step=1)
            ctl.set_mode(job, "auto", by="test")
            jobs.record_fingerprint(job, fp, kind="train", sidecar_id="s1", study=job)
            loop.add_search(job, SearchDriver(SPACE, storage_url=url, knobs=("micro_batch",),
                                              config=SearchConfig(study_name=job, seed=0),
                                              clock=clock))
            simulated.append(sim)
        for _ in range(80):
            loop.step()
            for sim in simulated:
                sim.run(8)
        yield {"url": url, "ctl": ctl, "jobs": jobs, "registry": registry}
        jobs.close()
        ctl.close()


def test_a_new_job_tries_the_config_kept_by_the_nearest_past_job_first(
        fleet: dict[str, Any]) -> None:
    registry, ctl = fleet["registry"], fleet["ctl"]
    assert registry.status(MLP_SMALL).baseline.values["micro_batch"] == 4  # what they kept
    assert registry.status(CNN).baseline.values["micro_batch"] == 2
    priors = FleetPriors(fleet["jobs"], ctl.journal)
    sources = priors.sources(MLP_BASE, fingerprint("mlp"))
    assert [s.job for s in sources] == [MLP_SMALL]  # the cnn kept a config too, but is far
    (source,) = sources
    assert source.values == {"micro_batch": 4} and 0 < source.distance < 0.25
    kept = ctl.changes(job=MLP_SMALL)
    assert source.changes == tuple(c.id for c in kept if c.state == "kept")
    assert source.gain == pytest.approx(math.prod(
        1 + c.comparison["gain"] for c in kept if c.state == "kept") - 1)

    driver = SearchDriver(SPACE, storage_url=fleet["url"], knobs=("micro_batch", "precision"),
                          config=SearchConfig(study_name="seedance:mlp-base", seed=0))
    baseline = SPACE.defaults()  # micro_batch 8, as the past jobs launched
    moves = fleet_moves(sources, baseline, driver.distributions)
    where = f"{MLP_SMALL} (distance {source.distance:.2f})"
    # the base mlp has 2x the small one's parameters or more: the kept config at half its
    # micro-batch comes right after the kept config itself
    assert source.size_ratio >= 2 and source.micro_batch == 4
    assert moves == [Move(values={"micro_batch": 4}, expected_gain=source.gain, once=True,
                          why=f"{FLEET_WHY} {where}"),
                     Move(values={"micro_batch": 2}, expected_gain=source.gain, once=True,
                          why=f"{FLEET_HALVED_WHY} {where}")]
    driver.add_priors(moves)
    first = driver.next_move(baseline, SPACE)
    assert first is not None and first.values["micro_batch"] == 4
    assert fleet_source_of(first.origin) == MLP_SMALL and lead_kind(first.origin) == "kept"
    driver.tell(first.number, 150.0)  # kept: the halved lead is next, from the new baseline
    second = driver.next_move({**baseline, "micro_batch": 4}, SPACE)
    assert second is not None and second.values["micro_batch"] == 2
    assert fleet_source_of(second.origin) == MLP_SMALL
    assert lead_kind(second.origin) == "kept mb/2"


def test_no_near_job_no_fleet_prior_and_a_job_never_its_own_source(
        fleet: dict[str, Any]) -> None:
    priors = FleetPriors(fleet["jobs"], fleet["ctl"].journal)
    assert priors.sources("rnn", fingerprint("rnn", small=True)) == []
    assert priors.sources(MLP_BASE, fingerprint("mlp"), limit=0) == []
    # the stored fingerprint of mlp-small is used when none is given; it is not its own source
    assert priors.sources(MLP_SMALL) == []


def test_a_fleet_prior_that_regressed_is_not_tried_again_from_the_next_baseline(
        tmp_path: Path) -> None:
    driver = SearchDriver(SPACE, storage_url=sqlite_url(tmp_path / "state.db"),
                          knobs=("micro_batch", "precision", "prefetch"),
                          config=SearchConfig(study_name="s", seed=0, revisit_after_s=None))
    prior = Move(values={"micro_batch": 2, "precision": "bf16"}, expected_gain=0.5,
                 why=f"{FLEET_WHY} far-away (distance 0.20)", once=True)
    direction = Move(values={"precision": "bf16"}, expected_gain=0.1, why="compute prior")
    driver.add_priors([prior, direction])
    assert driver.priors() == [prior, direction]  # stored in the study, ``once`` too
    launch = SPACE.defaults()
    first = driver.next_move(launch, SPACE)
    assert first is not None and first.origin == prior.why
    driver.tell(first.number, 50.0)  # it regressed here
    second = driver.next_move(launch, SPACE)
    assert second is not None and second.origin == "compute prior"
    driver.tell(second.number, 50.0)
    moved = {**launch, "prefetch": 3}  # another move was kept: a new baseline
    after = driver.next_move(moved, SPACE)
    # the compute prior is a direction, tried again from here; the fleet prior is not
    assert after is not None and after.origin == "compute prior"
    driver.tell(after.number, 50.0)
    origins = []
    while (proposal := driver.next_move(moved, SPACE)) is not None:
        origins.append(proposal.origin)
        driver.tell(proposal.number, 50.0)
    assert prior.why not in origins


def change(job: str, n: int, baseline: dict[str, Any], values: dict[str, Any], state: str,
           gain: float | None, **checks: Any) -> Change:
    return Change(id=f"{job}-{n}", job=job, state=state, source="trial",  # type: ignore[arg-type]
                  reason="r", risk="low", scope="live", values=values, baseline=baseline,
                  created_at_s=float(n), expires_at_s=float(n),
                  comparison=None if gain is None else {"gain": gain, **checks})


def journal_of(tmp_path: Path, job: str, launch: dict[str, Any],
               steps: list[tuple[dict[str, Any], str, float | None, dict[str, Any]]]
               ) -> ChangeJournal:
    """A real journal holding ``job``'s changes in order, each judged against the baseline
    its kept ones before it left."""
    journal = ChangeJournal(sqlite_url(tmp_path / "state.db"))
    baseline = dict(launch)
    for n, (values, state, gain, checks) in enumerate(steps):
        journal.add(change(job, n, baseline, values, state, gain, **checks), actor="t",
                    reason="r", version_before=None, detail={})
        if state == "kept":
            baseline = {**baseline, **values}
    return journal


def test_the_kept_config_is_the_final_baseline_of_the_kept_changes_and_their_gains(
        tmp_path: Path) -> None:
    launch = {"micro_batch": 8, "threads": 1, "precision": "fp32"}
    journal = journal_of(tmp_path, "j", launch, [
        ({"micro_batch": 4}, "kept", 0.20, {}),
        ({"precision": "bf16"}, "rolled_back", -0.3, {}),  # not kept: not in it
        ({"threads": 2}, "kept", 0.10, {}),
        ({"micro_batch": 8}, "kept", 0.05, {}),  # moved back: micro_batch is left out
        ({"threads": 2}, "kept", None, {})])  # kept, not measured (an operator's): no gain
    assert kept_config(journal, "nobody") is None
    values, gain, ids = kept_config(journal, "j")  # type: ignore[misc]
    assert values == {"threads": 2}
    assert gain == pytest.approx(1.2 * 1.1 * 1.05 - 1)
    assert ids == ("j-0", "j-2", "j-3", "j-4")
    journal.close()


def test_a_tie_measured_faster_than_the_kept_config_leads_and_nothing_that_failed_does(
        tmp_path: Path) -> None:
    launch = {"micro_batch": 8, "threads": 1, "precision": "fp32", "prefetch": 2}
    tie = {"pairs": 6, "ci_low": -0.01, "ci_high": 0.05}
    journal = journal_of(tmp_path, "j", launch, [
        # a tie before the kept change: +21% over the launch config, below what the kept
        # config and the later tie reached (a gain read without its baseline would win)
        ({"prefetch": 4}, "rolled_back", 0.21, tie),
        ({"micro_batch": 4}, "kept", 0.20, {"pairs": 6, "ci_low": 0.1, "ci_high": 0.3}),
        ({"threads": 2}, "rolled_back", 0.02, tie),  # 1.2 x 1.02: the best measured
        ({"precision": "bf16"}, "rolled_back", 0.5, {**tie, "loss_ok": False}),
        ({"precision": "fp16"}, "rolled_back", 0.5, {**tie, "latency_ok": False}),
        ({"prefetch": 8}, "rolled_back", 0.5, {**tie, "quality_ok": False}),
        ({"prefetch": 1}, "rolled_back", 0.01, {**tie, "ci_high": -0.01}),  # a measured loss
        ({"prefetch": 6}, "failed", 0.5, tie)])
    best, gain = best_tie(journal, "j")  # type: ignore[misc]
    assert best == {"micro_batch": 4, "threads": 2}
    assert gain == pytest.approx(1.2 * 1.02 - 1)
    assert best_tie(journal, "nobody") is None
    journal.close()

    # a job whose ties all measured below its kept config leads with the kept config only
    other = journal_of(tmp_path / "other", "k", launch, [
        ({"micro_batch": 4}, "kept", 0.20, {}),
        ({"threads": 2}, "rolled_back", -0.01, tie),
        ({"micro_batch": 2}, "rolled_back", 0.0, tie)])
    assert best_tie(other, "k") is None
    other.close()


def test_a_sources_best_measured_config_is_tried_before_its_kept_one() -> None:
    from tuner import FleetSource
    space = search_space(SPACE, ["micro_batch", "threads"])
    source = FleetSource(job="a", distance=0.05, values={"micro_batch": 4}, gain=0.2,
                         changes=("a-1",), best={"micro_batch": 4, "threads": 2},
                         best_gain=0.224)
    baseline = {"micro_batch": 8, "threads": 1}
    moves = fleet_moves([source], baseline, space)
    assert [(m.values, m.expected_gain) for m in moves] == [
        ({"micro_batch": 4, "threads": 2}, 0.224), ({"micro_batch": 4}, 0.2)]
    assert moves[0].why == f"{FLEET_TIE_WHY} a (distance 0.05)"
    assert [fleet_source_of(m.why) for m in moves] == ["a", "a"]
    # where the new job already runs the tie's extra knob, both leads are one move
    assert [m.values for m in fleet_moves([source], {**baseline, "threads": 2}, space)] == [
        {"micro_batch": 4}]


def test_only_a_job_twice_the_sources_size_or_more_tries_half_its_micro_batch() -> None:
    from tuner import FleetSource
    space = search_space(SPACE, ["micro_batch", "threads"])
    baseline = {"micro_batch": 8, "threads": 1}

    def leads(**fields: Any) -> list[dict[str, Any]]:
        source = FleetSource(job="a", distance=0.1, values={"threads": 2}, gain=0.3,
                             changes=("a-1",), **fields)
        return [m.values for m in fleet_moves([source], baseline, space)]

    # the source kept threads only: its final micro-batch (its launch one) is halved
    assert leads(micro_batch=8, size_ratio=3.5) == [{"threads": 2},
                                                   {"threads": 2, "micro_batch": 4}]
    assert leads(micro_batch=8, size_ratio=2.0) == leads(micro_batch=8, size_ratio=3.5)
    for no_halving in ({"micro_batch": 8, "size_ratio": 1.9},  # a size of about its own
                       {"micro_batch": 8, "size_ratio": 0.25},  # smaller: no doubling
                       {"micro_batch": 1, "size_ratio": 4.0},  # nothing to halve
                       {"micro_batch": None, "size_ratio": 4.0}):  # no micro-batch knob
        assert leads(**no_halving) == [{"threads": 2}], no_halving
    # half an odd micro-batch rounds up (3 -> 2, not 1)
    assert leads(micro_batch=3, size_ratio=4.0) == [{"threads": 2},
                                                   {"threads": 2, "micro_batch": 2}]
    # half a micro-batch outside this job's domain (12 -> 6), or the one it runs (16 -> 8),
    # leaves the kept lead only
    assert leads(micro_batch=12, size_ratio=4.0) == [{"threads": 2}]
    assert leads(micro_batch=16, size_ratio=4.0) == [{"threads": 2}]


def test_a_source_that_kept_nothing_leads_only_a_job_twice_its_size_to_half_its_micro_batch(
        tmp_path: Path) -> None:
    launch = {"micro_batch": 8, "threads": 2}
    journal = journal_of(tmp_path, "small", launch, [
        ({"threads": 1}, "rolled_back", -0.4, {}), ({"micro_batch": 4}, "rolled_back", -0.1, {})])
    url = sqlite_url(tmp_path / "state.db")
    jobs = FleetJobs(url)
    small = JobFingerprint(modules={"Conv2d": 6, "BatchNorm2d": 6}, params=100_000, device="cpu")
    jobs.record_fingerprint("small", small, kind="train", sidecar_id="s", study=None)
    jobs.record_fingerprint("idle", small, kind="train", sidecar_id="s", study=None)  # no trials
    priors = FleetPriors(jobs, journal)
    same = dataclasses.replace(small, params=150_000)
    assert priors.sources("same-size", same) == []  # its launch config is no lead
    big = dataclasses.replace(small, params=350_000)
    (source,) = priors.sources("big", big)
    assert (source.job, source.values, source.gain, source.micro_batch) == ("small", {}, 0.0, 8)
    assert source.size_ratio == pytest.approx(3.5)
    space = search_space(SPACE, ["micro_batch", "threads"])
    (move,) = fleet_moves([source], launch, space)
    assert move.values == {"micro_batch": 4} and lead_kind(move.why) == "kept mb/2"
    jobs.close()
    journal.close()


def test_fleet_moves_keep_what_this_job_may_search_nearest_first() -> None:
    from tuner import FleetSource
    space = search_space(SPACE, ["micro_batch", "prefetch", "precision"])
    baseline = {"micro_batch": 8, "prefetch": 2, "precision": "fp32", "threads": 2}

    def source(job: str, distance: float, **values: Any) -> FleetSource:
        return FleetSource(job=job, distance=distance, values=values, gain=0.1, changes=())

    sources = [source("a", 0.01, micro_batch=3, prefetch=2),  # 3: not a choice; 2: as now
               source("b", 0.02, threads=4, prefetch=9),  # threads not searched, 9 > high 8
               source("c", 0.03, micro_batch=4, prefetch=4, bogus=1),
               source("d", 0.04, micro_batch=4, prefetch=4),  # the same move as c
               source("e", 0.05, precision="bf16"),
               source("f", 0.06, micro_batch=2)]
    moves = fleet_moves(sources, baseline, space, limit=2)
    assert [m.values for m in moves] == [{"micro_batch": 4, "prefetch": 4},
                                         {"precision": "bf16"}]
    assert [fleet_source_of(m.why) for m in moves] == ["c", "e"]
    assert fleet_source_of("one step of micro_batch") is None


def test_fingerprint_writes_leave_the_owners_columns_alone(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "state.db")
    jobs = FleetJobs(url)
    fp = JobFingerprint(modules={"Linear": 2}, params=10, device="cpu")
    engine = state_engine(url)
    with engine.begin() as conn:  # another part of the sidecar wrote the ownership first
        conn.execute(insert(jobs_table).values(job="owned", sidecar_id="owner", kind="serve",
                                               study="s", attached_at=1.0, seen_at=2.0))
        conn.execute(insert(jobs_table).values(job="garbled", sidecar_id="x", kind="train",
                                               fingerprint="{not json", attached_at=1.0,
                                               seen_at=1.0))
    jobs.record_fingerprint("owned", fp, kind="train", sidecar_id="me", study=None)
    jobs.record_fingerprint("new", fp, kind="train", sidecar_id="me", study="seedance:new")
    with engine.connect() as conn:
        rows = {r.job: r for r in conn.execute(select(jobs_table))}
    engine.dispose()
    owned, new = rows["owned"], rows["new"]
    assert (owned.sidecar_id, owned.kind, owned.study, owned.attached_at, owned.seen_at) == (
        "owner", "serve", "s", 1.0, 2.0)
    assert JobFingerprint.from_json(json.loads(owned.fingerprint)) == fp
    assert (new.sidecar_id, new.kind, new.study) == ("me", "train", "seedance:new")
    assert jobs.fingerprints() == {"owned": fp, "new": fp}  # the garbled one is skipped

    priors = FleetPriors(jobs, ChangeJournal(url, create=False))
    with pytest.raises(NoFingerprintError, match="unknown job 'nobody'"):
        priors.fingerprint("nobody")
    with pytest.raises(NoFingerprintError, match="job 'garbled' has no fingerprint yet"):
        priors.fingerprint("garbled")
    jobs.close()


def test_a_reader_finds_no_fingerprints_in_a_database_without_the_fleet_tables(
        tmp_path: Path) -> None:
    jobs = FleetJobs(sqlite_url(tmp_path / "state.db"), create=False)
    assert jobs.fingerprints() == {} and not jobs.known("any")
    jobs.close()
