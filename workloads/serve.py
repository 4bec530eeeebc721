"""The demo serving job: the small GPT decoding with a KV cache, batched, behind a router.

``python -m workloads.serve --replicas 2 --rate-rps 20 --duration-s 30 --router load_aware``
starts one process per replica, replays a seeded load (``workloads.loadgen``) open-loop against
them through a router (``tuner.routing``) and prints a JSON summary; every replica exports the
serving metrics (``collectors.torch_serving``) over OTLP when ``--otlp-endpoint`` is given.

A replica runs continuous batching: before every decode step it admits waiting requests (up to
``max_batch`` running), prefilling each one; then one batched decode step advances every running
request by one greedy token. Prefill looks the request's shared prefix up in the prefix cache
(``tuner.prefix_cache``): a hit copies the KV state after the prefix into the request's cache
and prefills only the suffix. ``step_delay_s`` injects a per-step delay (a slow replica).

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
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeter, Observation

from collectors import SeedanceError, TelemetryConfig, setup_telemetry
from collectors.torch_serving import ServingInstrumentation
from tuner import KnobValue
from tuner.kv_cache import QuantizedKVCache
from tuner.prefix_cache import PrefixCache, PrefixCacheConfig
from tuner.routing import LoadAwareConfig, LoadAwareRouter, RoundRobinRouter, Router
from tuner.serving_guardrails import (
    AGREEING_TOKENS_METRIC,
    CHECKED_TOKENS_METRIC,
    QUALITY_METRIC,
)
from workloads import loadgen
from workloads.gpt import GPT, Block, GPTConfig
from workloads.loadgen import LoadConfig, Request

log = logging.getLogger(__name__)

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


class KVCache(Protocol):
    """One sequence's KV cache (``tuner.kv_cache.QuantizedKVCache`` has this shape).

    ``append`` takes one layer's new keys and values shaped (1, n_heads, tokens, head_dim);
    ``keys_values`` returns all of the layer's so far, dequantised, in the same layout.
    """

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def nbytes(self) -> int: ...

    def set_bits(self, *, key_bits: int | None = None, value_bits: int | None = None) -> None:
        ...


CacheFactory = Callable[[], KVCache]


def quantized_cache_factory(model: GPTConfig, *, key_bits: int, value_bits: int,
                            group_size: int, residual_tokens: int,
                            device: str = "cpu") -> CacheFactory:
    """A fresh ``QuantizedKVCache`` per sequence (16 / 32 bits: kept as is, unquantised)."""
    def make() -> KVCache:
        return QuantizedKVCache(model.n_layer, model.n_head, model.n_embd // model.n_head,
                                key_bits=key_bits, value_bits=value_bits,
                                group_size=group_size, residual_tokens=residual_tokens,
                                device=device)
    return make


# -- the model with a KV cache -----------------------------------------------------------------


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    b, t, c = x.shape
    return x.view(b, t, n_head, c // n_head).transpose(1, 2)


@torch.no_grad()
def prefill(model: GPT, cache: KVCache, tokens: Sequence[int], start: int,
            capture: LayerKV | None = None) -> torch.Tensor:
    """Run ``tokens`` at positions ``start..`` over what ``cache`` holds, appending their KV;
    the logits after the last token. ``capture`` receives each layer's new (k, v)."""
    n = len(tokens)
    idx = torch.tensor([list(tokens)], dtype=torch.long)
    x = model.wte(idx) + model.wpe(torch.arange(start, start + n))
    mask = (torch.arange(n)[:, None] + start) >= torch.arange(start + n)[None, :]
    for layer, block in enumerate(cast(Sequence[Block], model.h)):
        q, k, v = block.attn.qkv(block.ln_1(x)).split(model.config.n_embd, dim=2)
        q, k, v = (_heads(z, block.attn.n_head) for z in (q, k, v))
        cache.append(layer, k, v)
        if capture is not None:
            capture.append((k, v))
        keys, values = cache.keys_values(layer)
        y = F.scaled_dot_product_attention(q, keys.reshape(1, *keys.shape[-3:]),
                                           values.reshape(1, *values.shape[-3:]),
                                           attn_mask=mask)
        x = x + block.attn.proj(y.transpose(1, 2).reshape(1, n, -1))
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x[:, -1]))[0]


