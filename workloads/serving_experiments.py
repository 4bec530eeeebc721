"""Measured comparisons on the real serving workload (bench/serving.py and the tests use them).

- ``policy_runs``: one replica in this process, the same seeded Zipf trace per prefix-cache
  policy at the same capacity; the arrival rate is calibrated to ``load_factor`` times LRU's
  closed-loop throughput measured first on this machine, so queueing (where hit rate turns into
  tail latency) happens whatever the box's speed. Policies run in ABC CBA order per repeat.
- ``router_runs``: replica processes, one slowed by an injected per-step delay, the same trace
  through round-robin and through the load-aware router (order RR LA LA RR ...).

Results are medians over repeats; every number is measured, nothing is simulated.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from tuner.prefix_cache import PrefixCacheConfig
from tuner.routing import LoadAwareConfig
from workloads import loadgen
from workloads.gpt import GPTConfig
from workloads.serve import ServeConfig, build_model, replay, run
from workloads.serve_engine import Engine, ReplicaConfig, quantized_cache_factory

SMALL_MODEL = GPTConfig(n_layer=4, n_head=4, n_embd=128)
"""Small enough for a shared 2-core box when several replicas share it."""
PREFILL_BOUND_MODEL = GPTConfig()
"""The default 5M-parameter GPT: its prefill of a long prefix costs far more than a decode
step, as in real serving, so the hit rate shows in latency."""


def _policies(capacity: int, pin_top_k: int) -> dict[str, PrefixCacheConfig]:
    return {
        "lru": PrefixCacheConfig(policy="lru", capacity_entries=capacity),
        "pinned": PrefixCacheConfig(policy="pinned", capacity_entries=capacity,
                                    pin_top_k=pin_top_k),
        "pinned+prewarm": PrefixCacheConfig(policy="pinned", capacity_entries=capacity,
                                            pin_top_k=pin_top_k, prewarm_top_k=pin_top_k),
    }


def _median_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("hit_rate", "p50_s", "p99_s", "mean_s")
    out: dict[str, Any] = {k: statistics.median(s[k] for s in summaries) for k in keys}
    out["runs"] = [{k: s[k] for k in (*keys, "requests", "lost")} for s in summaries]
    return out


def policy_runs(*, requests: int = 200, repeats: int = 1, capacity: int = 8,
                pin_top_k: int = 6, zipf_s: float = 1.0, n_prefixes: int = 64,
                prefix_tokens: int = 96, load_factor: float = 0.9,
                model: GPTConfig = PREFILL_BOUND_MODEL,
                seed: int = 0, threads: int = 1) -> dict[str, Any]:
    """Hit rate and latency per prefix-cache policy (medians over ``repeats``)."""
    torch.set_num_threads(threads)
    net = build_model(model, seed)
    kv = quantized_cache_factory(model, key_bits=32, value_bits=32, group_size=32,
                                 residual_tokens=16)

    def engine(cache: PrefixCacheConfig) -> Engine:
        return Engine(net, kv, ReplicaConfig(prefix_cache=cache))

    base = loadgen.LoadConfig(rate_rps=1.0, duration_s=float(requests), zipf_s=zipf_s,
                              n_prefixes=n_prefixes, prefix_tokens=prefix_tokens,
                              suffix_tokens=(4, 8), mean_output_tokens=4.0,
                              output_tokens=(2, 12), seed=seed)
    # Calibrate: LRU's closed-loop throughput on this machine, now.
    probe = loadgen.generate(base)[:requests]
    lru = engine(_policies(capacity, pin_top_k)["lru"])
    started = time.monotonic()
    for r in probe:
        lru.submit(r)
    while not lru.idle:
        lru.step()
    rate_rps = load_factor * len(probe) / (time.monotonic() - started)
    load = dataclasses.replace(base, rate_rps=rate_rps, duration_s=requests / rate_rps)
    trace = loadgen.generate(load)
    history = loadgen.recent_history(load, 256)
    policies = _policies(capacity, pin_top_k)
    names = list(policies)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else reversed(names):
            e = engine(policies[name])
            if policies[name].prewarm_top_k:
                e.prewarm(history)
            results[name].append(replay(e, trace).summary())
    out: dict[str, Any] = {n: _median_summary(s) for n, s in results.items()}
    out["setup"] = {"requests": len(trace), "rate_rps": rate_rps, "load_factor": load_factor,
                    "capacity_entries": capacity, "pin_top_k": pin_top_k, "zipf_s": zipf_s,
                    "n_prefixes": n_prefixes, "prefix_tokens": prefix_tokens,
                    "repeats": repeats, "model": dataclasses.asdict(model),
                    "kv_cache": "QuantizedKVCache at 32 bits (float32, unquantised)"}
    return out


def router_runs(*, duration_s: float = 15.0, rate_rps: float = 10.0, repeats: int = 1,
                slow_step_delay_s: float = 0.1, max_batch: int = 4, tau_s: float = 1.0,
                model: GPTConfig = SMALL_MODEL, seed: int = 0) -> dict[str, Any]:
    """p50/p99 under round-robin and load-aware routing, replica 1 slowed.

    ``tau_s`` defaults to 1 s, not the seed's 45 s: the run lasts seconds, so the cooldown and
    the backlog scale are shrunk with it (the rule is otherwise the seed's).
    """
    load = loadgen.LoadConfig(rate_rps=rate_rps, duration_s=duration_s, seed=seed)
    trace = loadgen.generate(load)
    base = ServeConfig(replicas=2, model=model, model_seed=seed,
                       slow_replicas=(1,), slow_step_delay_s=slow_step_delay_s,
                       replica=ReplicaConfig(max_batch=max_batch, kv_bits=(32, 32)),
                       load_aware=LoadAwareConfig(tau_s=tau_s))
    results: dict[str, list[dict[str, Any]]] = {"round_robin": [], "load_aware": []}
    order = ["round_robin", "load_aware"]
    for rep in range(repeats):
        for name in order if rep % 2 == 0 else reversed(order):
            config = dataclasses.replace(base, router=name)
            results[name].append(run(config, trace).summary())
    out: dict[str, Any] = {}
    for name, summaries in results.items():
        out[name] = _median_summary(summaries)
        out[name]["requests_per_replica"] = [s["requests_per_replica"] for s in summaries]
        out[name]["final_weights"] = [s["final_weights"] for s in summaries]
    out["setup"] = {"requests": len(trace), "rate_rps": rate_rps, "duration_s": duration_s,
                    "slow_replica": 1, "slow_step_delay_s": slow_step_delay_s,
                    "max_batch": max_batch, "alpha": base.load_aware.alpha, "tau_s": tau_s,
                    "threshold": base.load_aware.threshold, "repeats": repeats,
                    "model": dataclasses.asdict(model), "kv_cache": "QuantizedKVCache at 32 bits (float32, unquantised)"}
    return out
