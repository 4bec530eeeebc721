"""Benchmark: does a job of a family the fleet has seen reach its kept config in at most half
the trials of a cold start?

For each family of ``workloads.families``, on this machine:

1. job A, the family's small size (``Family.small``), is tuned on a state database SHARED by
   the whole run (every family's jobs are in it, as in a fleet);
2. job B, the family's base size, is tuned COLD on a database of its own: its search ends
   keeping some config K after some trials;
3. job B is tuned WARM on the shared database: its search gets the fleet priors (the best
   configs measured on the past jobs nearest to it by fingerprint) first.

Counted, for both B searches alike: the trials until the baseline reaches K, that is, K itself
or a config measured within the rollout's resolution of it (at least K / (1 + min_gain)): a
config the rollout could not leave for K, since it keeps no change of less than ``min_gain``.
Where reduced precision runs fast, one model has many configs within a few percent of each
other (per-group precisions), and which of them a search keeps is a coin toss of the
measurement. The strict count (K itself, or a config measured at least as fast) is reported
beside it (``*_strict``).

Each search is the REAL ``tuner.SearchDriver`` (its study, its single moves, its priors
ordering, ``on_finished`` with the change) with the REAL fleet priors (``tuner.FleetPriors``
reading the real fingerprints of the real models, ``collectors.torch_fingerprint``, and the
change journal in which each search's changes were recorded). What is replayed is the
measurement: each trial's verdict comes from a truth table measured for real on this CPU,
labelled "replayed measurement" in the JSON. A config's entry is its tokens/s relative to the
job's launch config, measured on demand the first time a search asks for it (and then reused,
so B's cold and warm searches meet the same truth): ``run_steps`` visits interleaved with the
launch config, as ``bench/generalisation.py`` measures its grid. A trial is kept when the
candidate's tokens/s over its baseline's (both from the table) is above the rollout's
``min_gain`` (+3%), the rollout's keep rule without its confidence interval.

Target (each family seen before, i.e. every family: its small job ran first): warm trials to
B's cold kept config <= cold trials / 2. A family whose cold search keeps its launch config
(0 trials) or needs one trial cannot do better than tie; it is reported, with "n/a".

Run: python bench/fleet_priors.py [--families mlp,vit --rounds 3]  (8 minutes for the five
families on a mostly quiet 2-core box, 19-25 minutes while other processes loaded it: a truth
measurement taken while they used more than a quarter of the CPUs is taken again, up to
three times); ``--families wide_transformer --merge`` re-measures one family and keeps the
others. Results: bench/results/fleet_priors.json (the latest run on a CPU with fast bf16);
fleet_priors_run_a.json to _run_g.json are the others: a to c before a source's best
measured config led, counted strictly, f and g the latest, on a CPU without fast bf16, with the
half-micro-batch lead; docs/tuning.md, "fleet priors", gives them all.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench._default_session import code_revision  # noqa: E402
from bench._targets import Target, at_most, holds, judged  # noqa: E402
from bench.generalisation import CONTENDED, CpuMeter, Restorer, interleave  # noqa: E402
from collectors import JobFingerprint, sqlite_url  # noqa: E402
from collectors.torch_fingerprint import job_fingerprint  # noqa: E402
from collectors.torch_profile import dtype_speedups  # noqa: E402
from tuner import (  # noqa: E402
    Change,
    ChangeJournal,
    FleetJobs,
    FleetPriors,
    KnobSpace,
    RolloutConfig,
    SearchConfig,
    SearchDriver,
    Window,
    fingerprint_distance,
    fleet_moves,
)
from workloads.families import FAMILIES, Built, family  # noqa: E402
from workloads.train_family import (  # noqa: E402
    Config,
    config_label,
    default_config,
    live_knobs,
    null_session,
    run_steps,
)

RESULTS = ROOT / "bench" / "results" / "fleet_priors.json"
MIN_GAIN = RolloutConfig().min_gain
REPLAYED = "replayed measurement"
ATTEMPTS = 3
"""Tries of a truth measurement while other processes load the box (the least loaded counts)."""


# ---- the truth table ------------------------------------------------------------------------


class Truth:
    """Each config's tokens/s relative to the job's launch config on this CPU.

    ``grid_round`` visits every config within ``reach`` micro-batch steps of the launch
    config (both thread counts) once, in a shuffled order, the launch config between every
    ``reference_every`` of them (``bench.generalisation.interleave``); a config's figure is the
    median over rounds of its tokens/s / the mean of the launch visits around it. The rounds
    of a family's two sizes alternate, so both tables see the box in the same states (it is
    shared, and on 2 cores a busy neighbour turns 2 threads from the fastest into the slowest).
    A config outside the grid is measured when a search first asks for it, ``rounds`` rounds
    against the launch config. A measurement taken while other processes loaded the box is
    taken again (``_measure``)."""

    def __init__(self, built: Built, *, steps: int, rounds: int, reach: int, seed: int) -> None:
        self.built = built
        self.launch = default_config(built)
        self._steps, self._rounds, self._seed = steps, rounds, seed
        self._restorer = Restorer(built)
        knobs = live_knobs(built)
        sizes = sorted(int(m) for m in knobs["micro_batch"])
        at = sizes.index(int(self.launch["micro_batch"]))
        self.grid = {config_label(c): c for c in (
            {**self.launch, "threads": t, "micro_batch": m}
            for t in sorted({min(knobs["threads"]), max(knobs["threads"])})
            for m in sizes[max(0, at - reach):at + reach + 1])}
        self.relatives: dict[str, list[float]] = {config_label(self.launch): [1.0]}
        self.lazy: set[str] = set()
        self.seconds = 0.0
        self.foreign: list[float] = []
        """Other processes' share of the CPUs during each measurement kept."""
        self.discarded = 0
        """Measurements taken again because the box was busy."""
        self._visit_s = 30.0

    def grid_round(self, r: int) -> None:
        began = time.monotonic()
        if r == 0:
            probe = run_steps(self.built, self.launch, 2, warmup=1)
            self._visit_s = max(2.0, 4 * (self._steps + 1) * statistics.median(
                s for _, s in probe))
        self._measure(self.grid, rounds=1, seed=self._seed + r)
        self.seconds += time.monotonic() - began

    def __call__(self, config: Config) -> float:
        label = config_label(config)
        if label not in self.relatives:
            began = time.monotonic()
            self.lazy.add(label)
            self._measure({label: dict(config)}, rounds=self._rounds, seed=self._seed)
            self.seconds += time.monotonic() - began
        return statistics.median(self.relatives[label])

    def _measure(self, configs: Mapping[str, Config], *, rounds: int, seed: int) -> None:
        """Measure ``configs`` against the launch config; a measurement during which other
        processes used more than ``CONTENDED`` of the CPUs is taken again (up to
        ``ATTEMPTS`` in all; the least contended one counts)."""
        launch = config_label(self.launch)
        tries: list[tuple[float, dict[str, list[float]]]] = []
        for attempt in range(ATTEMPTS):
            meter = CpuMeter()
            arms = interleave(self.built, {launch: self.launch, **configs}, launch,
                              rounds=rounds, steps=self._steps, visit_s=self._visit_s,
                              reference_every=4, prune_below=None, seed=seed + 100 * attempt,
                              restorer=self._restorer, echo=f"  [{self.built.family.name}] ")
            foreign = meter.foreign_share()
            tries.append((foreign, {label: arm.relatives if arm.finite else [0.0]
                                    for label, arm in arms.items() if label != launch}))
            if not foreign > CONTENDED:
                break
            print(f"  [{self.built.family.name}] other processes used {foreign:.0%} of the "
                  "CPUs: measured again", flush=True)
        foreign, kept = min(tries, key=lambda t: t[0] if math.isfinite(t[0]) else 1.0)
        self.foreign.append(round(foreign, 3))
        self.discarded += len(tries) - 1
        for label, relatives in kept.items():
            self.relatives.setdefault(label, []).extend(relatives)

    def table(self) -> dict[str, Any]:
        return {label: {"relative": round(statistics.median(v), 4), "visits": len(v),
                        "on_demand": label in self.lazy}
                for label, v in self.relatives.items()}


