"""KV-cache compression whose dequantisation costs more decode time than its memory buys.

Compressing the KV cache only pays when the freed memory admits a larger batch; when demand
never fills the uncompressed batch, dequantising each token is pure cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from collectors import ConfigError
from collectors.names import (
    ATTR_SEEDANCE_KV_PART,
    SERVE_BATCH_SIZE,
    SERVE_KV_CACHE_BITS,
    SERVE_KV_CACHE_BYTES,
    SERVE_KV_CACHE_USAGE,
    SERVE_KV_DEQUANTIZE_DURATION,
    SERVE_QUEUE_DEPTH,
    SERVE_TOKENS_PER_SECOND,
)
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._kv_cost import kv_compression_tradeoff
from policies._window import StoreWindow
from policies.detectors._steps import histogram_totals

DEQUANTIZE = SERVE_KV_DEQUANTIZE_DURATION
KV_BYTES = SERVE_KV_CACHE_BYTES
KV_BITS = SERVE_KV_CACHE_BITS
KV_USAGE = SERVE_KV_CACHE_USAGE
KV_PART_ATTR = ATTR_SEEDANCE_KV_PART
TOKENS_PER_S = SERVE_TOKENS_PER_SECOND
BATCH = SERVE_BATCH_SIZE
QUEUE = SERVE_QUEUE_DEPTH
UNCOMPRESSED_BITS = 16


def _mean(window: StoreWindow, name: str) -> float:
    frame = window.query(name)
    return float(frame.groupby("time")["value"].sum().mean()) if not frame.empty else math.nan


def _peak(window: StoreWindow, name: str) -> float:
    frame = window.query(name)
    return float(frame.groupby("time")["value"].sum().max()) if not frame.empty else math.nan


def _span_s(window: StoreWindow, name: str) -> float:
    frame = window.query(name)
    return float((frame["time"].max() - frame["time"].min()).total_seconds()) if len(frame) else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class KvDecompressionConfig:
    """What the freed KV memory is weighed against, and when the cost is worth flagging.

    ``max_batch_size`` is the engine's batch cap; the requests there are to serve are the peak
    batch plus the peak queue (what would join if memory let them), capped by it: a batch that
    never waits on memory gains nothing from freed bytes. ``kv_budget_bytes`` is the memory the
    KV cache may use (None: bytes held / ``seedance.serve.kv_cache.usage``; neither: no
    verdict). ``min_dequant_share`` ignores dequantisation below that share of a token's decode
    time. ``fixed_step_share`` is the share of a decode step (dequantisation aside) that does
    not grow with the batch (weight reads: decode is memory-bound); an assumption, not a
    measurement, reported in the evidence. ``bit_widths`` mirror the ``kv.key_bits`` / ``kv.value_bits`` knob choices.
    ``uncompressed_read_bytes_per_s`` is how fast the engine builds the attention's operands
    from an uncompressed cache, for engines that copy the whole cache every step (a
    concatenating cache like transformers' ``DynamicCache``, or ``tuner.kv_cache``): that
    copy is what dequantising replaces, so only the difference is added time (bench/kv.py
    measures both on the engine here). None, for engines that read the cache where it lies
    (paged attention), charges all of the dequantisation.
    """

    max_batch_size: int = 64
    kv_budget_bytes: float | None = None
    min_dequant_share: float = 0.02
    min_gain: float = 0.0
    tpot_slo_s: float | None = None
    min_tokens: float = 100.0
    fixed_step_share: float = 0.7
    bit_widths: tuple[int, ...] = (2, 4, 6, 8, 16, 32)
    uncompressed_read_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.kv_budget_bytes is not None and not self.kv_budget_bytes > 0:
            raise ConfigError(f"kv_budget_bytes must be > 0, got {self.kv_budget_bytes}")
        if not 0 <= self.min_dequant_share < 1:
            raise ConfigError(f"min_dequant_share must be in [0, 1), got {self.min_dequant_share}")
        if self.min_tokens <= 0:
            raise ConfigError(f"min_tokens must be > 0, got {self.min_tokens}")
        if not 0 <= self.fixed_step_share < 1:
            raise ConfigError(f"fixed_step_share must be in [0, 1), got {self.fixed_step_share}")
        if self.uncompressed_read_bytes_per_s is not None \
                and not self.uncompressed_read_bytes_per_s > 0:
            raise ConfigError("uncompressed_read_bytes_per_s must be > 0, got "
                              f"{self.uncompressed_read_bytes_per_s}")
        if tuple(sorted(self.bit_widths)) != self.bit_widths or not self.bit_widths:
            raise ConfigError(f"bit_widths must be ascending and non-empty, got {self.bit_widths}")


class KvDecompressionCostDetector(Detector):
    """Flags KV compression whose dequantisation slows decode more than its freed memory helps.

    Measured over the window: dequantise seconds per generated token (``dequantize.duration``
    sum increase / tokens, tokens = mean tokens/s x span), the bit-width per part, bytes held and
    the bytes the same cache would hold at 16 bits. :func:`kv_compression_tradeoff` then weighs
    the batch the budget admits at 16 bits vs compressed (capped by demand) against the decode
    step with dequantisation added (decode step = fixed part + per-sequence part, split by
    ``fixed_step_share``).
    """

    def __init__(self, config: KvDecompressionConfig | None = None, *,
                 name: str = "kv_decompression_cost") -> None:
        self.config = config or KvDecompressionConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def _next_width(self, bits: float) -> int:
        return next((w for w in self.config.bit_widths if w > bits), self.config.bit_widths[-1])

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        dequant = histogram_totals(window, DEQUANTIZE, [])
        bits_frame = window.query(KV_BITS)
        if dequant.empty or bits_frame.empty:
            return []
        tps, batch = _mean(window, TOKENS_PER_S), _mean(window, BATCH)
        held = _mean(window, KV_BYTES)
        tokens = tps * _span_s(window, TOKENS_PER_S)
        if not (tokens >= cfg.min_tokens and batch > 0 and held > 0):
            return []
        parts = (bits_frame.groupby(KV_PART_ATTR)["value"].mean()
                 if KV_PART_ATTR in bits_frame.columns
                 else pd.Series({"kv": float(bits_frame["value"].mean())}))
        mean_bits = float(parts.mean())
        if mean_bits >= UNCOMPRESSED_BITS:
            return []
        usage = _mean(window, KV_USAGE)
        budget = cfg.kv_budget_bytes or (held / usage if usage > 0 else math.nan)
        if not budget > 0:
            return []
        dequant_per_token_s = float(dequant["sum"].sum()) / tokens
        token_s = 1.0 / tps
        share = dequant_per_token_s / token_s
        if share < cfg.min_dequant_share:
            return []
        bytes_16 = held * UNCOMPRESSED_BITS / mean_bits
        queue = _peak(window, QUEUE)
        demand = min(cfg.max_batch_size,
                     int(round(_peak(window, BATCH) + (0 if math.isnan(queue) else queue))))
        plain_step_s = batch / tps - batch * dequant_per_token_s  # one token/sequence/step
        replaced_read_s = (0.0 if cfg.uncompressed_read_bytes_per_s is None
                           else bytes_16 / batch / cfg.uncompressed_read_bytes_per_s)
        verdict = kv_compression_tradeoff(
            kv_budget_bytes=budget, kv_bytes_per_token=bytes_16 / batch, context_tokens=1,
            compression_ratio=UNCOMPRESSED_BITS / mean_bits,
            step_base_s=cfg.fixed_step_share * plain_step_s,
            step_per_sequence_s=(1 - cfg.fixed_step_share) * plain_step_s / batch,
            decompress_s_per_sequence=dequant_per_token_s,
            replaced_read_s_per_sequence=replaced_read_s, max_batch=max(demand, 1),
            tpot_slo_s=cfg.tpot_slo_s, min_gain=cfg.min_gain)
        if verdict.worth_it:
            return []
        changes = tuple(
            SuggestedChange(knob=f"kv.{part}_bits", value=self._next_width(float(b)),
                            expected_effect=(f"less dequantisation ({share:.0%} of a token's "
                                             "decode time now); the memory it frees is unused"))
            for part, b in parts.items() if part in ("key", "value") and b < UNCOMPRESSED_BITS)
        return [Finding(
            detector=self.name, job=window.job, severity="warning", resource={},
            evidence=Evidence(
                summary=(f"KV at {mean_bits:g} bits frees {(bytes_16 - held) / 2**20:.3g} MiB "
                         f"but dequantising costs {dequant_per_token_s * 1e3:.3g} ms per token "
                         f"({share:.0%} of decode); {verdict.reason}"),
                model=("dequant s/token = increase(dequantize.duration.sum) / (mean tokens/s x "
                       "span); bytes at 16 bits = bytes held x 16 / mean bits; "
                       "kv_compression_tradeoff with batch capped by demand (peak batch + peak "
                       "queue, <= max_batch_size); decode step = fixed + per-sequence parts "
                       f"(fixed share {cfg.fixed_step_share:g}, assumed); uncompressed, "
                       "each sequence's step reads its cache: "
                       + ("in place, no added time" if cfg.uncompressed_read_bytes_per_s is None
                          else "a copy of its bytes at 16 bits at "
                          f"{cfg.uncompressed_read_bytes_per_s / 1e9:.3g} GB/s (configured)")),
                measurements=(
                    Measurement(name="dequant_per_token", value=dequant_per_token_s, unit="s"),
                    Measurement(name="dequant_share", value=share),
                    Measurement(name="replaced_read_per_token", value=replaced_read_s,
                                unit="s"),
                    Measurement(name="tokens_per_s", value=tps, unit="{token}/s"),
                    Measurement(name="mean_bits", value=mean_bits, unit="bit"),
                    Measurement(name="kv_bytes_held", value=held, unit="By"),
                    Measurement(name="kv_bytes_saved", value=bytes_16 - held, unit="By"),
                    Measurement(name="kv_budget", value=budget, unit="By"),
                    Measurement(name="mean_batch", value=batch, unit="{request}"),
                    Measurement(name="batch_demand", value=float(demand), unit="{request}"),
                    Measurement(name="batch_uncompressed", value=float(verdict.batch_before),
                                unit="{request}"),
                    Measurement(name="batch_compressed", value=float(verdict.batch_after),
                                unit="{request}"),
                    Measurement(name="throughput_gain", value=verdict.throughput_gain)),
                thresholds=(Threshold(measurement="dequant_share", comparison=">=",
                                      value=cfg.min_dequant_share),
                            Threshold(measurement="throughput_gain", comparison="<=",
                                      value=cfg.min_gain))),
            suggested_changes=changes,
        )]