@torch.no_grad()
def decode(model: GPT, caches: Sequence[KVCache], tokens: Sequence[int],
           positions: Sequence[int]) -> torch.Tensor:
    """One batched decode step: token b at position b over cache b; logits (batch, vocab)."""
    b = len(tokens)
    x = (model.wte(torch.tensor(tokens)) + model.wpe(torch.tensor(positions)))[:, None, :]
    longest = max(positions) + 1
    valid = torch.arange(longest)[None, :] <= torch.tensor(positions)[:, None]
    mask = valid[:, None, None, :]
    for layer, block in enumerate(cast(Sequence[Block], model.h)):
        q, k, v = block.attn.qkv(block.ln_1(x)).split(model.config.n_embd, dim=2)
        q, k, v = (_heads(z, block.attn.n_head) for z in (q, k, v))
        keys = q.new_zeros(b, q.shape[1], longest, q.shape[3])
        values = torch.zeros_like(keys)
        for i, cache in enumerate(caches):
            cache.append(layer, k[i:i + 1], v[i:i + 1])
            kk, vv = cache.keys_values(layer)
            t = kk.shape[-2]
            keys[i, :, :t] = kk.reshape(kk.shape[-3:])
            values[i, :, :t] = vv.reshape(vv.shape[-3:])
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + block.attn.proj(y.transpose(1, 2).reshape(b, 1, -1))
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x[:, -1]))


# -- one replica -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ReplicaConfig:
    """One replica's batch size, injected slowness, prefix cache and quality sampling."""

    max_batch: int = 8
    step_delay_s: float = 0.0
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    quality_every: int = 0
    quality_window_tokens: int = 256
    quality_min_tokens: int = 1
    kv_bits: tuple[int, int] = (32, 32)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise SeedanceError(f"ReplicaConfig.max_batch must be >= 1, got {self.max_batch}")
        if self.step_delay_s < 0:
            raise SeedanceError("ReplicaConfig.step_delay_s must be >= 0")
        if self.quality_every < 0 or self.quality_window_tokens < 1:
            raise SeedanceError("ReplicaConfig.quality_every must be >= 0 and "
                                "quality_window_tokens >= 1")
        if not 1 <= self.quality_min_tokens <= self.quality_window_tokens:
            raise SeedanceError("ReplicaConfig.quality_min_tokens must be in "
                                "[1, quality_window_tokens]")


@dataclass(frozen=True, kw_only=True)
class Completion:
    """A finished request as the replica saw it (monotonic seconds)."""

    id: int
    replica: int
    prefix_hit: bool
    received_s: float
    first_token_s: float
    finished_s: float
    tokens: tuple[int, ...]


@dataclass(slots=True, kw_only=True)
class _Running:
    request: Request
    cache: KVCache
    received_s: float
    prefix_hit: bool
    first_token_s: float = 0.0
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.request.prompt) + len(self.tokens)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.max_new_tokens