class Unmeasured(Exception):
    """A search asked for a config its recorded truth table does not hold."""


class RecordedTruth:
    """A truth table another run measured (``--truth-from``), for judging a change to the
    search or its priors on the very measurements an earlier run judged the code before it
    by. A config the table lacks cannot be measured on this box in its place (another CPU,
    perhaps with other fast precisions): asking for it raises ``Unmeasured``."""

    def __init__(self, launch: Config, table: Mapping[str, Mapping[str, Any]]) -> None:
        self.launch = launch
        self._relative = {label: float(entry["relative"]) for label, entry in table.items()}
        self.seconds, self.foreign, self.discarded = 0.0, [], 0
        self.lazy: set[str] = set()

    def __call__(self, config: Config) -> float:
        label = config_label(config)
        if label not in self._relative:
            raise Unmeasured(label)
        return self._relative[label]

    def table(self) -> dict[str, Any]:
        return {label: {"relative": v, "recorded": True} for label, v in self._relative.items()}


# ---- one replayed search ----------------------------------------------------------------------


def search_space(built: Built, fingerprint: JobFingerprint) -> tuple[KnobSpace, list[str]]:
    """The knobs the job declares and the ones the sidecar's search takes (its live knobs):
    a precision the device does not run fast is excluded from the search, as the job's
    session excludes it when it measured the device (``search_excludes``)."""
    space = null_session(built).knobs
    slow = tuple(p for p in ("bf16", "fp16") if p not in fingerprint.fast_dtypes)
    space = KnobSpace.of(
        dataclasses.replace(k, search_excludes=slow) if k.name.startswith("precision.") else k
        for k in space.knobs.values())
    return space, list(space.searchable().knobs)


