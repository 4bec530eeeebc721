"""Benchmark: what the sidecar itself costs the job it tunes, old code against new, interleaved.

Each run is a live session on the default settings (``bench/_default_session.py``): one
training family (``workloads.train_family``, default ``mlp``) attached to a sidecar whose
config says only ``mode = "auto"`` and ``tune = true``. After a warm-up the run measures, over
``--seconds``:

- the sidecar's CPU (user + system seconds from /proc) as a share of one core;
- the job's CPU share, and the step-time coefficient of variation of every measurement window
  the controller recorded (``Window.step_cv``): the noise each trial's decision has to beat;
- trials judged and the width of their 95% intervals.

Arms run in turn (A, B, C, A, B, C, ...), so the shared box's drift hits each alike:

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new, nice 0``: this tree with ``nice = 0`` (the sidecar at the job's priority);
- ``new``: this tree on its defaults.

Run: python bench/sidecar_cpu.py  [--base HEAD~1 --rounds 2 --seconds 150 --family mlp]
Results: bench/results/sidecar_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._targets import Target, at_most, judged  # noqa: E402
from bench._worktree import worktree  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "sidecar_cpu.json"


def targets(result: dict[str, Any]) -> list[Target]:
    """The sidecar on this tree's defaults costs the job no more CPU than the base code's.

    No issue states a number; the bench's purpose (above) is what the sidecar costs the job it
    tunes, so the new code on its defaults must not cost more than the base.
    """
    return [at_most("sidecar CPU share, new / base", 1.0,
                    result["sidecar_cpu_ratio_new_over_base"].get("new"),
                    "bench docstring (what the sidecar costs the job); no issue states a number")]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(tree: Path, family: str, seconds: float, warmup_s: float,
            nice: int | None) -> dict[str, Any]:
    """One session with the sidecar and job of ``tree`` (imported from there)."""
    sys.path.insert(0, str(tree))
    from bench.generalisation import family_session

    out = Path(tempfile.mkdtemp(prefix="sidecar-cpu-"))
    session = family_session(family, 0)(out)
    if nice is not None:  # the base tree's config has no "nice": only new arms set it
        toml = session.sidecar_toml
        setattr(session, "sidecar_toml", lambda: f"nice = {nice}\n" + toml())  # noqa: B010
    with session:
        time.sleep(warmup_s)
        assert session.sidecar is not None and session.train is not None
        s0, j0, t0 = cpu_s(session.sidecar.pid), cpu_s(session.train.pid), time.monotonic()
        time.sleep(seconds)
        s1, j1, t1 = cpu_s(session.sidecar.pid), cpu_s(session.train.pid), time.monotonic()
        changes = session.changes(source="trial")
    shutil.rmtree(out, ignore_errors=True)
    wall = t1 - t0
    cvs = [float(w["step_cv"]) for c in changes for w in (c.get("windows") or [])
           if isinstance(w.get("step_cv"), (int, float))]
    widths = [c["comparison"]["ci_high"] - c["comparison"]["ci_low"] for c in changes
              if (c.get("comparison") or {}).get("pairs")
              and c["state"] in ("kept", "rolled_back")]
    return {"sidecar_cpu_share": round((s1 - s0) / wall, 4),
            "job_cpu_share": round((j1 - j0) / wall, 4),
            "windows": len(cvs),
            "median_window_step_cv": round(statistics.median(cvs), 4) if cvs else None,
            "trials_judged": len(widths),
            "median_ci_width": round(statistics.median(widths), 4) if widths else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="revision of the base arm")
    parser.add_argument("--family", default="mlp")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--warmup-s", type=float, default=30.0)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: tree of one run
    parser.add_argument("--nice", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(Path(args.one), args.family, args.seconds, args.warmup_s,
                                 args.nice)))
        return
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    base = worktree(base_rev, "sidecar-cpu-base-")
    arms = {"base": (base, None), "new, nice 0": (ROOT, 0), "new": (ROOT, None)}
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    try:
        for r in range(args.rounds):
            for arm, (tree, nice) in arms.items():
                cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(tree),
                       "--family", args.family, "--seconds", str(args.seconds),
                       "--warmup-s", str(args.warmup_s)]
                if nice is not None:
                    cmd += ["--nice", str(nice)]
                done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=True)
                runs[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"round {r} {arm}: {runs[arm][-1]}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       check=False, capture_output=True)

    def median(arm: str, key: str) -> float | None:
        values = [run[key] for run in runs[arm] if run[key] is not None]
        return round(statistics.median(values), 4) if values else None

    keys = ("sidecar_cpu_share", "job_cpu_share", "median_window_step_cv", "median_ci_width",
            "trials_judged")
    medians = {arm: {k: median(arm, k) for k in keys} for arm in arms}
    base_cpu = medians["base"]["sidecar_cpu_share"]
    result = {
        "bench": "sidecar_cpu",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "protocol": {"family": args.family, "rounds": args.rounds, "seconds": args.seconds,
                     "warmup_s": args.warmup_s, "base": base_rev,
                     "settings": "default sidecar settings (mode auto, tune true)",
                     "order": "arms interleaved per round"},
        "medians": medians,
        "sidecar_cpu_ratio_new_over_base": {
            arm: (round(m["sidecar_cpu_share"] / base_cpu, 3)
                  if base_cpu and m["sidecar_cpu_share"] is not None else None)
            for arm, m in medians.items() if arm != "base"},
        "runs": runs}
    result = judged(result, targets(result))
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({"medians": medians,
                      "ratio": result["sidecar_cpu_ratio_new_over_base"]}, indent=1))


if __name__ == "__main__":
    main()
