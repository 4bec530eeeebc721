"""The demo serving job: the small GPT decoding with a KV cache, batched, behind a router.

``python -m workloads.serve --replicas 2 --rate-rps 20 --duration-s 30 --router load_aware``
starts one process per replica, replays a seeded load (``workloads.loadgen``) open-loop against
them through a router (``tuner.routing``) and prints a JSON summary; every replica exports the
serving metrics (``collectors.torch_serving``) over OTLP when ``--otlp-endpoint`` is given.

Each replica is a ``workloads.serve_engine.Engine`` (continuous batching, KV cache, prefix
cache).

Latency is measured by the launcher for every request, from its scheduled arrival (open loop:
a late dispatch counts against the server) to its last token, on the system-wide monotonic
clock; p50/p99 are exact order statistics over all requests (``inverted_cdf``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import multiprocessing as mp
import queue
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from collectors import SeedanceError, TelemetryConfig, setup_telemetry
from tuner.prefix_cache import PrefixCacheConfig
from tuner.routing import LoadAwareConfig, LoadAwareRouter, RoundRobinRouter, Router
from workloads import loadgen
from workloads.gpt import GPT, GPTConfig
from workloads.loadgen import LoadConfig, Request
from workloads.serve_engine import (
    CacheFactory,
    Completion,
    Engine,
    ReplicaConfig,
    quantized_cache_factory,
)

log = logging.getLogger(__name__)

# -- processes: replicas and the launcher ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """A whole run: replicas, their model and cache, the router and telemetry."""

    replicas: int = 2
    model: GPTConfig = field(default_factory=GPTConfig)
    model_seed: int = 0
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    slow_replicas: tuple[int, ...] = ()
    slow_step_delay_s: float = 0.0
    router: str = "round_robin"
    load_aware: LoadAwareConfig = field(default_factory=LoadAwareConfig)
    prewarm_history: int = 0
    kv_group_size: int = 32
    kv_residual_tokens: int = 16
    threads_per_replica: int = 1
    job: str = "serve"
    otlp_endpoint: str | None = None
    export_interval_s: float = 5.0
    ready_timeout_s: float = 120.0
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise SeedanceError(f"ServeConfig.replicas must be >= 1, got {self.replicas}")
        if self.router not in ("round_robin", "load_aware"):
            raise SeedanceError(f"ServeConfig.router must be round_robin or load_aware, "
                                f"got {self.router!r}")
        if any(not 0 <= i < self.replicas for i in self.slow_replicas):
            raise SeedanceError("ServeConfig.slow_replicas must name replicas 0..replicas-1")


def build_model(config: GPTConfig, seed: int) -> GPT:
    """The same weights in every replica (seeded initialisation)."""
    torch.manual_seed(seed)
    return GPT(config).eval()


def cache_factory(config: ServeConfig) -> CacheFactory:
    """The replicas' KV cache factory, from ``config.replica.kv_bits`` and the group settings."""
    key_bits, value_bits = config.replica.kv_bits
    return quantized_cache_factory(config.model, key_bits=key_bits, value_bits=value_bits,
                                   group_size=config.kv_group_size,
                                   residual_tokens=config.kv_residual_tokens)