def replay_search(job: str, built: Built, fingerprint: JobFingerprint,
                  truth: Truth | RecordedTruth, *, db_url: str, max_trials: int
                  ) -> dict[str, Any]:
    """Tune ``job`` until every single move from its baseline was tried (or ``max_trials``,
    or a recorded truth table lacks the next candidate: ``unmeasured``), each trial judged
    from ``truth``; its changes journaled and its fingerprint recorded in ``db_url``, so later
    jobs' fleet priors see them."""
    space, names = search_space(built, fingerprint)
    jobs, journal = FleetJobs(db_url), ChangeJournal(db_url)
    study = f"seedance:{job}"
    try:
        jobs.record_fingerprint(job, fingerprint, kind="train", sidecar_id="bench", study=study)
        driver = SearchDriver(space, storage_url=db_url, knobs=names,
                              config=SearchConfig(study_name=study, seed=0,
                                                  revisit_after_s=None))
        baseline: dict[str, Any] = dict(truth.launch)
        sources = FleetPriors(jobs, journal).sources(job, fingerprint)
        moves = fleet_moves(sources, baseline, driver.distributions)
        driver.add_priors(moves)
        trials: list[dict[str, Any]] = []
        unmeasured = None
        while len(trials) < max_trials:
            proposal = driver.next_move(baseline, space)
            if proposal is None:
                break
            candidate = {**baseline, **proposal.values}
            try:
                before, after = truth(baseline), truth(candidate)
            except Unmeasured as missing:
                unmeasured = str(missing)
                break
            gain = after / before - 1 if before > 0 else math.nan
            state = "kept" if gain > MIN_GAIN else "rolled_back"
            change = _replayed_change(job, study, proposal.number, proposal.origin, baseline,
                                      candidate, before, after, gain, state)
            journal.add(change, actor="bench", reason=change.reason, version_before=None,
                        detail={"values": change.values, "baseline": baseline})
            driver.on_finished(change)
            if state == "kept":
                baseline = candidate
            trials.append({"trial": proposal.number, "config": config_label(candidate),
                           "origin": proposal.origin, "gain": round(gain, 4), "state": state,
                           "baseline_after": config_label(baseline),
                           "baseline_relative": round(truth(baseline), 4)})
        return {"sources": [s.to_json() for s in sources],
                "fleet_priors": [m.to_json() for m in moves], "trials": trials,
                "kept": config_label(baseline), "kept_relative": truth(baseline),
                "converged": len(trials) < max_trials and unmeasured is None,
                **({} if unmeasured is None else {"unmeasured": unmeasured})}
    finally:
        jobs.close()
        journal.close()


