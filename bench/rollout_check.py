"""Benchmark: what the rollout's per-second non-finite guardrail and a small store query cost,
old code against new.

While a trial is live, the rollout checks the trial's config version every second with the
non-finite detector (``tuner.NonFiniteValues``: the detector on a ``VersionReader`` window of
that version), and each check reads the version's few training series through small store
queries. On a healthy job that check was most of an idle sidecar's CPU (issue #14: the API's
tail at 16 sidecars is the wait for a core). This bench times, on one store file:

- ``guardrail``: one check of one version's whole life (the detector on its window), as the
  rollout made each check before it read only what was new;
- ``guardrail_ticks``: one check of one ``tuner.NonFiniteValues``, called again and again as
  the rollout calls it each second (the first call reads the whole life, later ones what is
  new, every 30th the whole life again): the cost per tick;
- ``small query``: one raw query of one version's loss series.

The store is SIMULATED, written once per arm by this script with that arm's own store writer
(so each arm reads its own file format; the points are the same), shaped as the
fleet bench's job (``bench/_fleet_job.py``): 8 ranks x 500 module-group norms every 5 s over
300 s, and 5 config versions of 60 s each with the training series (step, loss, gradient norm,
non-finite step counter, learning rate) every second, all healthy; and, as a job exporting its
stats-step series does, each group's non-finite element count every 5 s of each version.

Arms, each in a fresh process on its own file, alternate (base, new, base, new, ...):

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new``: this tree.

Targets: new at most base for each (median of ``--calls`` calls a round, rounds pooled).

Run: python bench/rollout_check.py [--base 7bd399d --rounds 3 --calls 120]
Results: bench/results/rollout_check.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._ab_result import write_ab_result  # noqa: E402
from bench._targets import Target, at_most  # noqa: E402
from bench._worktree import worktree  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "rollout_check.json"
JOB = "rollout-check"
VERSIONS = 5
VERSION_S = 60
RANKS = 8
GROUPS = 500
WARMUP = 10
OPS = ("guardrail", "guardrail_ticks", "small_query")


def targets(result: dict[str, Any]) -> list[Target]:
    """New at most base for each timed operation (no regression)."""
    return [at_most(f"{op} median, new / base", 1.0, result["summary"][f"{op}_new_over_base"],
                    "bench docstring (what the rollout's check costs an idle sidecar)")
            for op in OPS]


def write_store(path: Path) -> None:
    """The SIMULATED job's store (see the module docstring)."""
    import numpy as np

    from collectors import CONFIG_VERSION_ATTR, TimeSeriesStore
    from collectors.names import ATTR_SEEDANCE_RANK, ATTR_SERVICE_NAME

    start = time.time_ns() - VERSIONS * VERSION_S * 10**9
    with TimeSeriesStore(path) as store:
        for v in range(1, VERSIONS + 1):
            t = start + ((v - 1) * VERSION_S + np.arange(VERSION_S)) * 10**9
            steps = np.arange(VERSION_S, dtype=np.float64) + (v - 1) * VERSION_S
            for rank in range(RANKS):
                attrs = {ATTR_SERVICE_NAME: JOB, ATTR_SEEDANCE_RANK: str(rank),
                         CONFIG_VERSION_ATTR: str(v)}
                for name, values in (
                        ("seedance.train.step", steps),
                        ("seedance.train.loss", 2.0 - steps / 1000.0),
                        ("seedance.train.grad.norm", np.full(VERSION_S, 0.5)),
                        ("seedance.train.learning_rate", np.full(VERSION_S, 1e-3))):
                    store.write_series(name, attrs, t, values)
                store.write_series("seedance.train.nonfinite_steps",
                                   {**attrs, "seedance.nonfinite.what": "grad_norm"}, t,
                                   np.zeros(VERSION_S))
                for g in range(GROUPS):
                    store.write_series("seedance.train.grad.nonfinite",
                                       {**attrs, "seedance.module_group": f"block{g}"}, t[::5],
                                       np.zeros(t[::5].shape[0]))
            store.flush()
        grid = start + np.arange(0, VERSIONS * VERSION_S, 5) * 10**9
        for rank in range(RANKS):
            for g in range(GROUPS):
                store.write_series("seedance.train.grad.group_norm",
                                   {ATTR_SERVICE_NAME: JOB, ATTR_SEEDANCE_RANK: str(rank),
                                    "seedance.module.group": f"block{g}"},
                                   grid, np.full(grid.shape[0], 0.3))
        store.flush()


