"""Benchmark: what a search's ``next_move`` and ``tell`` cost on PostgreSQL, old code against new.

A sidecar's search proposes each trial with ``tuner.SearchDriver.next_move`` (choose the next
single move from the job's baseline, start it as a leased trial, under the study's lock) and
ends it with ``tell``. Every statement is a round trip to the shared PostgreSQL, and on a busy
fleet each round trip waits its turn, so the statement count sets the tail (issue #14: ask/tell
p99 at most 200 ms at 16 sidecars). This bench runs the same loop as ``bench/fleet.py``'s study
prober, on one real PostgreSQL 15 (``tests/postgres.py``, a fresh database per arm and round),
with nothing else running:

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new``: this tree.

Each arm runs ``--calls`` next_move + tell pairs on the simulated job's three knobs
(``bench/_fleet_job.py``), a kept move (one in three, seeded) becoming the baseline, a new study
when every move was tried; arms alternate (base, new, base, new, ...) in fresh processes, and
the first 20 calls of each warm up (not counted). Each arm's process freezes its start-up heap
before it starts, as a sidecar does, so garbage-collector pauses do not decide the tail.

With ``--busy K``, K processes spin on the CPU (at the default priority) through every arm,
as a fleet node's jobs and other sidecars keep its cores busy: there each round trip waits for
PostgreSQL's backend and then the caller to get a core again, so the statement count shows.

Targets: new at most base (p50 and p99 of next_move); the issue's 200 ms p99.

Run: python bench/study_ask.py [--base HEAD~1 --rounds 3 --calls 300 --busy 0]
Results: bench/results/study_ask.json (``--busy K``: study_ask_busyK.json)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._ab_result import write_ab_result  # noqa: E402
from bench._busy import busy_cores  # noqa: E402
from bench._targets import Target, at_most  # noqa: E402
from bench._worktree import worktree  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "study_ask.json"
WARMUP = 20


def targets(result: dict[str, Any]) -> list[Target]:
    """New at most base at p50 and p99; new p99 within the issue's 200 ms."""
    s = result["summary"]
    return [
        at_most("next_move p50, new / base", 1.0, s["next_move_p50_new_over_base"],
                "bench docstring (no regression)"),
        at_most("next_move p99, new / base", 1.0, s["next_move_p99_new_over_base"],
                "bench docstring (no regression)"),
        at_most(f"next_move p99 ms, new, {result['protocol'].get('busy_cores', 0)} cores kept busy",
                200.0, s["new"]["next_move_p99_ms"],
                "issue #14 (its 16-sidecar figure is bench/results/fleet_n16.json)")]


def one_arm(tree: Path, url: str, calls: int) -> dict[str, list[float]]:
    """next_move and tell latencies (ms) of ``calls`` pairs, with the code of ``tree``."""
    sys.path.insert(0, str(tree))
    import gc

    import numpy as np
    from _fleet_knobs import KNOBS, timed_step

    from tuner import SearchConfig, SearchDriver
    from tuner._knobs import KnobSpace

    gc.collect()
    gc.freeze()  # as a sidecar process does (seedancectl._sidecar.settle_heap), in both arms

    space = KnobSpace.of(KNOBS)
    rng = np.random.default_rng(0)
    out: dict[str, list[float]] = {"next_move": [], "tell": []}
    search: SearchDriver | None = None
    studies = 0
    baseline: dict[str, Any] = {}
    for i in range(calls + WARMUP):
        if search is None:
            studies += 1
            search = SearchDriver(space, storage_url=url,
                                  config=SearchConfig(study_name=f"ask-bench-{studies}"))
            baseline = {k.name: k.default for k in KNOBS}
        after, ask_ms, tell_ms = timed_step(search, baseline, space, rng)
        if after is None:
            search.close()
            search = None
            continue
        baseline = after
        if i >= WARMUP:
            out["next_move"].append(ask_ms)
            out["tell"].append(tell_ms)
    return out


def percentile(values: list[float], q: float) -> float:
    import numpy as np
    return round(float(np.percentile(values, q)), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="revision of the base arm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: tree of one arm
    parser.add_argument("--url", help=argparse.SUPPRESS)  # internal: its database
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_arm(Path(args.one), args.url, args.calls)))
        return
    from tests.postgres import PostgresServer

    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    base = worktree(base_rev, "study-ask-base-")
    runs: dict[str, list[dict[str, list[float]]]] = {"base": [], "new": []}
    try:
        with PostgresServer() as server:
            for r in range(args.rounds):
                for arm, tree in (("base", base), ("new", ROOT)):
                    name = f"{arm}{r}"
                    url = server.create_database(name)
                    with busy_cores(args.busy):
                        done = subprocess.run(
                            [sys.executable, str(Path(__file__).resolve()), "--one", str(tree),
                             "--url", url, "--calls", str(args.calls)],
                            cwd=tree, capture_output=True, text=True, check=True)
                    server.drop_database(name)
                    ms = json.loads(done.stdout.strip().splitlines()[-1])
                    runs[arm].append(ms)
                    print(f"round {r} {arm}: next_move p50 "
                          f"{statistics.median(ms['next_move']):.1f} ms", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       check=False, capture_output=True)

    def arm_summary(arm: str) -> dict[str, float]:
        pooled = {op: [v for run in runs[arm] for v in run[op]] for op in ("next_move", "tell")}
        return {f"{op}_{q}_ms": percentile(v, float(q[1:])) for op, v in pooled.items()
                for q in ("p50", "p99")}

    summary: dict[str, Any] = {"base": arm_summary("base"), "new": arm_summary("new")}
    for q in ("p50", "p99"):
        summary[f"next_move_{q}_new_over_base"] = round(
            summary["new"][f"next_move_{q}_ms"] / summary["base"][f"next_move_{q}_ms"], 4)
    results = RESULTS if not args.busy else RESULTS.with_name(f"study_ask_busy{args.busy}.json")
    write_ab_result(results, bench="study_ask", summary=summary, runs=runs, targets=targets,
                    protocol={"base": base_rev, "rounds": args.rounds, "calls": args.calls,
                              "warmup_calls": WARMUP, "busy_cores": args.busy,
                              "database": "PostgreSQL 15 on loopback",
                              "order": "base and new alternate per round, fresh process and database"})


if __name__ == "__main__":
    main()