class Engine:
    """One replica's continuous-batching decode loop; the process around it feeds requests.

    Not thread-safe: ``submit`` and ``step`` come from one loop.
    """

    def __init__(self, model: GPT, cache_factory: CacheFactory, config: ReplicaConfig, *,
                 replica: int = 0, meter: Meter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        meter = meter or NoOpMeter("workloads.serve")
        self.model = model.eval()
        self.config = config
        self.replica = replica
        self._cache_factory = cache_factory
        self._kv_bits_set: tuple[int, int] | None = None  # bits a live config set, if any
        self._clock = clock
        self.instrumentation = ServingInstrumentation(meter, config_version=0, clock=clock)
        self.prefix_cache: PrefixCache[LayerKV] = PrefixCache(config.prefix_cache,
                                                              self.instrumentation)
        self._waiting: deque[tuple[Request, float]] = deque()
        self._running: list[_Running] = []
        self._step_s = 0.0
        self._checked: deque[bool] = deque(maxlen=config.quality_window_tokens)
        self._finished = 0
        meter.create_observable_gauge(
            QUALITY_METRIC, callbacks=[self._observe_quality], unit="1",
            description="Share of sampled greedy tokens a cache-free full-precision forward "
            "also picks")
        # the counts behind it, per config version: a judge needs the sample's size
        self._checked_tokens = meter.create_counter(
            CHECKED_TOKENS_METRIC, unit="{token}",
            description="Generated tokens checked against a cache-free forward")
        self._agreeing_tokens = meter.create_counter(
            AGREEING_TOKENS_METRIC, unit="{token}",
            description="Checked tokens the cache-free forward also picks")

    # -- feeding -------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        limit = self.model.config.block_size
        if len(request.prompt) + request.max_new_tokens > limit:
            raise SeedanceError(f"request {request.id}: prompt + output exceeds block_size "
                                f"{limit}")
        now = self._clock()
        self.instrumentation.request_started(request.id)
        self._waiting.append((request, now))

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    def backlog_s(self) -> float:
        """Seconds to finish what the replica holds at its recent step time: every waiting
        request costs a prefill step, and decode steps are shared by up to max_batch."""
        tokens = sum(r.request.max_new_tokens - len(r.tokens) for r in self._running)
        tokens += sum(req.max_new_tokens for req, _ in self._waiting)
        steps = len(self._waiting) + math.ceil(tokens / self.config.max_batch)
        return steps * self._step_s

    def prewarm(self, history: Sequence[tuple[int, ...]] | None = None,
                top_k: int | None = None) -> int:
        """Precompute the most frequent prefixes of ``history`` (or of recent look-ups)."""
        return self.prefix_cache.prewarm(self._compute_prefix, history=history, top_k=top_k)

    def _compute_prefix(self, key: Hashable) -> tuple[LayerKV, int]:
        capture: LayerKV = []
        prefill(self.model, self._new_cache(), key, 0, capture)  # type: ignore[arg-type]
        return capture, sum(k.numel() * k.element_size() * 2 for k, _ in capture)

    def _new_cache(self) -> KVCache:
        cache = self._cache_factory()
        if self._kv_bits_set is not None:
            cache.set_bits(key_bits=self._kv_bits_set[0], value_bits=self._kv_bits_set[1])
        return cache

    def apply_knobs(self, values: Mapping[str, KnobValue]) -> None:
        """Apply a serving config between steps (``tuner.serve_client`` calls it).

        ``kv.key_bits`` / ``kv.value_bits``: the width of tokens quantised from now on, in new
        caches and in the running requests' caches (``QuantizedKVCache.set_bits``).
        ``prefix_cache.*``: the prefix cache's config (shrinking evicts at once; a higher
        ``prewarm_top_k`` prewarms from the recent look-ups). ``serving.step_delay_s``: the
        INJECTED per-step delay (a slow replica; demos and tests declare it). The quality
        sample restarts, so the token agreement a version reports is its own. ``routing.*``
        and ``serving.sharding`` belong to the launcher, not to a replica, and are left alone.
        """
        if "serving.step_delay_s" in values:
            self.config = dataclasses.replace(
                self.config, step_delay_s=float(values["serving.step_delay_s"]))
        bits = (int(values.get("kv.key_bits", self.config.kv_bits[0])),
                int(values.get("kv.value_bits", self.config.kv_bits[1])))
        if bits != self.config.kv_bits:
            for r in self._running:
                r.cache.set_bits(key_bits=bits[0], value_bits=bits[1])
            self._kv_bits_set = bits
            self.config = dataclasses.replace(self.config, kv_bits=bits)
        cache_values = {k: v for k, v in values.items() if k.startswith("prefix_cache.")}
        if cache_values:
            old = self.prefix_cache.config
            new = PrefixCacheConfig.from_knobs({
                "prefix_cache.policy": old.policy,
                "prefix_cache.capacity_entries": old.capacity_entries,
                "prefix_cache.capacity_mib": old.capacity_bytes / 2**20,
                "prefix_cache.pin_top_k": old.pin_top_k,
                "prefix_cache.prewarm_top_k": old.prewarm_top_k, **cache_values},
                history=old.history)
            if new != old:
                self.prefix_cache.config = new
                self.config = dataclasses.replace(self.config, prefix_cache=new)
                if new.prewarm_top_k > old.prewarm_top_k:
                    self.prewarm()
        self._checked.clear()

    # -- one scheduling iteration --------------------------------------------------------------

    def step(self) -> list[Completion]:
        """Admit and prefill waiting requests, then one decode step; the finished requests."""
        if self.idle:
            return []
        started = self._clock()
        finished: list[Completion] = []
        while self._waiting and len(self._running) < self.config.max_batch:
            request, received = self._waiting.popleft()
            self._running.append(self._admit(request, received))
        live = [r for r in self._running if not r.done]
        if live:
            logits = decode(self.model, [r.cache for r in live], [r.tokens[-1] for r in live],
                            [r.length - 1 for r in live])
            for r, token in zip(live, logits.argmax(-1).tolist(), strict=True):
                r.tokens.append(int(token))
                self.instrumentation.token(r.request.id)
        if self.config.step_delay_s:
            time.sleep(self.config.step_delay_s)
        now = self._clock()
        for r in [r for r in self._running if r.done]:
            self._running.remove(r)
            finished.append(self._finish(r, now))
        self._report()
        elapsed = now - started
        self._step_s = elapsed if self._step_s == 0 else 0.8 * self._step_s + 0.2 * elapsed
        return finished

    def _admit(self, request: Request, received: float) -> _Running:
        cache = self._new_cache()
        prefix = request.prompt[:request.prefix_len]
        cached = self.prefix_cache.get(prefix)
        if cached is None:
            capture: LayerKV = []
            prefill(self.model, cache, prefix, 0, capture)
            self.prefix_cache.put(prefix, capture,
                                  sum(k.numel() * k.element_size() * 2 for k, _ in capture))
        else:
            for layer, (k, v) in enumerate(cached):
                cache.append(layer, k, v)
        logits = prefill(self.model, cache, request.prompt[request.prefix_len:],
                         request.prefix_len)
        running = _Running(request=request, cache=cache, received_s=received,
                           prefix_hit=cached is not None)
        running.tokens.append(int(logits.argmax()))
        running.first_token_s = self._clock()
        self.instrumentation.first_token(request.id)
        return running

    def _finish(self, r: _Running, now: float) -> Completion:
        self.instrumentation.request_finished(r.request.id, len(r.tokens))
        self._finished += 1
        if self.config.quality_every and self._finished % self.config.quality_every == 0:
            self._check_quality(r)
        return Completion(id=r.request.id, replica=self.replica, prefix_hit=r.prefix_hit,
                          received_s=r.received_s, first_token_s=r.first_token_s,
                          finished_s=now, tokens=tuple(r.tokens))

    @torch.no_grad()
    def _check_quality(self, r: _Running) -> None:
        """Teacher-forced: does a cache-free forward pick the tokens the server produced?"""
        prompt = list(r.request.prompt)
        sequence = torch.tensor([prompt + r.tokens[:-1]])
        picks = self.model(sequence)[0, len(prompt) - 1:].argmax(-1).tolist()
        agrees = [p == t for p, t in zip(picks, r.tokens, strict=True)]
        self._checked.extend(agrees)
        version = {"seedance.config.version": self.instrumentation.config_version}
        self._checked_tokens.add(len(agrees), version)
        self._agreeing_tokens.add(sum(agrees), version)

    def _observe_quality(self, options: CallbackOptions) -> list[Observation]:
        """The agreement over the checked tokens, once there are ``quality_min_tokens`` (a
        handful of tokens right after a config switch is too small a sample to judge by)."""
        if len(self._checked) < self.config.quality_min_tokens:
            return []
        return [Observation(sum(self._checked) / len(self._checked),
                            {"seedance.config.version": self.instrumentation.config_version})]

    def _report(self) -> None:
        ins = self.instrumentation
        ins.set_batch_size(len(self._running))
        ins.set_queue_depth(len(self._waiting))
        key_bits, value_bits = self.config.kv_bits
        ins.set_kv_cache(size_bytes=sum(r.cache.nbytes() for r in self._running),
                         key_bits=key_bits, value_bits=value_bits)


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