def one_arm(path: Path, calls: int, tree: Path) -> dict[str, list[float]]:
    """Time each operation ``calls`` times (after ``WARMUP``) with the code first on sys.path
    (imported here, not at the top, so the arm's tree decides)."""
    import collectors
    from collectors import CONFIG_VERSION_ATTR, TimeSeriesStore
    from collectors.names import ATTR_SERVICE_NAME
    from policies import StoreWindow
    from policies.detectors import NonFiniteDetector
    from tuner._version_reader import VersionReader

    store = TimeSeriesStore(path, readonly=True)
    detector = NonFiniteDetector()
    where = {ATTR_SERVICE_NAME: JOB, CONFIG_VERSION_ATTR: str(VERSIONS)}

    def guardrail() -> object:
        return detector.evaluate(StoreWindow(VersionReader(store, JOB, VERSIONS), job=JOB,
                                             since_ns=0, until_ns=2**62))

    from tuner import Change, NonFiniteValues

    live = NonFiniteValues()
    change = Change(id="bench", job=JOB, state="observing", source="trial", reason="bench",
                    risk="low", scope="live", values={}, baseline={}, created_at_s=0.0,
                    expires_at_s=1.0)

    def guardrail_ticks() -> object:
        return live.check(change, VERSIONS, store)

    def small_query() -> object:
        return store.query("seedance.train.loss", where=where, since_ns=0, until_ns=2**62,
                           resolution="raw")

    if not Path(str(collectors.__file__)).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"imported {collectors.__file__}, not the arm's tree")
    if guardrail():
        raise SystemExit("the SIMULATED job is healthy: the guardrail must find nothing")
    out: dict[str, list[float]] = {}
    for op, call in (("guardrail", guardrail), ("guardrail_ticks", guardrail_ticks),
                     ("small_query", small_query)):
        ms = []
        for i in range(WARMUP + calls):
            t0 = time.perf_counter()
            call()
            if i >= WARMUP:
                ms.append((time.perf_counter() - t0) * 1000)
        out[op] = ms
    store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="7bd399d", help="revision of the base arm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=120)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: the store of one arm
    parser.add_argument("--tree", help=argparse.SUPPRESS)  # internal: the code of that arm
    parser.add_argument("--write", help=argparse.SUPPRESS)  # internal: write that arm's store
    args = parser.parse_args()
    if args.one or args.write:
        sys.path.insert(0, args.tree)  # ahead of this tree: the arm's code is imported
        if args.write:
            write_store(Path(args.write))
        else:
            print(json.dumps(one_arm(Path(args.one), args.calls, Path(args.tree))))
        return
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    base = worktree(base_rev, "rollout-check-base-")
    runs: dict[str, list[dict[str, list[float]]]] = {"base": [], "new": []}
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-check-") as tmp:
            stores = {arm: Path(tmp) / f"{arm}.db" for arm in ("base", "new")}
            for arm, tree in (("base", base), ("new", ROOT)):  # each in its arm's format
                subprocess.run([sys.executable, str(Path(__file__).resolve()), "--write",
                                str(stores[arm]), "--tree", str(tree)], cwd=tree, check=True)
            for r in range(args.rounds):
                for arm, tree in (("base", base), ("new", ROOT)):
                    done = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--one",
                         str(stores[arm]), "--tree", str(tree), "--calls", str(args.calls)],
                        cwd=tree, capture_output=True, text=True, check=True)
                    ms = json.loads(done.stdout.strip().splitlines()[-1])
                    runs[arm].append(ms)
                    print(f"round {r} {arm}: " + ", ".join(
                        f"{op} {statistics.median(ms[op]):.2f} ms" for op in OPS), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       check=False, capture_output=True)

    def median(arm: str, op: str) -> float:
        return round(statistics.median(v for run in runs[arm] for v in run[op]), 3)

    summary: dict[str, Any] = {arm: {f"{op}_median_ms": median(arm, op) for op in OPS}
                               for arm in runs}
    for op in OPS:
        summary[f"{op}_new_over_base"] = round(
            summary["new"][f"{op}_median_ms"] / summary["base"][f"{op}_median_ms"], 4)
    write_ab_result(RESULTS, bench="rollout_check", summary=summary, runs=runs, targets=targets,
                    protocol={"base": base_rev, "rounds": args.rounds, "calls": args.calls,
                              "warmup_calls": WARMUP, "store": "SIMULATED (see the bench's docstring)",
                              "order": ("base and new alternate per round, fresh process; "
                                        "each arm reads the same points, written by its own "
                                        "code")})


if __name__ == "__main__":
    main()