def _replayed_change(job: str, study: str, number: int, origin: str, baseline: Config,
                     candidate: Config, before: float, after: float, gain: float,
                     state: str) -> Change:
    """The change a controller would have journaled for this trial, its two arms' windows
    and comparison taken from the truth table."""
    now = time.time()

    def window(arm: str, relative_tokens: float) -> Window:
        return Window(version=0, arm=arm, steps=0, step_s=math.nan,  # type: ignore[arg-type]
                      tokens_per_s=relative_tokens, loss=math.nan, nonfinite_loss=False,
                      start_ns=int(now * 1e9), end_ns=int(now * 1e9))

    return Change(
        id=f"{job}-{number}", job=job, state=state, source="trial",  # type: ignore[arg-type]
        reason=f"trial {number} of study {study} ({origin}); {REPLAYED}", risk="low",
        scope="live", values={k: v for k, v in candidate.items() if baseline.get(k) != v},
        baseline=dict(baseline), created_at_s=now, expires_at_s=now,
        meta={"study": study, "trial": number, "origin": origin},
        plan={"ended_because": REPLAYED},
        windows=(window("candidate", after), window("baseline", before)),
        comparison={"gain": gain})


def targets(report: Mapping[str, Any]) -> list[Target]:
    """Issue #14: a second job of a family seen before reaches its kept config in at most half
    the trials of a cold start; judged where the cold search needed 2 or more trials."""
    source = "issue #14 (judged where the cold search needs 2 or more trials)"
    judged_ = [at_most(f"{name}: warm trials to the cold kept config",
                       f["cold_trials_to_kept"] / 2, f["warm_trials_to_kept"], source)
               for name, f in report["families"].items() if f["target_applies"]]
    return judged_ or [holds("a family the target applies to", "at least one", 0, False, source)]


def trials_to(run: Mapping[str, Any], target: str, target_relative: float,
              truth: Truth, *, resolution: float = 0.0) -> tuple[int | None, str]:
    """Trials until the run's baseline is ``target`` (0: it started there) or a config
    measured at least ``target_relative / (1 + resolution)``, whichever comes first; (None,
    why) if neither."""
    launch = config_label(truth.launch)
    if launch == target:
        return 0, "the launch config"
    floor = target_relative / (1.0 + resolution)
    for i, trial in enumerate(run["trials"], start=1):
        if trial["baseline_after"] == target:
            return i, "the same config"
        if trial["baseline_relative"] >= target_relative:
            return i, "a config measured at least as fast"
        if trial["baseline_relative"] >= floor:
            return i, f"a config measured within {resolution:.0%}"
    return None, "never reached"


# ---- one family -------------------------------------------------------------------------------


