"""Benchmark: trials the tuner needs to reach 95% of the best config, against random search.

The grid is MEASURED: every config of the demo job (precision fp32|bf16 x micro_batch x
threads) runs the real ``workloads.train`` Trainer in its own subprocess for ``--steps`` steps;
the first ``--warmup-steps`` are dropped and the rest are kept as per-step wall times. The grid
is cached in bench/results/tuning_grid.json (with the time it was measured and the machine) so
reruns are cheap; ``--remeasure`` measures again.

The search is SIMULATED on that measured grid: a trial's observation is tokens/s over a window
of ``--window-steps`` step times drawn (with replacement, seeded) from the config's measured
per-step distribution, so trials see the job's real noise. For every seed, each searcher runs a
budget of ``--budget`` trials; "trials to 95%" is the 1-based index of the first trial whose
config's TRUE (measured mean) throughput is at least 95% of the grid's best; a run that never
gets there counts as budget + 1. Medians over ``--seeds`` seeds, interleaved per seed.

Searchers (same budget, same observations):
  tuner          tuner.SearchDriver: starts from the job's running baseline, neighbourhood
                 prior, TPE after, never repeats a config (repeats answered from its cache)
  random         optuna RandomSampler (repeats allowed; the issue's reference)
  random_unique  random order without repeats (a stronger random baseline)
  tpe_default    optuna TPESampler with default settings (repeats allowed)

Run: python bench/tuning.py  [--seeds 20 --budget 20 --remeasure]
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
GRID_PATH = RESULTS / "tuning_grid.json"
PRECISIONS = ("fp32", "bf16")

_MEASURE_ONE = r"""
import json, sys, time
import torch
from workloads.train import TrainConfig, Trainer
from collectors.torch_training import NullTrainingInstrumentation
a = json.loads(sys.argv[1])
cfg = TrainConfig(steps=a["steps"], global_batch=a["global_batch"], micro_batch=a["micro_batch"],
                  seq_len=a["seq_len"], threads=a["threads"], precision=a["precision"])
trainer = Trainer(cfg)
instr = NullTrainingInstrumentation()
times = []
for _ in range(a["steps"]):
    t0 = time.perf_counter()
    trainer.step(instr)
    times.append(time.perf_counter() - t0)
print(json.dumps({"step_s": times}))
"""


def grid_configs(micro_batches: list[int], threads: list[int]) -> list[dict[str, Any]]:
    return [{"precision": p, "micro_batch": m, "threads": t}
            for p, m, t in itertools.product(PRECISIONS, micro_batches, threads)]


def config_key(values: Mapping[str, Any]) -> str:
    return json.dumps(dict(values), sort_keys=True)


def _run_config(values: Mapping[str, Any], args: argparse.Namespace) -> list[float]:
    payload = {**values, "steps": args.steps, "global_batch": args.global_batch,
               "seq_len": args.seq_len}
    out = subprocess.run([sys.executable, "-c", _MEASURE_ONE, json.dumps(payload)],
                         cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return list(json.loads(out.stdout.strip().splitlines()[-1])["step_s"])


def measure_grid(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the real demo job per config, each run in a fresh subprocess (fresh thread pool).

    ``--rounds`` rounds visit every config, in a new seeded order each round, so load from
    other processes on the machine spreads over all configs instead of biasing a few.
    """
    configs = grid_configs(args.micro_batches, args.threads)
    tokens_per_step = args.global_batch * args.seq_len
    kept: dict[str, list[float]] = {config_key(v): [] for v in configs}
    warm: dict[str, list[float]] = {config_key(v): [] for v in configs}
    rng = np.random.default_rng(12345)
    for r in range(args.rounds):
        for n, i in enumerate(rng.permutation(len(configs))):
            values = configs[int(i)]
            step_s = _run_config(values, args)
            warm[config_key(values)] += step_s[:args.warmup_steps]
            kept[config_key(values)] += step_s[args.warmup_steps:]
            print(f"round {r + 1}/{args.rounds} [{n + 1}/{len(configs)}] {values}: "
                  f"{tokens_per_step / statistics.mean(step_s[args.warmup_steps:]):.0f} "
                  "tokens/s", flush=True)
    rows = [{"values": v, "warmup_step_s": warm[config_key(v)], "step_s": kept[config_key(v)],
             "tokens_per_s_mean": tokens_per_step * len(kept[config_key(v)])
             / sum(kept[config_key(v)])} for v in configs]
    return {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "load_average_at_end": os.getloadavg()},
            "job": "workloads.train Trainer (real run, CPU)", "tokens_per_step": tokens_per_step,
            "global_batch": args.global_batch, "seq_len": args.seq_len,
            "steps_per_run": args.steps, "rounds": args.rounds,
            "warmup_steps_dropped_per_run": args.warmup_steps, "configs": rows}


def load_grid(args: argparse.Namespace) -> dict[str, Any]:
    if GRID_PATH.exists() and not args.remeasure:
        grid = json.loads(GRID_PATH.read_text())
        print(f"measured grid from {GRID_PATH} (measured {grid['measured_at']})", flush=True)
        return grid
    grid = measure_grid(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    GRID_PATH.write_text(json.dumps(grid, indent=1) + "\n")
    return grid


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="steps per run when measuring")
    p.add_argument("--warmup-steps", type=int, default=3, help="dropped from each run")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the grid")
    p.add_argument("--remeasure", action="store_true")
    p.add_argument("--grid-only", action="store_true")
    args = p.parse_args()
    load_grid(args)


if __name__ == "__main__":
    main()