def replica_main(index: int, config: ServeConfig, history: list[tuple[int, ...]],
                 inbox: Any, outbox: Any, loads: Any) -> None:
    """A replica process: build the engine, then serve its inbox until told to stop."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(config.threads_per_replica)
    telemetry = setup_telemetry(TelemetryConfig(
        job=config.job, rank=index, otlp_endpoint=config.otlp_endpoint,
        export_interval_s=config.export_interval_s))
    delay = config.slow_step_delay_s if index in config.slow_replicas else 0.0
    replica_config = dataclasses.replace(config.replica, step_delay_s=delay)
    engine = Engine(build_model(config.model, config.model_seed), cache_factory(config),
                    replica_config, replica=index, meter=telemetry.meter("workloads.serve"))
    if history:
        engine.prewarm(history)
    outbox.put(("ready", index, engine.prefix_cache.stats().prewarmed))
    try:
        while True:
            try:
                message = inbox.get(timeout=0.05) if engine.idle else inbox.get_nowait()
                if message is None:
                    break
                engine.submit(message)
                continue  # take everything that is there before stepping
            except queue.Empty:
                pass
            try:
                for done in engine.step():
                    outbox.put(("done", done))
            except Exception:
                log.exception("replica %d: step failed; going on", index)
            loads[index] = engine.backlog_s()
        outbox.put(("stats", index, asdict(engine.prefix_cache.stats())))
    finally:
        telemetry.shutdown()


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """Per-request latencies (s, from scheduled arrival) and what the run saw."""

    latencies_s: dict[int, float]
    completions: list[Completion]
    cache_stats: dict[int, dict[str, int]]
    weights_history: list[tuple[float, tuple[float, ...]]]
    lost: list[int]

    def summary(self) -> dict[str, Any]:
        """The JSON summary ``main`` prints: exact p50/p99, hit rate, requests per replica."""
        lat = np.array(list(self.latencies_s.values()))
        hits = sum(c.prefix_hit for c in self.completions)
        per_replica = np.bincount([c.replica for c in self.completions]).tolist()
        return {
            "requests": len(lat), "lost": len(self.lost),
            "p50_s": quantile(lat, 0.50), "p99_s": quantile(lat, 0.99),
            "mean_s": float(lat.mean()) if len(lat) else math.nan,
            "hit_rate": hits / len(self.completions) if self.completions else 0.0,
            "requests_per_replica": per_replica,
            "final_weights": list(self.weights_history[-1][1]) if self.weights_history else [],
            "cache": self.cache_stats,
        }


def quantile(values: np.ndarray, q: float) -> float:
    """The exact order statistic (smallest value with at least q of them at or below)."""
    return float(np.quantile(values, q, method="inverted_cdf")) if len(values) else math.nan


def replay(engine: Engine, requests: Sequence[Request], *,
           timeout_s: float = 600.0) -> RunResult:
    """One replica in this process, open loop: each request is submitted once its scheduled
    arrival has passed (between steps) and timed from that arrival."""
    t0 = time.monotonic()
    arrival = {r.id: t0 + r.arrival_s for r in requests}
    done: list[Completion] = []
    pending = deque(requests)
    while len(done) < len(requests) and time.monotonic() - t0 < timeout_s:
        now = time.monotonic()
        while pending and arrival[pending[0].id] <= now:
            engine.submit(pending.popleft())
        if engine.idle and pending:
            time.sleep(min(0.01, max(0.0, arrival[pending[0].id] - now)))
            continue
        done += engine.step()
    return RunResult(latencies_s={c.id: c.finished_s - arrival[c.id] for c in done},
                     completions=done, cache_stats={0: asdict(engine.prefix_cache.stats())},
                     weights_history=[], lost=sorted(set(arrival) - {c.id for c in done}))


def make_router(config: ServeConfig) -> Router:
    """The router ``config.router`` names, over ``config.replicas``."""
    if config.router == "load_aware":
        return LoadAwareRouter(config.replicas, config.load_aware)
    return RoundRobinRouter(config.replicas)


def run(config: ServeConfig, requests: Sequence[Request],
        history: list[tuple[int, ...]] | None = None) -> RunResult:
    """Start the replicas, replay ``requests`` open-loop through the router, collect."""
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in range(config.replicas)]
    outbox = ctx.Queue()
    loads = ctx.Array("d", config.replicas, lock=False)
    procs = [ctx.Process(target=replica_main, name=f"serve-replica-{i}", daemon=True,
                         args=(i, config, history or [], inboxes[i], outbox, loads))
             for i in range(config.replicas)]
    for p in procs:
        p.start()
    router = make_router(config)
    done: dict[int, Completion] = {}
    stats: dict[int, dict[str, int]] = {}
    weights: list[tuple[float, tuple[float, ...]]] = []

    def drain(until_s: float) -> None:
        while True:
            timeout = until_s - time.monotonic()
            try:
                message = outbox.get(timeout=max(0.0, min(timeout, 0.01)))
            except queue.Empty:
                message = None
            if message is not None and message[0] == "done":
                done[message[1].id] = message[1]
            elif message is not None and message[0] == "stats":
                stats[message[1]] = message[2]
            if message is None:
                router.observe(list(loads))
                if time.monotonic() >= until_s:
                    return

    try:
        ready = 0
        deadline = time.monotonic() + config.ready_timeout_s
        while ready < config.replicas:
            message = outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            ready += message[0] == "ready"
        t0 = time.monotonic() + 0.05
        for request in requests:
            drain(t0 + request.arrival_s)
            target = router.route()
            weights.append((time.monotonic() - t0, router.weights))
            inboxes[target].put(request)
        deadline = time.monotonic() + config.drain_timeout_s
        while len(done) < len(requests) and time.monotonic() < deadline:
            drain(time.monotonic() + 0.05)
        for box in inboxes:
            box.put(None)
        deadline = time.monotonic() + 10.0
        while len(stats) < config.replicas and time.monotonic() < deadline:
            drain(time.monotonic() + 0.05)
    finally:
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.terminate()
    arrival = {r.id: t0 + r.arrival_s for r in requests}
    return RunResult(latencies_s={i: c.finished_s - arrival[i] for i, c in done.items()},
                     completions=list(done.values()), cache_stats=stats,
                     weights_history=weights,
                     lost=sorted(set(arrival) - set(done)))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; exit status 1 when any request was lost."""
    p = argparse.ArgumentParser(prog="python -m workloads.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rate-rps", type=float, default=20.0)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--n-prefixes", type=int, default=64)
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--prefix-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--policy", choices=("lru", "pinned"), default="lru")
    p.add_argument("--capacity-entries", type=int, default=16)
    p.add_argument("--pin-top-k", type=int, default=8)
    p.add_argument("--prewarm-top-k", type=int, default=0)
    p.add_argument("--router", choices=("round_robin", "load_aware"), default="round_robin")
    p.add_argument("--alpha", type=float, default=0.82)
    p.add_argument("--tau-s", type=float, default=45.0)
    p.add_argument("--threshold", type=float, default=0.15)
    p.add_argument("--slow-replica", type=int, action="append", default=[])
    p.add_argument("--slow-step-delay-s", type=float, default=0.0)
    p.add_argument("--kv-bits", type=int, nargs=2, default=(8, 8),
                   help="key and value bits: 2, 4, 6, 8, or 16 / 32 (unquantised)")
    p.add_argument("--quality-every", type=int, default=10)
    p.add_argument("--otlp-endpoint", default=None)
    p.add_argument("--job", default="serve")
    args = p.parse_args(argv)
    load = LoadConfig(rate_rps=args.rate_rps, duration_s=args.duration_s,
                      n_prefixes=args.n_prefixes, zipf_s=args.zipf_s,
                      prefix_tokens=args.prefix_tokens, seed=args.seed)
    cache = PrefixCacheConfig(policy=args.policy, capacity_entries=args.capacity_entries,
                              pin_top_k=args.pin_top_k, prewarm_top_k=args.prewarm_top_k)
    config = ServeConfig(
        replicas=args.replicas, router=args.router, slow_replicas=tuple(args.slow_replica),
        slow_step_delay_s=args.slow_step_delay_s, job=args.job,
        otlp_endpoint=args.otlp_endpoint,
        load_aware=LoadAwareConfig(alpha=args.alpha, tau_s=args.tau_s,
                                   threshold=args.threshold),
        replica=ReplicaConfig(max_batch=args.max_batch, prefix_cache=cache,
                              quality_every=args.quality_every,
                              kv_bits=(args.kv_bits[0], args.kv_bits[1])))
    history = loadgen.recent_history(load, 256) if args.prewarm_top_k else None
    result = run(config, loadgen.generate(load), history)
    json.dump(result.summary(), sys.stdout, indent=2)
    print()
    return 0 if not result.lost else 1


if __name__ == "__main__":
    raise SystemExit(main())
