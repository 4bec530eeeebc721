"""Benchmark: what one policy pass costs on a job of many module groups, old code against new.

The policy engine runs every detector over every job's window (300 s by default) every 5 s
(``policy_interval_s``). A real training job exports per-module-group gradient norms and, on
stats steps, exactly-zero fractions and non-finite element counts (``collectors.torch_training``),
so the window of a large model holds ranks x groups x readings points of each. This bench builds such a window
(SYNTHETIC healthy readings: 8 ranks, G groups, 60 readings each, a step reading per export)
in a ``policies.FrameStore`` and times one pass of every detector the sidecar runs
(``seedancectl._sidecar.all_detectors``), per detector, in a fresh process per arm:

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new``: this tree.

Shapes: G in ``--groups`` (default 50, 200, 500), each with and without the stats-step series
(zero fractions and non-finite counts per group). Arms alternate per shape and round (base,
new, base, new, ...). A store read is not timed (the FrameStore holds the frames): this is the
detectors' own work.

With ``--from-store`` the same readings are written, one export at a time as the sidecar's
receiver writes them (a flush per export, a fold per minute), to a real ``TimeSeriesStore``
(SQLite, in a temporary folder), and each pass reads its window from it: the pass the
sidecar pays for, store reads included (their decoded chunks cached across passes, as they are
in the sidecar). Results: ``bench/results/policy_pass_store.json``.

Target (no issue states a number; the issue #14 fleet bench showed the policy engine as the
largest share of an idle sidecar's CPU): a pass of the new code costs at most the base's at
every shape, and at most 10% of a core at the default interval on the largest shape.

Run: python bench/policy_pass.py [--base HEAD~1 --groups 50,200,500 --rounds 2 --passes 3
     --from-store]
Results: bench/results/policy_pass.json (``--from-store``: policy_pass_store.json)
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._targets import Target, at_most, judged  # noqa: E402
from bench._worktree import worktree  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "policy_pass.json"
STORE_RESULTS = ROOT / "bench" / "results" / "policy_pass_store.json"
RANKS, READINGS, EXPORT_S, POLICY_INTERVAL_S = 8, 60, 5.0, 5.0


def targets(result: dict[str, Any]) -> list[Target]:
    """New at most base at every shape; the largest shape's pass at most 10% of a core."""
    ratios = [s["new_over_base"] for s in result["shapes"]]
    largest = max(result["shapes"], key=lambda s: (s["groups"], s["stats_series"]))
    share = largest["new_ms"] / 1000 / POLICY_INTERVAL_S
    return [
        at_most("pass time, new / base, worst shape", 1.0, max(ratios) if ratios else None,
                "bench docstring (no regression); no issue states a number"),
        at_most(f"share of a core at the {POLICY_INTERVAL_S:g} s interval, "
                f"{largest['groups']} groups with stats-step series", 0.10, round(share, 4),
                "bench docstring (issue #14: the policy engine led an idle sidecar's CPU)")]


def one_arm(tree: Path, groups: int, stats_series: bool, passes: int, from_store: bool
            ) -> dict[str, float]:
    """Median ms per detector over ``passes`` passes, with the code of ``tree``."""
    sys.path.insert(0, str(tree))
    import numpy as np
    import pandas as pd

    from policies import FrameStore, StoreWindow
    from seedancectl._sidecar import all_detectors

    # the last READINGS exports up to now: a store keeps what its retention keeps
    times = (np.arange(READINGS, dtype=np.int64) * int(EXPORT_S * 1e9)
             + time.time_ns() - READINGS * int(EXPORT_S * 1e9))
    base = {"service.name": "job", "seedance.config.version": "1"}

    def frame(values: np.ndarray, per_group: bool) -> pd.DataFrame:
        parts = [pd.DataFrame({"time": times, "value": values, **base, "seedance.rank": str(r),
                               **({"seedance.module_group": f"g{g}"} if per_group else {})})
                 for r in range(RANKS) for g in (range(groups) if per_group else [0])]
        return pd.concat(parts, ignore_index=True)

    frames = {"seedance.train.step": frame(np.arange(READINGS, dtype=np.float64), False),
              "seedance.train.loss": frame(np.linspace(3.0, 2.0, READINGS), False),
              "seedance.train.grad.norm": frame(np.full(READINGS, 5.0), False),
              "seedance.train.grad.group_norm": frame(np.full(READINGS, 0.5), True)}
    if stats_series:
        frames["seedance.train.grad.zero_fraction"] = frame(np.full(READINGS, 0.01), True)
        frames["seedance.train.grad.nonfinite"] = frame(np.zeros(READINGS), True)
    detectors = all_detectors()
    ms: dict[str, list[float]] = {d.name: [] for d in detectors}
    with tempfile.TemporaryDirectory(prefix="policy-pass-") as folder:
        store = (stored(Path(folder) / "metrics.db", frames, times) if from_store
                 else FrameStore(frames))
        for _ in range(passes + 1):  # the first pass warms imports and caches: not counted
            window = StoreWindow(store, job="job", since_ns=0, until_ns=2**62)
            for d in detectors:
                t0 = time.perf_counter()
                d.evaluate(window)
                ms[d.name].append((time.perf_counter() - t0) * 1000)
    return {name: statistics.median(v[1:]) for name, v in ms.items()}


