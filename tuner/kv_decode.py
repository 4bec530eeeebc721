"""Decode with an external KV cache through the demo GPT's own modules and weights.

``workloads.gpt.GPT`` recomputes attention over the whole sequence on every forward; it has no
cache. :func:`decode_step` runs the same computation incrementally: it reuses the model's
``wte``, ``wpe``, and each block's ``ln_1``, ``attn.qkv``, ``attn.proj``, ``ln_2``, ``mlp``,
``ln_f`` and ``lm_head`` (no weights are copied), and keeps keys and values in a
:class:`tuner.kv_cache.QuantizedKVCache`. With an unquantised (32-bit) cache it reproduces the
model's full forward (tested). The model is duck-typed (``tuner`` must not import
``workloads``): any nanoGPT-shaped module with those names works.

New tokens attend to the cached (dequantised) keys and values plus their own keys and values in
full precision, as quantised-cache servers do in prefill; they are then appended to the cache.

Imported by the serving job only (it needs torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tuner.kv_cache import KVCacheError, QuantizedKVCache

__all__ = ["KVQuality", "cache_for", "decode_step", "kv_quality"]

_MODULES = ("wte", "wpe", "h", "ln_f", "lm_head", "config")
_BLOCK_MODULES = ("ln_1", "attn", "ln_2", "mlp")


# The model is duck-typed (nanoGPT attribute names), hence ``Any`` for it below.
def _check_model(model: Any) -> None:
    missing = [n for n in _MODULES if not hasattr(model, n)]
    missing += [f"h.0.{n}" for n in _BLOCK_MODULES if len(model.h) and not hasattr(model.h[0], n)]
    if missing:
        raise KVCacheError(f"model lacks the nanoGPT modules decode_step runs: {missing}")


def cache_for(model: Any, **kwargs: object) -> QuantizedKVCache:
    """A cache shaped for ``model`` (layers, heads, head size, its device and dtype);
    ``kwargs`` go to :class:`QuantizedKVCache` (``key_bits``, ``group_size``, ...)."""
    _check_model(model)
    n_head = model.h[0].attn.n_head
    weight = model.wte.weight
    kwargs.setdefault("device", weight.device)
    kwargs.setdefault("dtype", weight.dtype)
    return QuantizedKVCache(len(model.h), n_head, model.config.n_embd // n_head,
                            **kwargs)  # type: ignore[arg-type]


@torch.no_grad()
def decode_step(model: Any, cache: QuantizedKVCache | Sequence[QuantizedKVCache],
                tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, new_tokens, vocab] for ``tokens`` [batch, new_tokens] that follow what
    the cache holds; their keys and values are appended to it.

    ``cache`` is one cache for the whole batch (equal lengths), or one cache per row of
    ``tokens`` (each of batch 1; lengths may differ, as in continuous batching). Prefill is a
    call with the prompt, decode a call with one token per row.
    """
    _check_model(model)
    caches = [cache] if isinstance(cache, QuantizedKVCache) else list(cache)
    b, t = tokens.shape
    if len(caches) != 1 and len(caches) != b:
        raise KVCacheError(f"give one cache or one per row: {len(caches)} caches, {b} rows")
    rows = [slice(None)] if len(caches) == 1 else [slice(i, i + 1) for i in range(b)]
    starts = torch.tensor([c.seq_len for c in caches], device=tokens.device)
    pos = starts[:, None] + torch.arange(t, device=tokens.device)  # [1 or b, t]
    if int(pos.max()) >= model.config.block_size:
        raise KVCacheError(f"position {int(pos.max())} exceeds the model's block_size "
                           f"{model.config.block_size}")
    x = model.wte(tokens) + model.wpe(pos)
    c = x.shape[-1]
    for layer, block in enumerate(model.h):
        attn = block.attn
        n_head = attn.n_head
        q, k, v = attn.qkv(block.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        ys = []
        for kv_cache, row in zip(caches, rows, strict=True):
            ys.append(_attend(kv_cache, layer, q[row], k[row], v[row]))
        y = torch.cat(ys, dim=0) if len(ys) > 1 else ys[0]
        x = x + attn.proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))


def _attend(cache: QuantizedKVCache, layer: int, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the new queries over cached + new keys; appends the new ones."""
    held = cache.layer_len(layer)
    if held:
        keys, values = cache.keys_values(layer, then=(k, v))
    else:
        keys, values = k, v
    t = q.shape[2]
    mask = None
    if t > 1:
        key_pos = torch.arange(held + t, device=q.device)
        mask = key_pos[None, :] <= held + torch.arange(t, device=q.device)[:, None]
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    cache.append(layer, k, v)
    return y


@dataclass(frozen=True, slots=True, kw_only=True)
class KVQuality:
    """Quality of decoding through a cache against the model's own (unquantised) forward.

    ``kl_nats``: mean KL(reference || cached) of the next-token distributions, nats per token;
    ``nll_nats`` / ``ref_nll_nats``: mean negative log-likelihood of the actual next tokens.
    """

    kl_nats: float
    nll_nats: float
    ref_nll_nats: float
    tokens: int

    @property
    def perplexity_ratio(self) -> float:
        """Perplexity with the cache over the reference perplexity (1.0 = no loss)."""
        return math.exp(self.nll_nats - self.ref_nll_nats)


@torch.no_grad()
def kv_quality(model: Any, tokens: torch.Tensor, cache: QuantizedKVCache) -> KVQuality:
    """Teacher-forced decode of ``tokens`` [batch, seq] one token a step through ``cache``
    (empty, batch-sized), compared with ``model(tokens)``; the cache is left filled."""
    reference = F.log_softmax(model(tokens).float(), dim=-1)
    steps = [decode_step(model, cache, tokens[:, i:i + 1]) for i in range(tokens.shape[1])]
    cached = F.log_softmax(torch.cat(steps, dim=1).float(), dim=-1)
    kl = F.kl_div(cached, reference, log_target=True, reduction="none").sum(-1)
    targets = tokens[:, 1:].unsqueeze(-1)
    nll = -cached[:, :-1].gather(-1, targets).mean()
    ref_nll = -reference[:, :-1].gather(-1, targets).mean()
    return KVQuality(kl_nats=float(kl.mean()), nll_nats=float(nll),
                     ref_nll_nats=float(ref_nll), tokens=int(kl.numel()))