@contextlib.contextmanager
def recorded_launch_threads(recorded: Mapping[str, Any] | None) -> Iterator[None]:
    """A replay runs at the recorded launch config's threads: the threads knob's default, and
    so the launch config of a family without launch threads of its own, is this process's
    torch threads, which whatever ran in it before may have changed (in a pytest worker an
    earlier test had set 1, and a replay of a run launched at 2 searched from 1)."""
    before = torch.get_num_threads()
    threads = (None if recorded is None
               else recorded["launch_config"].split("/", 1)[0].removeprefix("t"))
    if threads is not None and threads.isdigit():
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bench_family(name: str, shared_db: str, workdir: Path, args: argparse.Namespace,
                 recorded: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One family's three searches, on truth tables measured now or, with ``recorded`` (that
    family's entry of an earlier run's results), on that run's tables and fingerprints."""
    fam = family(name)
    small, base = fam.build(args.seed, small=True), fam.build(args.seed)
    began = time.monotonic()
    meter = CpuMeter()
    truth_small: Truth | RecordedTruth
    truth_base: Truth | RecordedTruth
    if recorded is not None:
        fp_small, fp_base = (JobFingerprint.from_json(recorded["sizes"][k]["fingerprint"])
                             for k in ("A", "B"))
        truth_small, truth_base = (RecordedTruth(default_config(built), recorded["truth"][k])
                                   for built, k in ((small, "A"), (base, "B")))
    else:
        speedups = dtype_speedups("cpu")
        fp_small = job_fingerprint(small.model, speedups=speedups)
        fp_base = job_fingerprint(base.model, speedups=speedups)
        truth_small, truth_base = (Truth(built, steps=args.steps, rounds=args.rounds,
                                         reach=args.reach, seed=args.seed)
                                   for built in (small, base))
        for r in range(args.rounds):  # the two sizes' rounds alternate: the same box for both
            for size, truth in (("small", truth_small), ("base", truth_base)):
                print(f"[{name}] truth of the {size} size, round {r + 1}/{args.rounds}: "
                      f"{len(truth.grid)} configs", flush=True)
                truth.grid_round(r)
    foreign = {"grid": meter.foreign_share()}
    meter = CpuMeter()
    job_a, job_b = f"{name}-small", f"{name}-base"
    print(f"[{name}] A: {job_a} on the shared database", flush=True)
    a = replay_search(job_a, small, fp_small, truth_small, db_url=shared_db,
                      max_trials=args.max_trials)
    print(f"[{name}] B cold: {job_b} on its own database", flush=True)
    cold = replay_search(job_b, base, fp_base, truth_base,
                         db_url=sqlite_url(workdir / f"cold-{name}.db"),
                         max_trials=args.max_trials)
    print(f"[{name}] B warm: {job_b} on the shared database", flush=True)
    warm = replay_search(job_b, base, fp_base, truth_base, db_url=shared_db,
                         max_trials=args.max_trials)
    foreign["searches"] = meter.foreign_share()
    target, target_relative = cold["kept"], cold["kept_relative"]
    cold_n, _ = trials_to(cold, target, target_relative, truth_base, resolution=MIN_GAIN)
    warm_n, warm_how = trials_to(warm, target, target_relative, truth_base,
                                 resolution=MIN_GAIN)
    cold_strict, _ = trials_to(cold, target, target_relative, truth_base)
    warm_strict, warm_how_strict = trials_to(warm, target, target_relative, truth_base)
    applies = cold_n is not None and cold_n >= 2
    return {
        "description": fam.description,
        "sizes": {"A": {"job": job_a, "fingerprint": fp_small.to_json()},
                  "B": {"job": job_b, "fingerprint": fp_base.to_json()}},
        "distance_A_B": round(fingerprint_distance(fp_small, fp_base), 4),
        "launch_config": config_label(truth_base.launch),
        "A": a, "B_cold": cold, "B_warm": warm,
        "cold_kept": target, "cold_kept_relative": target_relative,
        "cold_trials_to_kept": cold_n, "warm_trials_to_kept": warm_n,
        "warm_reached": warm_how, "reached_means": f"K, or measured within the rollout's "
        f"resolution of it (min_gain {MIN_GAIN:.0%})",
        "cold_trials_to_kept_strict": cold_strict, "warm_trials_to_kept_strict": warm_strict,
        "warm_reached_strict": warm_how_strict,
        "cold_trials_total": len(cold["trials"]), "warm_trials_total": len(warm["trials"]),
        "target": "warm_trials_to_kept <= cold_trials_to_kept / 2",
        "target_applies": applies,
        "target_met": (warm_n is not None and cold_n is not None and warm_n <= cold_n / 2)
        if applies else None,
        "truth": {"A": truth_small.table(), "B": truth_base.table()},
        "truth_seconds": {"A": round(truth_small.seconds, 1), "B": round(truth_base.seconds, 1)},
        "truth_foreign_cpu_share": {"A": truth_small.foreign, "B": truth_base.foreign},
        "truth_measured_again": {"A": truth_small.discarded, "B": truth_base.discarded},
        "foreign_cpu_share": {k: round(v, 3) for k, v in foreign.items()},
        "contended": any(v > CONTENDED for v in foreign.values()),
        "seconds": round(time.monotonic() - began, 1),
    }


