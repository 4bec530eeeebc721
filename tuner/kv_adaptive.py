"""The seed's adaptive KV quantiser (section 4.2): long context and dispersed key norms -> fewer
bits, else more; every decision is logged as one JSON line.

Rule (thresholds are knobs, :data:`KV_ADAPTIVE_KNOBS`): when ``kv_len > length_threshold`` and
``entropy > entropy_threshold`` new tokens are stored at ``low_bits``, else at ``high_bits``
(the seed's values: 64K tokens, 0.85, 4 and 6 bits); entropy is the normalised Shannon entropy
of recent key norms. Imported by the serving job only (it needs torch).

docs/internals.md, 'The adaptive KV quantiser' defines the entropy and the positions, and says why.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tuner._knobs import Knob, KnobValue
from tuner.kv_cache import BITS, KVCacheError, QuantizedKVCache

__all__ = [
    "KV_ADAPTIVE_KNOBS",
    "AdaptiveKVConfig",
    "AdaptiveKVQuantizer",
    "choose_bits",
    "key_norm_entropy",
]

_LOG = logging.getLogger(__name__)

KV_ADAPTIVE_KNOBS: tuple[Knob, ...] = (
    Knob(name="kv.adaptive.length_threshold", default=65536, low=16, high=1 << 22, integer=True,
         log=True, description="KV tokens above which high-entropy windows get low_bits"),
    Knob(name="kv.adaptive.entropy_threshold", default=0.85, low=0.0, high=1.0,
         description="normalised key-norm entropy above which long contexts get low_bits"),
    Knob(name="kv.adaptive.low_bits", default=4, choices=(2, 4, 6, 8),
         description="KV bits for long, high-entropy context"),
    Knob(name="kv.adaptive.high_bits", default=6, choices=(4, 6, 8, 16),
         description="KV bits otherwise"),
)
"""The searchable thresholds; declare them with ``tuner.job`` (``handle.knob(**...)``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveKVConfig:
    """Thresholds and windows of the rule (module docstring)."""

    length_threshold: int = 65536
    entropy_threshold: float = 0.85
    low_bits: int = 4
    high_bits: int = 6
    window_tokens: int = 64
    bins: int = 16
    decide_every_tokens: int = 32
    layer_groups: tuple[tuple[int, ...], ...] | None = None
    """Layer indices decided together (default: all layers, one group)."""

    def __post_init__(self) -> None:
        if self.length_threshold < 0:
            raise KVCacheError(f"AdaptiveKVConfig.length_threshold must be >= 0, got "
                               f"{self.length_threshold}")
        if not 0.0 <= self.entropy_threshold <= 1.0:
            raise KVCacheError(f"AdaptiveKVConfig.entropy_threshold must be in [0, 1], got "
                               f"{self.entropy_threshold}")
        for name in ("low_bits", "high_bits"):
            if getattr(self, name) not in BITS:
                raise KVCacheError(f"AdaptiveKVConfig.{name} must be one of {list(BITS)}")
        if self.low_bits > self.high_bits:
            raise KVCacheError(f"AdaptiveKVConfig.low_bits ({self.low_bits}) must not exceed "
                               f"high_bits ({self.high_bits})")
        for name in ("window_tokens", "decide_every_tokens"):
            if getattr(self, name) < 1:
                raise KVCacheError(f"AdaptiveKVConfig.{name} must be >= 1")
        if self.bins < 2:
            raise KVCacheError(f"AdaptiveKVConfig.bins must be >= 2, got {self.bins}")

    @classmethod
    def from_knobs(cls, values: Mapping[str, KnobValue], **rest: Any) -> AdaptiveKVConfig:
        """A config from knob values (names of :data:`KV_ADAPTIVE_KNOBS`; missing ones take the
        knob default); ``rest`` sets the other fields."""
        prefix = "kv.adaptive."
        picked: dict[str, Any] = {k.name[len(prefix):]: k.validate(values.get(k.name, k.default))
                                  for k in KV_ADAPTIVE_KNOBS}
        return cls(**picked, **rest)


def key_norm_entropy(norms: torch.Tensor, bins: int = 16) -> float:
    """Normalised Shannon entropy of the histogram of ``norms`` (1-D) over their own range."""
    norms = norms.detach().float().reshape(-1)
    n_bins = min(bins, norms.numel())
    if n_bins < 2:
        return 1.0
    lo, hi = float(norms.min()), float(norms.max())
    if not hi > lo:
        return 1.0
    counts = torch.histc(norms, bins=n_bins, min=lo, max=hi)
    p = counts[counts > 0] / norms.numel()
    return float(-(p * p.log()).sum() / math.log(n_bins))


def choose_bits(kv_len: int, entropy: float, config: AdaptiveKVConfig) -> tuple[int, str]:
    """The seed's rule: (bits, reason)."""
    if kv_len <= config.length_threshold:
        return config.high_bits, "short_context"
    if entropy <= config.entropy_threshold:
        return config.high_bits, "low_entropy"
    return config.low_bits, "high_entropy_long_context"


class AdaptiveKVQuantizer:
    """Watches a cache's keys and sets its widths per layer group by :func:`choose_bits`.

    Call :meth:`step` after each decode step (cheap: it decides once per
    ``decide_every_tokens`` tokens). Decisions are appended to ``log_path`` as JSON lines with
    the seed's fields ``seq_pos``, ``kv_len``, ``entropy``, ``target_bw``, ``reason`` plus
    ``layers`` and ``time_ns``; a failing write is logged and the decision still applies.
    """

    def __init__(self, cache: QuantizedKVCache, config: AdaptiveKVConfig | None = None, *,
                 log_path: str | Path | None = None) -> None:
        self.cache = cache
        self.config = config or AdaptiveKVConfig()
        groups = self.config.layer_groups or (tuple(range(cache.n_layers)),)
        for group in groups:
            for layer in group:
                if not 0 <= layer < cache.n_layers:
                    raise KVCacheError(f"layer group {group}: layer {layer} is not in "
                                       f"[0, {cache.n_layers})")
        self.groups = groups
        self.log_path = Path(log_path) if log_path is not None else None
        self.decisions: list[dict[str, Any]] = []
        self._norms: list[torch.Tensor | None] = [None] * cache.n_layers
        self._last_decision_len: int | None = None
        cache.add_append_hook(self._observe)

    def _observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        norms = k.detach().float().norm(dim=-1).mean(dim=(0, 1))  # [new_tokens]
        held = self._norms[layer]
        joined = norms if held is None else torch.cat((held, norms))
        self._norms[layer] = joined[-self.config.window_tokens:]

    def entropy(self, layers: Sequence[int]) -> float:
        """Mean :func:`key_norm_entropy` of the layers' windows (1.0 before any keys)."""
        values = [key_norm_entropy(w, self.config.bins) for i in layers
                  if (w := self._norms[i]) is not None]
        return sum(values) / len(values) if values else 1.0

    def step(self) -> list[dict[str, Any]]:
        """Decide if ``decide_every_tokens`` tokens passed since the last decision."""
        seq_len = self.cache.seq_len
        if self._last_decision_len is not None and \
                seq_len - self._last_decision_len < self.config.decide_every_tokens:
            return []
        return self.decide()

    def decide(self) -> list[dict[str, Any]]:
        """Decide now for every layer group, apply the widths, log and return the records."""
        seq_len = self.cache.seq_len
        self._last_decision_len = seq_len
        kv_len = seq_len * self.cache.batch
        records = []
        for group in self.groups:
            entropy = self.entropy(group)
            bits, reason = choose_bits(kv_len, entropy, self.config)
            self.cache.set_bits(key_bits=bits, value_bits=bits, layers=group)
            records.append({"seq_pos": max(seq_len - 1, 0), "kv_len": kv_len,
                            "entropy": round(entropy, 4), "target_bw": bits, "reason": reason,
                            "layers": list(group), "time_ns": time.time_ns()})
        self.decisions += records
        self._write(records)
        return records

    def _write(self, records: list[dict[str, Any]]) -> None:
        if self.log_path is None:
            return
        try:
            with self.log_path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        except OSError as exc:
            _LOG.warning("KV decision log %s not written: %s", self.log_path, exc)