def stored(path: Path, frames: dict[str, Any], times: Any) -> Any:
    """A TimeSeriesStore at ``path`` holding ``frames``, written one export (one instant of
    every series) at a time, a flush per export and a fold per minute of them."""
    from collectors import Point, TimeSeriesStore

    store = TimeSeriesStore(path)
    by_time = {name: frame.groupby("time", sort=True) for name, frame in frames.items()}
    for i, t in enumerate(times.tolist()):
        points = []
        for name, groups in by_time.items():
            rows = groups.get_group(t)
            attrs = [c for c in rows.columns if c not in ("time", "value")]
            points += [Point(name, float(v), t, {c: str(x) for c, x in zip(attrs, rest,
                                                                            strict=True)})
                       for v, *rest in zip(rows["value"], *(rows[c] for c in attrs),
                                           strict=True)]
        store.write(points)
        store.flush()
        if (i + 1) % int(60 / EXPORT_S) == 0:
            store.fold()
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="revision of the base arm")
    parser.add_argument("--groups", default="50,200,500")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--from-store", action="store_true",
                        help="read each pass's window from a real store (reads timed)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: tree of one arm
    parser.add_argument("--shape", help=argparse.SUPPRESS)  # internal: "GROUPS,STATS"
    args = parser.parse_args()
    if args.one:
        groups, stats = args.shape.split(",")
        print(json.dumps(one_arm(Path(args.one), int(groups), stats == "1", args.passes,
                                 args.from_store)))
        return
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    base = worktree(base_rev, "policy-pass-base-")
    shapes = [(int(g), z) for g in args.groups.split(",") for z in (False, True)]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    try:
        for r in range(args.rounds):
            for groups, stats in shapes:
                for arm, tree in (("base", base), ("new", ROOT)):
                    done = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--one", str(tree),
                         "--shape", f"{groups},{int(stats)}", "--passes", str(args.passes)]
                        + (["--from-store"] if args.from_store else []),
                        cwd=tree, capture_output=True, text=True, check=True)
                    per = json.loads(done.stdout.strip().splitlines()[-1])
                    runs.setdefault(f"{groups},{int(stats)}", {}).setdefault(arm, []).append(per)
                    print(f"round {r} groups {groups} stats series {stats} {arm}: "
                          f"{sum(per.values()):.1f} ms", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       check=False, capture_output=True)

    def total(shape: str, arm: str) -> float:
        return round(statistics.median(sum(p.values()) for p in runs[shape][arm]), 2)

    def slowest(shape: str, arm: str) -> dict[str, float]:
        names = runs[shape][arm][0]
        per = {n: statistics.median(p[n] for p in runs[shape][arm]) for n in names}
        return {n: round(v, 2) for n, v in sorted(per.items(), key=lambda kv: -kv[1])[:3]}

    result = {
        "bench": "policy_pass",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "protocol": {"base": base_rev, "rounds": args.rounds, "passes": args.passes,
                     "ranks": RANKS, "readings": READINGS, "export_s": EXPORT_S,
                     "data": ("SYNTHETIC healthy readings in a TimeSeriesStore (SQLite; "
                              "store reads timed)" if args.from_store else
                              "SYNTHETIC healthy readings in a FrameStore (store reads untimed)"),
                     "order": "base and new alternate per shape and round"},
        "shapes": [{"groups": g, "stats_series": z,
                    "base_ms": total(f"{g},{int(z)}", "base"),
                    "new_ms": total(f"{g},{int(z)}", "new"),
                    "new_over_base": round(total(f"{g},{int(z)}", "new")
                                           / total(f"{g},{int(z)}", "base"), 4),
                    "slowest_detectors_new_ms": slowest(f"{g},{int(z)}", "new"),
                    "slowest_detectors_base_ms": slowest(f"{g},{int(z)}", "base")}
                   for g, z in shapes],
        "runs": runs}
    result = judged(result, targets(result))
    (STORE_RESULTS if args.from_store else RESULTS).write_text(
        json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result["shapes"], indent=1))


if __name__ == "__main__":
    main()