def _fleet_distances(fps: Mapping[str, JobFingerprint]) -> dict[str, dict[str, float]]:
    return {a: {b: round(fingerprint_distance(fa, fb), 3) for b, fb in fps.items()}
            for a, fa in fps.items()}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--steps", type=int, default=3, help="measured steps per truth visit")
    p.add_argument("--rounds", type=int, default=3,
                   help="truth: interleaved rounds over each size's grid")
    p.add_argument("--reach", type=int, default=3,
                   help="truth grid: micro-batch sizes this many steps either side of launch")
    p.add_argument("--max-trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--merge", action="store_true",
                   help="keep the other families' results already in --out (same protocol): "
                        "re-measure a family whose box was busy")
    p.add_argument("--truth-from", type=Path, default=None,
                   help="judge the searches on the truth tables and fingerprints of this "
                        "earlier results file instead of measuring them (seconds, no torch "
                        "steps): this code's search on that run's measurements")
    args = p.parse_args(argv)
    recorded_run = None
    if args.truth_from is not None:
        try:
            recorded_run = json.loads(args.truth_from.read_text(encoding="utf-8"))
            recorded_families = recorded_run["families"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--truth-from {args.truth_from}: not a fleet_priors results file ({exc})")
        if args.merge:
            p.error("--truth-from replays another run: --merge does not apply")
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    for n in names:
        family(n)  # unknown names fail before anything runs
    if recorded_run is not None:
        names = [n for n in names if n in recorded_families]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    began = time.monotonic()
    load_start = os.getloadavg()
    report: dict[str, Any] = {
        "bench": "fleet_priors", "code_revision": code_revision(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "cpus": os.cpu_count()},
        "measurement": REPLAYED if recorded_run is None else (
            f"{REPLAYED}, truth tables recorded in {args.truth_from.name} (code "
            f"{recorded_run.get('code_revision')}, {recorded_run.get('measured_at')}, "
            f"{recorded_run.get('machine', {}).get('platform')}), not measured by this run"),
        "protocol": {"steps_per_visit": args.steps, "truth_rounds": args.rounds,
                     "truth_grid_reach": args.reach,
                     "max_trials": args.max_trials, "seed": args.seed, "keep_if_gain_above":
                     MIN_GAIN, "A": "small size, shared state database",
                     "B_cold": "base size, its own state database",
                     "B_warm": "base size, the shared state database (fleet priors)"},
        "families": {},
    }
    if args.merge and args.out.exists():
        before = json.loads(args.out.read_text(encoding="utf-8"))
        if before.get("protocol") != report["protocol"]:
            p.error(f"--merge: {args.out} was measured under another protocol")
        report["families"] = {k: v for k, v in before["families"].items() if k not in names}
    with tempfile.TemporaryDirectory(prefix="fleet-priors-") as tmp:
        workdir = Path(tmp)
        shared = sqlite_url(workdir / "shared.db")
        for n in names:
            print(f"=== {n} ===", flush=True)
            recorded = None if recorded_run is None else recorded_families[n]
            with recorded_launch_threads(recorded):
                measured = bench_family(n, shared, workdir, args, recorded)
            report["families"][n] = {
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "code_revision": code_revision(), "shared_database_with": names, **measured}
            fam = report["families"][n]
            print(f"[{n}] cold kept {fam['cold_kept']} in {fam['cold_trials_to_kept']} "
                  f"trials, warm in {fam['warm_trials_to_kept']} ({fam['warm_reached']})",
                  flush=True)
    fps = {f"{n}-{size}": JobFingerprint.from_json(f["sizes"][key]["fingerprint"])
           for n, f in report["families"].items() for key, size in (("A", "small"),
                                                                     ("B", "base"))}
    applies = {n: f["target_met"] for n, f in report["families"].items() if f["target_applies"]}
    report["fingerprint_distances"] = _fleet_distances(fps)
    report["summary"] = {
        "target": "for each family seen before: warm trials to B's cold kept config <= "
                  "cold trials / 2 (where the cold search needs 2 or more trials); reached: "
                  "the config, or one measured within the rollout's resolution of it",
        "met_by_family": {n: f["target_met"] for n, f in report["families"].items()},
        "raw_counts": {n: {"cold": f["cold_trials_to_kept"], "warm": f["warm_trials_to_kept"],
                           "cold_strict": f["cold_trials_to_kept_strict"],
                           "warm_strict": f["warm_trials_to_kept_strict"],
                           "cold_total": f["cold_trials_total"],
                           "warm_total": f["warm_trials_total"]}
                       for n, f in report["families"].items()},
        "met": bool(applies) and all(applies.values()),
        "wall_s_of_this_run": round(time.monotonic() - began, 1),
        "families_on_a_busy_box": sorted(n for n, f in report["families"].items()
                                         if f["contended"]),
        "load_average_start_end": [list(load_start), list(os.getloadavg())],
    }
    report = judged(report, targets(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
