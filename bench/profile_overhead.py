"""Benchmark: what ModuleGroupProfiler costs a training step, sampled and unsampled.

Three arms train the SAME small GPT (workloads.gpt) on the same batch, interleaved in one run:
``bare`` (no profiler), ``unsampled`` (a profiler whose steps are never sampled: what 49 of 50
steps pay at the default every_n_steps=50) and ``sampled`` (every step sampled: hooks
installed, every group module, block and the root timed, hooks removed, gauges set). Each round
runs every arm for ``--block-steps`` steps, the arms' order rotating per round so drift and the
shared box's noise hit all alike; a round's ratio is arm / bare of the block medians.

The box's noise (a few % per round) hides costs this small, so both are also timed directly:
``before_step``/``after_step`` of an unsampled step alone, and a sampled step's extra time on
a one-token forward (same modules and hooks, next to no arithmetic). The amortised cost at
every_n_steps=N, (sampled + (N - 1) x unsampled) / N, uses those direct costs. The cold
``dtype_speedups`` run is timed too.

Run: python bench/profile_overhead.py  [--rounds 80 --block-steps 2 --threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._stats import median_ci  # noqa: E402
from bench._targets import Target, at_most, judged  # noqa: E402
from bench.overhead import TARGET_MEDIAN_RATIO  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "profile_overhead.json"
ARMS = ("bare", "unsampled", "sampled")


def targets(result: dict[str, Any]) -> list[Target]:
    """Issue #11: the profiler's sampled hooks stay inside the overhead budget (issue #16's).

    Judged on the amortised cost from the direct timings: the A/B rounds' noise on this box is
    larger than the cost (see above).
    """
    return [at_most("amortised step-time ratio at every_n_steps", TARGET_MEDIAN_RATIO,
                    result["amortised_at_every_n_steps"]["ratio"],
                    "issue #11 (inside the overhead budget), the budget being issue #16's")]


def owner_groups(model: Any) -> dict[str, tuple[str, ...]]:
    """The groups tuner.job's default precision knobs use: parameter owners by group."""
    from tuner.job import default_precision_groups

    return default_precision_groups(model, None)


