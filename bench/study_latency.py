"""Benchmark: a search's ask and tell on a shared PostgreSQL with busy cores, old code against new.

Issue #14's fleet bench times ``next_move`` (choose a single move and start its trial, under
the study's lock) and ``tell`` from a prober beside 16 sidecars; one run of it swings by
100 ms at p99 with the box's load. This bench isolates the search's own cost: each round
starts one PostgreSQL 15 (``tests/postgres.py``: initdb + pg_ctl on loopback), keeps
``--busy`` processes spinning at the default priority (``bench/_busy.py``: a fleet node's jobs
and sidecars) and runs two probers at once, one per arm:

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new``: this tree.

Each prober (``bench/_study_prober.py``, run with its arm's tree first on the path) is a
sidecar's search minus the job, as the fleet bench's: ``SearchDriver.next_move`` from the
baseline, then ``tell``; a kept move (one in three) becomes the baseline and a search that
tried every move starts a new study. Every call is timed, with the statements it sent
(SQLAlchemy's cursor events). The knob space is ``--knobs`` knobs of 4 choices each (a real
job's space has 5-10: precision per module group, threads, micro-batch, ...).

Target: new p99 of ``next_move`` and of ``tell`` at most base's (median of the rounds' ratios);
issue #14's own target (ask/tell p99 <= 200 ms at N = 16) is the fleet bench's.

Run: python bench/study_latency.py [--base HEAD~1 --rounds 3 --seconds 60 --busy 2 --knobs 8]
Results: bench/results/study_latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._busy import busy_cores  # noqa: E402
from bench._targets import Target, at_most, judged  # noqa: E402
from bench._worktree import worktree  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "study_latency.json"
ARMS = ("base", "new")
OPS = ("next_move", "tell")


def targets(result: dict[str, Any]) -> list[Target]:
    return [at_most(f"{op} p99, new / base (median of rounds)", 1.0,
                    result["summary"][f"{op}_p99_new_over_base"], "bench docstring")
            for op in OPS]


def one_round(server: PostgresServer, trees: dict[str, Path], seconds: float, busy: int,
              knobs: int) -> dict[str, dict[str, Any]]:
    """Both arms' probers side by side, each on a database of its own on the one server."""
    work = Path(tempfile.mkdtemp(prefix="seedance-study-latency-"))
    procs = {}
    with busy_cores(busy):
        for arm in ARMS:
            out = work / f"{arm}.jsonl"
            procs[arm] = (out, subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "_study_prober.py"),
                 "--state-db", server.create_database(f"{arm}_{int(time.time() * 1e3)}"),
                 "--seconds", str(seconds), "--knobs", str(knobs), "--out", str(out)],
                env={**os.environ, "PYTHONPATH": str(trees[arm])}, cwd=trees[arm]))
        for arm, (_, proc) in procs.items():
            if proc.wait(seconds + 120) != 0:
                raise SystemExit(f"the {arm} prober failed (exit {proc.returncode})")
    summary: dict[str, dict[str, Any]] = {}
    for arm, (out, _) in procs.items():
        calls = [json.loads(line) for line in out.read_text().splitlines()]
        summary[arm] = {"steps": len(calls)}
        for op in OPS:
            ms = [c[f"{op}_ms"] for c in calls if c.get(f"{op}_ms") is not None]
            summary[arm][op] = {
                "calls": len(ms), "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)), "max_ms": max(ms),
                "statements_median": statistics.median(
                    c[f"{op}_statements"] for c in calls if c.get(f"{op}_ms") is not None)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="revision of the base arm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes (busy cores)")
    parser.add_argument("--knobs", type=int, default=8)
    args = parser.parse_args()
    base = worktree(args.base, "seedance-study-latency-base-")
    try:
        with PostgresServer() as server:
            rounds = [one_round(server, {"base": base, "new": ROOT}, args.seconds, args.busy,
                                args.knobs) for _ in range(args.rounds)]
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       check=False, capture_output=True)

    def ratios(op: str, key: str) -> list[float]:
        return [r["new"][op][key] / r["base"][op][key] for r in rounds]

    result: dict[str, Any] = {
        "bench": "study_latency",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base": args.base,
        "busy_processes": args.busy,
        "knobs": args.knobs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "protocol": __doc__,
        "rounds": rounds,
        "summary": {
            **{f"{arm}_{op}_{key}_median": statistics.median(r[arm][op][key] for r in rounds)
               for arm in ARMS for op in OPS
               for key in ("p50_ms", "p99_ms", "statements_median")},
            **{f"{op}_{key}_new_over_base": statistics.median(ratios(op, f"{key}_ms"))
               for op in OPS for key in ("p50", "p99")},
            **{f"{op}_p99_new_over_base_by_round": ratios(op, "p99_ms") for op in OPS}},
    }
    result = judged(result, targets(result))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for i, r in enumerate(rounds):
        print(f"round {i}: " + "; ".join(
            f"{arm} {op} p50/p99 {r[arm][op]['p50_ms']:.1f}/{r[arm][op]['p99_ms']:.1f} ms "
            f"({r[arm][op]['statements_median']:.0f} statements)"
            for arm in ARMS for op in OPS))
    print("p99 new / base: " + ", ".join(
        f"{op} {result['summary'][f'{op}_p99_new_over_base']:.3f}" for op in OPS)
        + f"; wrote {RESULTS}")


if __name__ == "__main__":
    main()
