"""One serving replica: the small GPT decoding with a KV cache, continuous batching and a
prefix cache (the launcher that runs replicas behind a router is ``workloads.serve``).

A replica runs continuous batching: before every decode step it admits waiting requests (up to
``max_batch`` running), prefilling each one; then one batched decode step advances every running
request by one greedy token. Prefill looks the request's shared prefix up in the prefix cache
(``tuner.prefix_cache``): a hit copies the KV state after the prefix into the request's cache
and prefills only the suffix. ``step_delay_s`` injects a per-step delay (a slow replica).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeter, Observation

from collectors import SeedanceError
from collectors.names import ATTR_SEEDANCE_CONFIG_VERSION
from collectors.torch_serving import ServingInstrumentation
from tuner import KnobValue
from tuner.kv_cache import QuantizedKVCache
from tuner.prefix_cache import PrefixCache, PrefixCacheConfig
from tuner.serving_guardrails import QUALITY_METRIC
from workloads.gpt import GPT, Block, GPTConfig
from workloads.loadgen import Request

log = logging.getLogger(__name__)

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


class KVCache(Protocol):
    """One sequence's KV cache (``tuner.kv_cache.QuantizedKVCache`` has this shape).

    ``append`` takes one layer's new keys and values shaped (1, n_heads, tokens, head_dim);
    ``keys_values`` returns all of the layer's so far, dequantised, in the same layout.
    """

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``layer``'s keys and values for the new tokens."""

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All of ``layer``'s keys and values so far, ready for attention."""

    def nbytes(self) -> int:
        """Bytes held now; summed over running requests into the KV cache size metric."""

    def set_bits(self, *, key_bits: int | None = None, value_bits: int | None = None) -> None:
        """Change the width of tokens quantised from now on (a live knob switch)."""


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

    # -- feeding -------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue ``request``; it is admitted and prefilled at a later ``step``."""
        limit = self.model.config.block_size
        if len(request.prompt) + request.max_new_tokens > limit:
            raise SeedanceError(f"request {request.id}: prompt + output exceeds block_size "
                                f"{limit}")
        now = self._clock()
        self.instrumentation.request_started(request.id)
        self._waiting.append((request, now))

    @property
    def idle(self) -> bool:
        """True when nothing is waiting or running (``step`` would do nothing)."""
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
        """Apply a serving config between steps (``tuner.job.ServeSession`` calls it).

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
        # the counts behind the gauge, per config version: a judge needs the sample's size
        self.instrumentation.tokens_checked(len(agrees), sum(agrees))

    def _observe_quality(self, options: CallbackOptions) -> list[Observation]:
        """The agreement over the checked tokens, once there are ``quality_min_tokens`` (a
        handful of tokens right after a config switch is too small a sample to judge by)."""
        if len(self._checked) < self.config.quality_min_tokens:
            return []
        return [Observation(sum(self._checked) / len(self._checked),
                            {ATTR_SEEDANCE_CONFIG_VERSION: self.instrumentation.config_version})]

    def _report(self) -> None:
        ins = self.instrumentation
        ins.set_batch_size(len(self._running))
        ins.set_queue_depth(len(self._waiting))
        key_bits, value_bits = self.config.kv_bits
        ins.set_kv_cache(size_bytes=sum(r.cache.nbytes() for r in self._running),
                         key_bits=key_bits, value_bits=value_bits)