def direct_sampled_cost_s(model: Any, profiler: Any, vocab: int, *, pairs: int) -> float:
    """What a sampled step adds, in seconds, timed on a one-token forward: the same modules
    and hooks, next to no arithmetic, so the box's noise hides little of it. Forward hooks
    touch only the forward; the median over interleaved pairs of (profiled - bare) counts."""
    import torch

    idx = torch.randint(0, vocab, (1, 1))
    diffs = []
    with torch.no_grad():
        for i in range(pairs):
            seconds = {}
            for arm in (("bare", "sampled") if i % 2 == 0 else ("sampled", "bare")):
                start = time.perf_counter()
                if arm == "sampled":
                    profiler.before_step(0)
                model(idx)
                if arm == "sampled":
                    profiler.after_step()
                seconds[arm] = time.perf_counter() - start
            diffs.append(seconds["sampled"] - seconds["bare"])
    return statistics.median(diffs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from collectors.torch_profile import ModuleGroupProfiler, ProfilerConfig, dtype_speedups
    from workloads.gpt import GPT, GPTConfig

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        speedups = dtype_speedups("cpu", cache_dir=cache)
        speedups_cold_s = time.perf_counter() - start
        start = time.perf_counter()
        dtype_speedups("cpu", cache_dir=cache)
        speedups_cached_s = time.perf_counter() - start

    torch.manual_seed(args.seed)
    config = GPTConfig(block_size=args.seq_len, n_layer=args.layers, n_head=4, n_embd=args.embd)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq_len))
    groups = owner_groups(model)
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("bench.profile_overhead")
    profilers = {
        "unsampled": ModuleGroupProfiler(model, groups, meter, speedups=speedups,
                                         config=ProfilerConfig(every_n_steps=10**9)),
        "sampled": ModuleGroupProfiler(model, groups, meter, speedups=speedups,
                                       config=ProfilerConfig(every_n_steps=1)),
    }
    counter = {"step": 1}  # from 1: the unsampled arm's profiler never hits a multiple

    def train_step(arm: str) -> float:
        begin = time.perf_counter()
        profiler = profilers.get(arm)
        if profiler is not None:
            profiler.before_step(counter["step"])
        loss = model(idx, idx.roll(-1, dims=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.after_step()
        counter["step"] += 1
        return time.perf_counter() - begin

    def block(arm: str) -> float:
        return statistics.median(train_step(arm) for _ in range(args.block_steps))

    for _ in range(args.warmup):
        for arm in ARMS:
            block(arm)
    load_before = os.getloadavg()
    wall_start = time.perf_counter()
    rounds: list[dict[str, float]] = []
    for i in range(args.rounds):
        order = ARMS[i % 3:] + ARMS[:i % 3]
        rounds.append({arm: block(arm) for arm in order})
    wall_s = time.perf_counter() - wall_start
    load_after = os.getloadavg()

    unsampled = profilers["unsampled"]
    start = time.perf_counter()
    for i in range(1, args.direct_calls + 1):
        unsampled.before_step(i)
        unsampled.after_step()
    unsampled_call_s = (time.perf_counter() - start) / args.direct_calls
    sampled_cost_s = direct_sampled_cost_s(model, profilers["sampled"], config.vocab_size,
                                           pairs=args.direct_pairs)

    ratios = {arm: [r[arm] / r["bare"] for r in rounds] for arm in ("unsampled", "sampled")}
    median_ratio = {arm: statistics.median(v) for arm, v in ratios.items()}
    every = args.every_n_steps
    bare_step_s = statistics.median(r["bare"] for r in rounds)
    amortised_s = (sampled_cost_s + (every - 1) * unsampled_call_s) / every
    sampled = profilers["sampled"]
    profile = sampled.last_profile
    assert profile is not None
    sampled.before_step(0)  # count the hooks a sampled step installs (no forward: no export)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    sampled.after_step()
    return {
        "benchmark": "ModuleGroupProfiler overhead (interleaved A/B/C, same run)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "note": "shared 2-core box; other engineers' jobs ran at the same time",
                    "load_average_1m_before_after": [load_before[0], load_after[0]]},
        "config": {**{k: v for k, v in vars(args).items() if k != "out"},
                   "parameters": sum(p.numel() for p in model.parameters())},
        "groups": {g: len(m) for g, m in groups.items()},
        "hooks_on_a_sampled_step": hooks,
        "rounds": len(rounds),
        "wall_s": wall_s,
        "median_step_s": {arm: statistics.median(r[arm] for r in rounds) for arm in ARMS},
        "sampled_step_direct_ratio": 1 + sampled_cost_s / bare_step_s,
        "median_ratio_vs_bare": median_ratio,
        "ratio_95ci": {arm: median_ci(v, boots=args.bootstrap, seed=args.seed)[1:]
                       for arm, v in ratios.items()},
        "amortised_at_every_n_steps": {"every_n_steps": every, "cost_per_step_s": amortised_s,
                                       "ratio": 1 + amortised_s / bare_step_s},
        "unsampled_before_after_step_s": unsampled_call_s,
        "sampled_step_direct_cost_s": sampled_cost_s,
        "sampled_step_direct_cost_per_hook_s": sampled_cost_s / hooks,
        "dtype_speedups": {"values": speedups, "cold_s": speedups_cold_s,
                           "cached_s": speedups_cached_s},
        "last_profile": {"forward_s": profile.forward_s,
                         "group_shares": dict(profile.group_shares),
                         "block_shares": dict(profile.block_shares),
                         "forward_order": list(profile.forward_order),
                         "param_dtypes": {g: list(d) for g, d in profile.param_dtypes.items()}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--block-steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--every-n-steps", type=int, default=50)
    parser.add_argument("--direct-calls", type=int, default=100_000)
    parser.add_argument("--direct-pairs", type=int, default=400)
    parser.add_argument("--bootstrap", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args)
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_step_s", "median_ratio_vs_bare",
                                             "ratio_95ci", "amortised_at_every_n_steps",
                                             "unsampled_before_after_step_s",
                                             "sampled_step_direct_cost_s")}, indent=2))


if __name__ == "__main__":
    main()
