"""The serving family of ``bench/generalisation.py``: the serving job on the default sidecar
settings, judged against its own measured truth.

The job is ``workloads.serve_tuned`` at its launch defaults (8-bit KV cache, an LRU prefix cache
of 16 entries, 16 requests in flight) under a load mix that no test or demo uses (``LOAD``: 128
shared prefixes, Zipf s = 0.9). One visit of a config builds the replica at the launch config,
applies the config's knob values through ``Engine.apply_knobs`` (the path a live config takes),
runs the closed loop for a warm-up and then measures generated tokens/s, p99 latency and token
agreement. Every visit of one round serves the same request trace, so arms differ by config
only.

1. TRUTH: a grid over the knobs that move throughput here, KV width (both halves alike) x prefix
   cache entries, interleaved with the launch config as in the training grid.
2. LIVE: the real sidecar with only ``mode = "auto"`` and ``tune = true`` in the job section, the
   job attached to it; the kept config is read at the checkpoints.
3. A/B: launch config, the grid's best two and the kept configs, interleaved, the launch config
   between every two arms.

A config counts toward the available gain only within the quality bound the sidecar applies by
default: token agreement >= ``ServingSLOConfig().min_token_agreement`` and p99 latency at most
``MeasureConfig().latency_tolerance`` above the launch config's. A kept config outside that
bound, or slower with confidence, is a regression kept.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bench._default_session import DefaultSettingsSession
from bench._stats import median_ci
from seedancectl._config import ServingSLOConfig
from seedancectl._session import TrainingSession
from tuner._windows import MeasureConfig
from tuner.job import KV_BITS_KNOBS
from tuner.prefix_cache import PREFIX_CACHE_KNOBS
from workloads import loadgen
from workloads.serve_tuned import TunedConfig, build_engine, closed_loop, requests

JOB = "serve"
LOAD = loadgen.LoadConfig(n_prefixes=128, zipf_s=0.9, seed=11)
"""A mix no test or demo serves: more prefixes, a flatter head."""
LAUNCH = TunedConfig(load=LOAD)
SEARCHED = tuple(k.name for k in (*KV_BITS_KNOBS, *PREFIX_CACHE_KNOBS))
"""The knobs a kept config may change (the job's INJECTED delay knob is never searched)."""
GRID_BITS = (4, 8, 16, 32)
GRID_ENTRIES = (16, 64, 256)
MIN_AGREEMENT = ServingSLOConfig().min_token_agreement
LATENCY_TOLERANCE = MeasureConfig().latency_tolerance

Values = dict[str, Any]


def launch_values() -> Values:
    return {k: v for k, v in LAUNCH.knob_values.items() if k in SEARCHED}


def label(values: Mapping[str, Any]) -> str:
    """``kv8/8 lru16`` and, where they differ from the launch config, the other cache knobs."""
    v = {**launch_values(), **values}
    extra = [f"{k.removeprefix('prefix_cache.')}={v[k]:g}" if isinstance(v[k], float)
             else f"{k.removeprefix('prefix_cache.')}={v[k]}"
             for k in ("prefix_cache.capacity_mib", "prefix_cache.pin_top_k",
                       "prefix_cache.prewarm_top_k") if v[k] != launch_values()[k]]
    return " ".join([f"kv{v['kv.key_bits']}/{v['kv.value_bits']}",
                     f"{v['prefix_cache.policy']}{v['prefix_cache.capacity_entries']}", *extra])


def grid() -> dict[str, Values]:
    configs = [{**launch_values(), "kv.key_bits": b, "kv.value_bits": b,
                "prefix_cache.capacity_entries": n} for b in GRID_BITS for n in GRID_ENTRIES]
    return {label(c): c for c in configs}


def visit(values: Mapping[str, Any], *, seconds: float, warmup_s: float,
          trace_seed: int) -> dict[str, Any]:
    """One config served for ``warmup_s`` + ``seconds`` on a fresh replica; what it measured."""
    engine = build_engine(LAUNCH)
    engine.apply_knobs(values)
    source = requests(dataclasses.replace(LOAD, seed=trace_seed))
    got = closed_loop(engine, source, duration_s=seconds, concurrency=LAUNCH.concurrency,
                      warmup_s=warmup_s)
    return {k: got[k] for k in ("tokens_per_s", "p99_s", "token_agreement", "hit_rate",
                                "requests")}


@dataclasses.dataclass
class ServeArm:
    values: Values
    visits: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def median(self, key: str) -> float:
        got = [v[key] for v in self.visits if v.get(key) is not None and math.isfinite(v[key])]
        return statistics.median(got) if got else math.nan

    @property
    def agreement(self) -> float:
        """The worst visit's token agreement (NaN when none sampled enough tokens)."""
        got = [v["token_agreement"] for v in self.visits if v["token_agreement"] is not None]
        return min(got) if got else math.nan


def interleave(configs: Mapping[str, Values], reference: str, *, rounds: int, seconds: float,
               warmup_s: float, reference_every: int, seed: int, echo: str) -> dict[str, ServeArm]:
    """Each round serves every config once in a new shuffled order, the reference before the
    first and after every ``reference_every``; a visit's ``relative`` and ``p99_relative``
    divide by the mean of the reference visits on either side of it."""
    arms = {name: ServeArm(values=dict(v)) for name, v in configs.items()}
    others = [n for n in arms if n != reference]
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        trace_seed = seed * 1000 + r

        def serve(name: str, trace_seed: int = trace_seed) -> dict[str, Any]:
            return visit(arms[name].values, seconds=seconds, warmup_s=warmup_s,
                         trace_seed=trace_seed)

        last = serve(reference)
        arms[reference].visits.append({**last, "relative": 1.0, "p99_relative": 1.0})
        order = [others[int(i)] for i in rng.permutation(len(others))]
        for start in range(0, len(order), reference_every):
            block = {name: serve(name) for name in order[start:start + reference_every]}
            after = serve(reference)
            tps = statistics.fmean([last["tokens_per_s"], after["tokens_per_s"]])
            p99 = statistics.fmean([last["p99_s"], after["p99_s"]])
            arms[reference].visits.append({**after, "relative": after["tokens_per_s"] / tps,
                                           "p99_relative": after["p99_s"] / p99})
            for name, got in block.items():
                arms[name].visits.append({**got, "relative": got["tokens_per_s"] / tps,
                                          "p99_relative": got["p99_s"] / p99})
                print(f"{echo}round {r + 1}/{rounds} {name}: {got['tokens_per_s']:.1f} "
                      f"tokens/s ({got['tokens_per_s'] / tps:.2f}x launch), p99 "
                      f"{got['p99_s']:.2f} s ({got['p99_s'] / p99:.2f}x), agreement "
                      f"{got['token_agreement']}", flush=True)
            last = after
    return arms


def within_bound(arm: ServeArm) -> bool:
    """Inside the sidecar's default quality bound: agreement and p99 vs the launch config."""
    agreement_ok = not arm.agreement < MIN_AGREEMENT  # NaN (too few tokens sampled) passes
    return agreement_ok and not arm.median("p99_relative") > 1 + LATENCY_TOLERANCE


def serving_session(out: Path) -> DefaultSettingsSession:
    """The live session: the default sidecar settings and ``workloads.serve_tuned`` at its
    launch defaults under ``LOAD``."""
    return DefaultSettingsSession(out, job=JOB, job_args=lambda url: [
        "-m", "workloads.serve_tuned", "--sidecar", url, "--job", JOB, "--duration-s", "86400",
        "--n-prefixes", str(LOAD.n_prefixes), "--zipf-s", str(LOAD.zipf_s),
        "--seed", str(LOAD.seed)])


def kept_values(session: TrainingSession) -> Values:
    return {k: v for k, v in sorted(session.baseline().items()) if k in SEARCHED}


def bench_serving(args: Any, *, live_session: Callable[..., dict[str, Any]],
                  meter: Callable[[], Any], flat_gain: float, contended: float
                  ) -> dict[str, Any]:
    """The serving family's entry, with the keys the report's summary reads. ``live_session``
    runs the live phase (``generalisation.live_session`` with its name, length and logs
    bound); ``meter`` starts a ``CpuMeter``."""
    seconds, warmup_s = (4.0, 2.0) if args.quick else (8.0, 3.0)
    launch = label(launch_values())
    configs = grid()
    cpu = meter()
    began = time.monotonic()
    arms = interleave(configs, launch, rounds=1 if args.quick else 2, seconds=seconds,
                      warmup_s=warmup_s, reference_every=3, seed=args.seed, echo="[serving] grid ")
    grid_s = time.monotonic() - began
    foreign = {"grid": cpu.foreign_share()}
    rel = {name: arm.median("relative") for name, arm in arms.items()}
    valid = {name: v for name, v in rel.items() if within_bound(arms[name]) and math.isfinite(v)}

    cpu = meter()
    live = live_session(make_session=serving_session, kept=kept_values, label=label)
    foreign["live"] = cpu.foreign_share()

    ranked = sorted((n for n in valid if n != launch), key=lambda n: -valid[n])[:args.ab_grid_top]
    ab_configs = {launch: launch_values(), **{n: configs[n] for n in ranked}}
    for cp in live["checkpoints"]:
        ab_configs.setdefault(cp["kept"], {**launch_values(), **cp["kept_values"]})
    print(f"[serving] A/B of {list(ab_configs)}", flush=True)
    cpu = meter()
    ab_arms = interleave(ab_configs, launch, rounds=3 if args.quick else 6, seconds=seconds,
                         warmup_s=warmup_s, reference_every=1, seed=args.seed + 1,
                         echo="[serving] A/B ")
    foreign["ab"] = cpu.foreign_share()
    ab = {name: ab_entry(arm, seed=args.seed) for name, arm in ab_arms.items()}
    available = max([1.0, *(v["ratio"] for v in ab.values()
                            if v["within_quality_bound"] and v["ratio"] is not None)])

    def at(cp: Mapping[str, Any]) -> dict[str, Any]:
        got = ab[cp["kept"]]
        high = got["ci95"][1]
        regression = (high is not None and high < 1.0) or not got["within_quality_bound"]
        if available > flat_gain and got["ratio"] is not None:
            captured = (got["ratio"] - 1) / (available - 1)
        else:
            captured = 0.0 if regression else 1.0
        return {"minutes": cp["minutes"], "kept": cp["kept"], "kept_values": cp["kept_values"],
                **{k: got[k] for k in ("ratio", "ci95", "p99_ratio", "token_agreement_min",
                                       "within_quality_bound")},
                "captured": _r(captured), "regression_kept": regression,
                **{k: cp[k] for k in ("trials", "trials_measured", "trials_kept")}}

    checks = [at(cp) for cp in live["checkpoints"]]
    final = checks[-1] if len(checks) == 2 else None
    return {
        "description": "workloads.serve_tuned (4-layer GPT, continuous batching, quantised KV "
                       "cache, prefix cache), closed loop of 16 requests over a Zipf mix of "
                       f"{LOAD.n_prefixes} prefixes (s = {LOAD.zipf_s})",
        "token_unit": "generated token", "default_config": launch,
        "default_values": launch_values(),
        "quality_bound": {"min_token_agreement": MIN_AGREEMENT,
                          "max_p99_ratio": 1 + LATENCY_TOLERANCE},
        "grid": {n: {"relative_to_default": _r(rel[n]),
                     "p99_relative": _r(a.median("p99_relative")),
                     "tokens_per_s": _r(a.median("tokens_per_s"), 1),
                     "token_agreement_min": _r(a.agreement),
                     "hit_rate": _r(a.median("hit_rate")),
                     "within_quality_bound": within_bound(a)} for n, a in arms.items()},
        "grid_s": round(grid_s, 1),
        "grid_best": max(valid, key=lambda n: valid[n]) if valid else None,
        "available_gain": _r(available), "ab": ab, "live": live, "checkpoints": checks,
        "captured_at_end": final["captured"] if final else None,
        "trials": final["trials"] if final else None,
        "regression_kept": bool(final and final["regression_kept"]),
        "complete": final is not None and live["error"] is None,
        "foreign_cpu_share": {k: _r(v) for k, v in foreign.items()},
        "contended_phases": sorted(k for k, v in foreign.items() if v > contended),
    }


def ab_entry(arm: ServeArm, *, seed: int) -> dict[str, Any]:
    """An A/B arm against the launch config: tokens/s and p99 ratios (median over visits,
    95% bootstrap interval), the worst token agreement, and the quality verdict."""
    ratio, low, high = median_ci([v["relative"] for v in arm.visits], seed=seed)
    p99, p99_low, p99_high = median_ci([v["p99_relative"] for v in arm.visits], seed=seed)
    return {"ratio": _r(ratio), "ci95": [_r(low), _r(high)], "p99_ratio": _r(p99),
            "p99_ci95": [_r(p99_low), _r(p99_high)], "token_agreement_min": _r(arm.agreement),
            "within_quality_bound": within_bound(arm), "visits": len(arm.visits),
            "tokens_per_s": _r(arm.median("tokens_per_s"), 1), "p99_s": _r(arm.median("p99_s"))}


def _r(value: float, digits: int = 3) -> float | None:
    return round(value, digits) if math.isfinite(value) else None
