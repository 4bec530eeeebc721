"""Benchmark: the operator API's latency on a node whose cores are busy, old code against new.

A sidecar shares its node with the job it watches, and on a busy node (the job's own threads,
other sidecars, a fleet's N = 16 in ``bench/fleet.py``) every one of its answers waits for a
core. Each round starts two sidecars at once on loopback, one per arm, each with its own
SIMULATED job (``bench/_fleet_job.py``: 8 ranks x 500 module-group norms, the real lease
client and instrumentation around a sleep; set up as ``bench/idle_sidecar.py`` does, which
also gives each sidecar's CPU), and ``--busy`` processes spinning at the default priority
(``bench/_busy.py``: the job's cores):

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new``: this tree.

After ``--warmup-s`` (the policy window fills and passes run), one reader thread calls
``/v1/status``, ``/v1/changes`` and ``/v1/findings`` of the two sidecars in turn, alternating
arms call by call so the box's drift hits both alike, for ``--seconds``; every call is timed.

Target: new p99 at most base p99 (median of the rounds' ratios), with the sidecars' CPU
reported beside it.

Run: python bench/api_latency.py [--base HEAD~1 --rounds 3 --seconds 90 --busy 2]
Results: bench/results/api_latency.json
"""

from __future__ import annotations

import argparse
import itertools
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

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._busy import busy_cores  # noqa: E402
from bench._targets import Target, at_most, judged  # noqa: E402
from bench._worktree import worktree  # noqa: E402
from bench.idle_sidecar import ARMS, cpu_s, start_arm, stop_arms  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "api_latency.json"
PATHS = ("/v1/status", "/v1/changes", "/v1/findings")


def targets(result: dict[str, Any]) -> list[Target]:
    """No regression, and the gain is what the change is for."""
    return [at_most("API p99, new / base (median of rounds)", 1.0,
                    result["summary"]["p99_new_over_base"],
                    "bench docstring (issue #14: API p99 <= 100 ms at N = 16)")]


def ready(url: str, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} never became ready")


def one_round(trees: dict[str, Path], warmup_s: float, seconds: float,
              busy: int) -> dict[str, dict[str, float]]:
    """Both arms side by side on a busy box: each arm's call latencies and CPU share."""
    work = Path(tempfile.mkdtemp(prefix="seedance-api-latency-"))
    procs = {arm: start_arm(work, arm, trees[arm]) for arm in ARMS}
    urls = {}
    for arm in ARMS:
        config = (work / arm / "sidecar.toml").read_text()
        port = config.split('listen = "127.0.0.1:', 1)[1].split('"', 1)[0]
        urls[arm] = f"http://127.0.0.1:{port}"
    try:
        for url in urls.values():
            ready(url)
        with busy_cores(busy):
            time.sleep(warmup_s)
            before = {arm: cpu_s(p[0].pid) for arm, p in procs.items()}
            latencies: dict[str, list[float]] = {arm: [] for arm in ARMS}
            errors = dict.fromkeys(ARMS, 0)
            with httpx.Client(timeout=30) as http:
                start = time.monotonic()
                for path, arm in itertools.cycle(itertools.product(PATHS, ARMS)):
                    if time.monotonic() - start > seconds:
                        break
                    t0 = time.perf_counter()
                    try:
                        ok = http.get(urls[arm] + path).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    took_ms = (time.perf_counter() - t0) * 1e3
                    if ok:
                        latencies[arm].append(took_ms)
                    else:
                        errors[arm] += 1
                took = time.monotonic() - start
            after = {arm: cpu_s(p[0].pid) for arm, p in procs.items()}
        for arm, (sidecar, _) in procs.items():
            if sidecar.poll() is not None:
                raise SystemExit(f"the {arm} sidecar exited: see {work / arm / 'sidecar.log'}")
        return {arm: {"calls": len(latencies[arm]), "errors": errors[arm],
                      "p50_ms": float(np.percentile(latencies[arm], 50)),
                      "p99_ms": float(np.percentile(latencies[arm], 99)),
                      "max_ms": max(latencies[arm]),
                      "sidecar_core_share": (after[arm] - before[arm]) / took}
                for arm in ARMS}
    finally:
        stop_arms(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="revision of the base arm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--warmup-s", type=float, default=45.0)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes (busy cores)")
    args = parser.parse_args()
    base = worktree(args.base, "seedance-api-latency-base-")
    try:
        rounds = [one_round({"base": base, "new": ROOT}, args.warmup_s, args.seconds, args.busy)
                  for _ in range(args.rounds)]
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       check=False, capture_output=True)

    def median(arm: str, key: str) -> float:
        return statistics.median(r[arm][key] for r in rounds)

    p99_ratios = [r["new"]["p99_ms"] / r["base"]["p99_ms"] for r in rounds]
    result: dict[str, Any] = {
        "bench": "api_latency",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base": args.base,
        "busy_processes": args.busy,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "protocol": __doc__,
        "rounds": rounds,
        "summary": {**{f"{arm}_{key}_median": median(arm, key) for arm in ARMS
                       for key in ("p50_ms", "p99_ms", "sidecar_core_share")},
                    "p99_new_over_base": statistics.median(p99_ratios),
                    "p99_new_over_base_by_round": p99_ratios},
    }
    result = judged(result, targets(result))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for i, r in enumerate(rounds):
        print(f"round {i}: " + ", ".join(
            f"{arm} p50/p99 {r[arm]['p50_ms']:.1f}/{r[arm]['p99_ms']:.1f} ms, "
            f"CPU {r[arm]['sidecar_core_share']:.3f}" for arm in ARMS))
    print(f"p99 new / base {result['summary']['p99_new_over_base']:.3f}; wrote {RESULTS}")


if __name__ == "__main__":
    main()
