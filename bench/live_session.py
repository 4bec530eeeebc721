"""Benchmark: a live tuning session on the demo job, end to end, with real processes.

The sidecar (``seedancectl sidecar``) tunes the demo GPT (``workloads.train --sidecar``) on CPU
over precision.attention x precision.ffn x micro_batch x threads in approval mode auto, until
``--trials`` trials were measured; then the search is paused and the kept config is re-measured
against the job's FIRST baseline with the controller's own interleaved windows (baseline, kept,
baseline, ...). Every figure is the controller's paired comparison, not a raw window mean.

Reported per repeat: wall time, trials measured, the kept config, kept / first-baseline
tokens/s (from the re-measurement's paired gain and its 95% interval), and every trial's
verdict. Results go to bench/results/live_session.json.

Run: python bench/live_session.py  [--trials 8 --repeats 1]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._targets import Target, at_least, judged  # noqa: E402
from seedancectl._session import run_training_session  # noqa: E402
from seedancectl._session_config import SessionConfig  # noqa: E402
from seedancectl._session_result import SessionResult  # noqa: E402

SEARCHED = ("precision.attention", "precision.ffn", "micro_batch", "threads")
RESULTS = Path(__file__).resolve().parent / "results" / "live_session.json"
MIN_TRIALS = 8
"""Issue #4: a tuning session on the demo job runs at least 8 live trials."""


def targets(report: dict[str, Any]) -> list[Target]:
    """Issue #4: every repeat measures >= 8 trials and keeps a config at least as fast as the
    baseline on re-measurement (the point estimate; the interval is recorded beside it)."""
    runs = report["runs"]
    return [at_least("fewest trials measured in a repeat", MIN_TRIALS,
                     min((r["trials_measured"] for r in runs), default=None), "issue #4"),
            at_least("lowest kept / baseline tokens/s of a repeat, re-measured", 1.0,
                     min((r["kept_over_baseline"] for r in runs), default=None), "issue #4")]


def summarise(result: SessionResult) -> dict[str, Any]:
    """The repeat's figures; the re-measurement ran the first baseline as its candidate arm,
    so kept / baseline = 1 / (1 + gain) and the interval maps the same way (reversed)."""
    again = result.remeasure
    if again is None:
        ratio, low, high = 1.0, 1.0, 1.0
    else:
        ratio = 1 / (1 + again.gain)
        low = 1 / (1 + again.ci_high) if again.ci_high > -1 else math.inf
        high = 1 / (1 + again.ci_low) if again.ci_low > -1 else math.inf
    measured = [t for t in result.trials if t.measured]
    return {
        "wall_s": round(result.wall_s, 1),
        "trials_measured": len(measured),
        "trials_kept": sum(t.state == "kept" for t in measured),
        "baseline": {k: result.baseline[k] for k in SEARCHED},
        "kept": {k: result.kept[k] for k in SEARCHED},
        "kept_over_baseline": round(ratio, 3),
        "kept_over_baseline_ci95": [round(low, 3), round(high, 3)],
        "trials": [{"trial": t.trial, "values": {k: t.values[k] for k in SEARCHED},
                    "state": t.state, "gain": round(t.gain, 4),
                    "ci": [round(t.ci_low, 4), round(t.ci_high, 4)],
                    "ended_because": t.ended_because} for t in measured],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=MIN_TRIALS)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=1500.0)
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="live-session-") as out:
            result = run_training_session(SessionConfig(out=Path(out), trials=args.trials,
                                                        knobs=SEARCHED, seed=repeat),
                                          timeout_s=args.timeout_s)
        runs.append(summarise(result))
        print(json.dumps(runs[-1], indent=1), flush=True)
    report = {
        "bench": "live_session", "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                             time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "trials": args.trials, "repeats": args.repeats,
        "median_kept_over_baseline": statistics.median(r["kept_over_baseline"] for r in runs),
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
        "runs": runs,
    }
    report = judged(report, targets(report))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
