"""Stability: the tests that once failed on a fresh clone, run again and again on this box.

Issue #11 asks that two live-session tests pass ten runs in a row on a machine of this size
(2 cores): the one-minute demo (`test_demo.py`, which shows trials and rolls the staged
incident back locally) and the default-settings tuning session (`test_tuning_session.py`,
which keeps only measured gains). The serving session (`test_serving_session.py`) failed in CI
once; it is here too. `--busy-neighbours N` runs N busy-loop processes (SIMULATED neighbours,
one core each) for the whole bench, for a box slower than this one. Each run is a fresh `python -m pytest` process, so nothing
is shared between runs but the machine. Runs alternate between the tests (A, B, A, B, ...),
so drift on the shared box hits both alike.

Run: python bench/stability.py  [--runs 10] [--tests demo_short_session] [--busy-neighbours 1]
     [--out FILE]
Results: bench/results/stability.json (every run's outcome and wall seconds, and whether each
test passed every one of its runs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._targets import Target, holds, judged  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "stability.json"
TESTS = {
    "demo_short_session": "tests/seedancectl/test_demo.py::"
                          "test_a_short_session_ran_trials_and_the_incident_was_rolled_back_locally",
    "tuning_session_keeps_only_measured_gains":
        "tests/seedancectl/test_tuning_session.py::"
        "test_live_tuning_session_on_default_settings_keeps_only_measured_gains",
    "serving_session": "tests/seedancectl/test_serving_session.py::"
                       "test_a_live_session_keeps_a_faster_config_and_the_guardrail_rolls_back_"
                       "breaches",
}
RUNS_IN_A_ROW = 10
"""Issue #11: the two tests that failed on a fresh clone pass 10 runs in a row."""
ISSUE_TESTS = ("demo_short_session", "tuning_session_keeps_only_measured_gains")
BUSY_LOOP = "import time\nwhile True:\n    sum(range(100_000))\n"
"""A SIMULATED neighbour: one core kept busy until it is killed."""


def revision() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()


def run_once(node: str) -> dict[str, Any]:
    """One pytest process for one test; its outcome, wall time, the code it ran (the tree may
    move on during a long run) and, on failure, the tail."""
    code = revision()
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           "-n", "0", node], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    row: dict[str, Any] = {"passed": done.returncode == 0, "rc": done.returncode,
                           "wall_s": round(time.monotonic() - started, 1), "code_revision": code}
    if done.returncode != 0:
        output = done.stdout + done.stderr
        row["tail"] = output[-3000:]
        row["errors"] = [line[:20000] for line in output.splitlines()
                         if line.startswith("E ")][:20]  # the assertion, whole
    return row


def targets(result: dict[str, Any]) -> list[Target]:
    """Every test measured passed at least 10 runs in a row (issue #11's bar; the serving
    session is held to the same bar by this bench, the issue does not name it)."""
    return [holds(f"{name} passes {RUNS_IN_A_ROW} runs in a row",
                  f"{RUNS_IN_A_ROW} of {RUNS_IN_A_ROW} or more runs passed",
                  f"{test['passed']}/{test['runs']}",
                  test["runs"] >= RUNS_IN_A_ROW and test["passed"] == test["runs"],
                  "issue #11" if name in ISSUE_TESTS
                  else "issue #11's bar, applied to this test by bench/stability.py")
            for name, test in result["tests"].items()]


def summarise(runs: dict[str, list[dict[str, Any]]], started_at: str,
              busy_neighbours: int) -> dict[str, Any]:
    """The results so far, with the verdict the issue asks for: every run of a test passed."""
    result = {
        "bench": "stability",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "code_revision_at_start": started_at,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "what_is_measured": "each test run alone in a fresh pytest process, the tests "
                            "alternating; passed = pytest exit 0",
        "simulated_busy_neighbours": busy_neighbours,
        "tests": {name: {"node": TESTS[name], "runs": len(rows),
                         "passed": sum(r["passed"] for r in rows),
                         "all_passed": bool(rows) and all(r["passed"] for r in rows),
                         "median_wall_s": sorted(r["wall_s"] for r in rows)[len(rows) // 2]
                         if rows else None,
                         "runs_detail": rows}
                  for name, rows in runs.items()},
    }
    return judged(result, targets(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=RUNS_IN_A_ROW, help="runs of each test")
    parser.add_argument("--tests", default=",".join(TESTS),
                        help=f"comma-separated, of {', '.join(TESTS)}")
    parser.add_argument("--busy-neighbours", type=int, default=0,
                        help="busy-loop processes (simulated neighbours) during the bench")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    chosen = args.tests.split(",")
    if unknown := sorted(set(chosen) - set(TESTS)):
        parser.error(f"--tests: unknown {', '.join(unknown)}; choose from {', '.join(TESTS)}")

    started_at = revision()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    neighbours = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
                  for _ in range(args.busy_neighbours)]
    try:
        result = _run_all(args.runs, chosen, runs, started_at, args)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    for name, summary in result["tests"].items():
        print(f"{name}: {summary['passed']}/{summary['runs']} passed, "
              f"median {summary['median_wall_s']} s")
    print(f"wrote {args.out}")


def _run_all(count: int, chosen: list[str], runs: dict[str, list[dict[str, Any]]],
             started_at: str, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for index in range(count):
        for name in chosen:
            node = TESTS[name]
            row = run_once(node)
            runs[name].append(row)
            print(f"run {index + 1}/{count} {name}: "
                  f"{'passed' if row['passed'] else 'FAILED'} in {row['wall_s']} s", flush=True)
            # written after every run: a stop loses none
            result = summarise(runs, started_at, args.busy_neighbours)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
