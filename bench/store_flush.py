"""Benchmark: what a store flush of many series costs while the sidecar's other threads are busy,
old code against new.

A sidecar's store flushes about once a second, on a background thread, while the receiver's
threads decode requests and the event loop answers them: the flush gets the interpreter lock
only between their turns. A flush writes a row per series it holds (its point count and time
span) and, now and then, chunks and rollup pieces. ``sqlite3``'s ``executemany`` gives the lock
up around every row's step, so beside busy threads each row waits for it to come back.

Each arm, in a fresh process with its tree first on ``sys.path``, writes SIMULATED exports
(``--series`` gauge series, one point each per flush, as 64 exporters x 250 series send) into a
new store and times ``flush()`` ``--flushes`` times, first with no other thread, then beside one
Python thread that spins (``sys.setswitchinterval(0.001)``, as the sidecar sets it). Arms
alternate (base, new, base, new, ...):

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new``: this tree.

Target: new at most base (median flush time, rounds pooled), idle and busy; no issue states a
number.

Run: python bench/store_flush.py [--base HEAD~1 --rounds 3 --series 16000 --flushes 12]
Results: bench/results/store_flush.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._ab_result import write_ab_result  # noqa: E402
from bench._targets import Target, at_most  # noqa: E402
from bench._worktree import base_and_new  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "store_flush.json"
MODES = ("idle", "busy")


def targets(result: dict[str, Any]) -> list[Target]:
    """New at most base (no regression), with and without a busy thread."""
    return [at_most(f"flush median {mode}, new / base", 1.0,
                    result["summary"][f"{mode}_new_over_base"],
                    "bench docstring (a flush beside the sidecar's busy threads)")
            for mode in MODES]


def one_arm(tree: Path, series: int, flushes: int) -> dict[str, list[float]]:
    """Milliseconds of each flush after the first, idle then busy, with the code of ``tree``."""
    import numpy as np

    import collectors
    from collectors import TimeSeriesStore

    if not Path(str(collectors.__file__)).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"imported {collectors.__file__}, not the arm's tree")
    sys.setswitchinterval(0.001)
    rng = np.random.default_rng(0)
    start = time.time_ns() - 3600 * 10**9
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="store-flush-") as tmp, \
            TimeSeriesStore(Path(tmp) / "metrics.db", flush_interval_s=3600) as store:
        store._writer.stop_flusher()  # flushes are timed here, on this thread
        step = 0
        for mode in MODES:
            stop = threading.Event()
            spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
            if mode == "busy":
                spinner.start()
            times = []
            for _ in range(flushes + 1):
                t = start + step * 10**9
                step += 1
                for s in range(0, series, 250):  # one export of 250 series per rank
                    store.write([_point(t, s + i, float(v)) for i, v in
                                 enumerate(rng.random(min(250, series - s)).tolist())])
                t0 = time.perf_counter()
                store.flush()
                times.append((time.perf_counter() - t0) * 1000)
            stop.set()
            if mode == "busy":
                spinner.join()
            out[mode] = times[1:]
    return out


def _spin(stop: threading.Event) -> None:
    """A thread that only runs Python: it wants the interpreter lock all the time."""
    n = 0
    while not stop.is_set():
        n += 1


def _point(t: int, s: int, value: float) -> Any:
    from collectors import Point

    return Point("seedance.train.grad.group_norm", value, t,
                 {"service.name": "job", "seedance.rank": str(s // 250),
                  "seedance.module_group": f"block{s % 250}"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="revision of the base arm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--series", type=int, default=16_000)
    parser.add_argument("--flushes", type=int, default=12)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: the tree of one arm
    args = parser.parse_args()
    if args.one:
        sys.path.insert(0, args.one)  # ahead of this tree: the arm's code is imported
        print(json.dumps(one_arm(Path(args.one), args.series, args.flushes)))
        return

    def one(r: int, arm: str, tree: Path) -> dict[str, list[float]]:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--one", str(tree),
             "--series", str(args.series), "--flushes", str(args.flushes)],
            cwd=tree, capture_output=True, text=True, check=True)
        ms: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"round {r} {arm}: " + ", ".join(
            f"{mode} median {statistics.median(ms[mode]):.0f} ms" for mode in MODES), flush=True)
        return ms

    base_rev, runs = base_and_new(args.base, "store-flush-base-", args.rounds, one)

    def median(arm: str, mode: str) -> float:
        return round(statistics.median(v for run in runs[arm] for v in run[mode]), 1)

    summary: dict[str, Any] = {arm: {f"flush_median_ms_{mode}": median(arm, mode)
                                     for mode in MODES} for arm in runs}
    for mode in MODES:
        summary[f"{mode}_new_over_base"] = round(median("new", mode) / median("base", mode), 4)
    write_ab_result(RESULTS, bench="store_flush", summary=summary, runs=runs, targets=targets,
                    protocol={"base": base_rev, "rounds": args.rounds, "series": args.series,
                              "flushes": args.flushes, "points_per_series_per_flush": 1,
                              "data": "SIMULATED (random gauge values, see the docstring)",
                              "order": "base and new alternate per round, fresh process"})


if __name__ == "__main__":
    main()
