"""Benchmark: what the store's fold costs a sidecar of a large job, old code against new.

About once a minute the store folds its journals: every series' points of the last minute
become a raw chunk, a 1-minute rollup piece and a 1-hour rollup piece, each encoded
(``collectors/_store_codec.py``) and written in one transaction. For a job of 8 ranks x 500
module groups that is 4,000 series x 3 small blobs a minute, on whichever thread flushes.

Each arm, in a fresh process with its tree first on ``sys.path``, writes SIMULATED exports
(``--ranks`` x ``--groups`` gauge series, random values, one point per series every 5 s, a
flush per export as the receiver makes it) into a new store, and times the retention pass
(``prune()``: a fold, then retention) after each minute of them, as a sidecar runs one a
minute, for ``--minutes`` minutes (the first is not counted: it also sets up the series'
blocks). Results before 2026-12-07 timed ``fold()`` alone, which left out that each pass made
the next fold look up every series' pieces again. A fold also merges a block's pieces (``pieces_to_merge``), which a run of a
few minutes hardly reaches: ``--minutes 120`` covers a whole 2-hour block, and the mean and
the 95th percentile then count the merges the median leaves out. Arms alternate (base, new,
base, new, ...):

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new``: this tree.

Target: new at most base (median and mean fold time, rounds pooled); no issue states a
number.

Run: python bench/store_fold.py [--base HEAD~1 --rounds 3 --minutes 4 --out FILE]
Results: bench/results/store_fold.json (a whole block: store_fold_block.json)
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
from bench._worktree import base_and_new  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "store_fold.json"
EXPORT_S = 5


def targets(result: dict[str, Any]) -> list[Target]:
    """New at most base (no regression)."""
    summary = result["summary"]
    return [at_most(f"fold {stat}, new / base", 1.0, summary[key],
                    "bench docstring (what a fold costs a sidecar of a large job)")
            for stat, key in (("median", "fold_new_over_base"),
                              ("mean", "fold_mean_new_over_base"))
            if key in summary]  # results before 2026-12-07 state the median only


def one_arm(tree: Path, ranks: int, groups: int, minutes: int) -> list[float]:
    """Milliseconds of each fold after the first, with the code of ``tree``."""
    import numpy as np

    import collectors
    from collectors import Point, TimeSeriesStore

    if not Path(str(collectors.__file__)).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"imported {collectors.__file__}, not the arm's tree")
    rng = np.random.default_rng(0)
    start = time.time_ns() - (minutes + 1) * 60 * 10**9
    folds = []
    with tempfile.TemporaryDirectory(prefix="store-fold-") as tmp, \
            TimeSeriesStore(Path(tmp) / "metrics.db") as store:
        for export in range((minutes + 1) * 60 // EXPORT_S):
            t = start + export * EXPORT_S * 10**9
            values = rng.random(ranks * groups).tolist()
            store.write([Point("seedance.train.grad.group_norm", values[r * groups + g], t,
                               {"service.name": "job", "seedance.rank": str(r),
                                "seedance.module_group": f"block{g}"})
                         for r in range(ranks) for g in range(groups)])
            store.flush()
            if (export + 1) % (60 // EXPORT_S) == 0:
                t0 = time.perf_counter()
                store.prune(now_ns=t)
                folds.append((time.perf_counter() - t0) * 1000)
    return folds[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="revision of the base arm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--minutes", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--groups", type=int, default=500)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: the tree of one arm
    args = parser.parse_args()
    if args.one:
        sys.path.insert(0, args.one)  # ahead of this tree: the arm's code is imported
        print(json.dumps(one_arm(Path(args.one), args.ranks, args.groups, args.minutes)))
        return
    def one(r: int, arm: str, tree: Path) -> dict[str, list[float]]:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--one", str(tree),
             "--ranks", str(args.ranks), "--groups", str(args.groups),
             "--minutes", str(args.minutes)],
            cwd=tree, capture_output=True, text=True, check=True)
        ms = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"round {r} {arm}: fold median {statistics.median(ms):.0f} ms", flush=True)
        return {"fold": ms}

    base_rev, runs = base_and_new(args.base, "store-fold-base-", args.rounds, one)

    def folds(arm: str) -> list[float]:
        return [v for run in runs[arm] for v in run["fold"]]

    summary: dict[str, Any] = {arm: {
        "fold_median_ms": round(statistics.median(folds(arm)), 1),
        "fold_mean_ms": round(statistics.fmean(folds(arm)), 1),
        "fold_p95_ms": round(statistics.quantiles(folds(arm), n=20, method="inclusive")[-1], 1),
        "fold_max_ms": round(max(folds(arm)), 1)} for arm in runs}
    for stat, key in (("median", "fold_new_over_base"), ("mean", "fold_mean_new_over_base")):
        summary[key] = round(summary["new"][f"fold_{stat}_ms"]
                             / summary["base"][f"fold_{stat}_ms"], 4)
    write_ab_result(args.out, bench="store_fold", summary=summary, runs=runs, targets=targets,
                    protocol={"base": base_rev, "rounds": args.rounds, "minutes": args.minutes,
                              "series": args.ranks * args.groups, "export_s": EXPORT_S,
                              "data": "SIMULATED (random gauge values, see the docstring)",
                              "order": "base and new alternate per round, fresh process"})


if __name__ == "__main__":
    main()
