"""The seed's KV-cache compression cost (section 4.4): decompression time, and whether it pays.

Section numbers are the seed article's (its digest is kept outside this repository); where the
seed's printed number does not follow from its own formula, the formula wins and the
docstring says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ARTICLE_PCIE5_X16_MEASURED_BYTES_PER_S = 28.3e9
"""PCIe 5.0 x16 throughput the seed measured (section 4.4 table), bytes per second."""
ARTICLE_HBM2E_ROW_ACCESS_S = 12.8e-9
"""HBM2e single-bank row access the seed uses (section 4.4 table), seconds."""
ARTICLE_FP16_TO_INT4_RATIO = 4.0
"""FP16 -> INT4 compression ratio (section 4.4 table)."""
HBM_ROW_BYTES = 1024
"""HBM2/HBM2e page (row) size in pseudo-channel mode, bytes (JEDEC JESD235: 1 KB)."""


def hbm_row_accesses(n_bytes: float, *, row_bytes: int = HBM_ROW_BYTES) -> int:
    """Row activations needed to stream ``n_bytes`` contiguous bytes from HBM: ceil(n / row)."""
    if n_bytes < 0 or row_bytes <= 0:
        raise ValueError(f"n_bytes must be >= 0 and row_bytes > 0, got {n_bytes}, {row_bytes}")
    return math.ceil(n_bytes / row_bytes)


def kv_decompression_cost_s(
    compressed_bytes: float,
    *,
    pcie_bytes_per_s: float | None = None,
    n_hbm_accesses: int | None = None,
    hbm_access_s: float = ARTICLE_HBM2E_ROW_ACCESS_S,
    dequantize_bytes_per_s: float | None = None,
) -> float:
    """Seconds to decompress ``compressed_bytes`` of KV cache (seed section 4.4).

    GPU path: T = C / B_PCIe + N_access x T_HBM, with B_PCIe in bytes/s (measured, e.g. from
    NVML PCIe throughput; the seed's reference is 28.3 GB/s) and N_access HBM row accesses
    (default: the rows C spans, :func:`hbm_row_accesses`) of ``hbm_access_s`` each.
    CPU path: pass ``dequantize_bytes_per_s`` instead, a measured unpack throughput in
    compressed bytes per second (:func:`measure_dequantize_throughput`); T = C / throughput.
    """
    if compressed_bytes < 0:
        raise ValueError(f"compressed_bytes must be >= 0, got {compressed_bytes}")
    if dequantize_bytes_per_s is not None:
        if pcie_bytes_per_s is not None or n_hbm_accesses is not None:
            raise ValueError("give either dequantize_bytes_per_s or the PCIe/HBM terms, not both")
        if dequantize_bytes_per_s <= 0:
            raise ValueError(f"dequantize_bytes_per_s must be > 0, got {dequantize_bytes_per_s}")
        return compressed_bytes / dequantize_bytes_per_s
    if pcie_bytes_per_s is None or pcie_bytes_per_s <= 0:
        raise ValueError(f"pcie_bytes_per_s must be > 0, got {pcie_bytes_per_s}")
    accesses = hbm_row_accesses(compressed_bytes) if n_hbm_accesses is None else n_hbm_accesses
    return compressed_bytes / pcie_bytes_per_s + accesses * hbm_access_s


def kv_read_added_s(
    read_s: float,
    stored_bytes: float,
    *,
    replaced_read_s: float,
    replaced_stored_bytes: float,
    memory_read_bytes_per_s: float | None = None,
    refetch_factor: float = 1.0,
) -> float:
    """Decode-step time a cache layout adds against the one it replaces (negative: saves).

    The read itself: ``read_s`` (dequantising ``stored_bytes`` into the attention's operands)
    minus ``replaced_read_s``, what the replaced layout's read takes on the same engine (the
    copy of an uncompressed cache an engine makes each step; 0 for one that reads in place).
    Both are per step, timed inside decode steps (the codec timer): timed alone, a hot cache
    flatters the copy. That alone is the conservative estimate: it ignores what the read
    leaves in the processor's caches.

    With ``memory_read_bytes_per_s``, what the rest of the step refetches: each byte the read
    streams evicts some of the step's working set (weights, the operands just built), fetched
    again at that streaming rate, so the difference in stored bytes adds ``refetch_factor x
    (stored_bytes - replaced_stored_bytes) / memory_read_bytes_per_s``. A factor of 1 is the
    bound where every streamed byte evicts one; where the working set fits the last-level
    cache it is less, and how much depends on the processor and the model:
    :func:`kv_refetch_factor` fits it from a width already measured on the job.
    """
    for field_name, value in (("read_s", read_s), ("stored_bytes", stored_bytes),
                              ("replaced_read_s", replaced_read_s),
                              ("replaced_stored_bytes", replaced_stored_bytes),
                              ("refetch_factor", refetch_factor)):
        if value < 0:
            raise ValueError(f"{field_name} must be >= 0, got {value}")
    if memory_read_bytes_per_s is None:
        return read_s - replaced_read_s
    if not memory_read_bytes_per_s > 0:
        raise ValueError(f"memory_read_bytes_per_s must be > 0, got {memory_read_bytes_per_s}")
    return (read_s - replaced_read_s + refetch_factor
            * (stored_bytes - replaced_stored_bytes) / memory_read_bytes_per_s)


def kv_refetch_factor(
    measured_added_s: float,
    read_s: float,
    stored_bytes: float,
    *,
    replaced_read_s: float,
    replaced_stored_bytes: float,
    memory_read_bytes_per_s: float,
) -> float | None:
    """The ``refetch_factor`` of :func:`kv_read_added_s` that one measured layout implies.

    A trial that ran a width against the layout it replaced measures the step time it added;
    what the two reads do not explain is put down to refetching, in units of the stored-byte
    difference at the streaming rate, and the factor then predicts the widths not yet tried
    on the same job and processor. Not negative (a layout that streams fewer bytes does not
    make the rest of the step slower); None when the layouts store the same bytes, which
    says nothing about refetching.
    """
    streamed_s = (stored_bytes - replaced_stored_bytes) / memory_read_bytes_per_s
    if streamed_s == 0:
        return None
    return max(0.0, (measured_added_s - (read_s - replaced_read_s)) / streamed_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class KvCompressionVerdict:
    """Whether compressing the KV cache pays: what fits before and after, and the decode cost.

    Batches are whole sequences of ``context_tokens``; step times in seconds; throughput in
    generated tokens per second (one token per sequence per decode step).
    """

    batch_before: int
    batch_after: int
    max_context_tokens_before: int
    max_context_tokens_after: int
    step_s_before: float
    step_s_after: float
    tokens_per_s_before: float
    tokens_per_s_after: float
    throughput_gain: float
    worth_it: bool
    reason: str


def kv_compression_tradeoff(
    *,
    kv_budget_bytes: float,
    kv_bytes_per_token: float,
    context_tokens: int,
    compression_ratio: float,
    step_base_s: float,
    step_per_sequence_s: float,
    decompress_s_per_sequence: float,
    replaced_read_s_per_sequence: float = 0.0,
    max_batch: int | None = None,
    tpot_slo_s: float | None = None,
    min_gain: float = 0.0,
) -> KvCompressionVerdict:
    """Compare the decode time compression adds with the batch its freed memory admits.

    Model (decode is one step per generated token for every sequence in the batch):
    - memory: a sequence holds ``kv_bytes_per_token x context_tokens`` bytes of KV
      (``/ compression_ratio`` when compressed); the batch is as many sequences as fit in
      ``kv_budget_bytes``, capped at ``max_batch`` (the requests there are to serve);
    - time: a step takes ``step_base_s + batch x step_per_sequence_s``, reading the cache aside
      (fit it on measured steps, less their cache reads), plus the read of each sequence's
      cache: ``batch x decompress_s_per_sequence`` when compressed
      (:func:`kv_decompression_cost_s` for one sequence's compressed KV), ``batch x
      replaced_read_s_per_sequence`` when not. The second is what an engine pays to build the
      attention's operands from an uncompressed cache, and dequantising replaces it: engines
      that copy the cache each step (a concatenating cache such as transformers'
      ``DynamicCache``, or ``tuner.kv_cache``) pay it; an engine whose attention reads the
      cache where it lies (paged attention) does not, so 0 (the default) charges
      dequantisation as wholly added time;
    - worth it when throughput rises by more than ``min_gain`` (fraction) and the compressed
      step still meets ``tpot_slo_s`` (time per output token), if one is given.
    The longest context one sequence can hold is reported too (the "context that fits" value).
    """
    if replaced_read_s_per_sequence < 0:
        raise ValueError("replaced_read_s_per_sequence must be >= 0, got "
                         f"{replaced_read_s_per_sequence}")
    for field_name, value in (("kv_budget_bytes", kv_budget_bytes),
                              ("kv_bytes_per_token", kv_bytes_per_token),
                              ("context_tokens", context_tokens),
                              ("compression_ratio", compression_ratio)):
        if value <= 0:
            raise ValueError(f"{field_name} must be > 0, got {value}")
    if compression_ratio < 1:
        raise ValueError(f"compression_ratio must be >= 1, got {compression_ratio}")
    seq_bytes = kv_bytes_per_token * context_tokens
    cap = max_batch if max_batch is not None else math.inf
    batch_before = int(min(kv_budget_bytes // seq_bytes, cap))
    batch_after = int(min(kv_budget_bytes // (seq_bytes / compression_ratio), cap))
    step_before = step_base_s + batch_before * (step_per_sequence_s
                                                 + replaced_read_s_per_sequence)
    step_after = step_base_s + batch_after * (step_per_sequence_s + decompress_s_per_sequence)
    tps_before = batch_before / step_before
    tps_after = batch_after / step_after
    gain = tps_after / tps_before - 1 if tps_before > 0 else math.inf if tps_after > 0 else 0.0
    if batch_after == 0:
        worth_it, reason = False, "not one sequence fits even compressed"
    elif tpot_slo_s is not None and step_after > tpot_slo_s:
        worth_it = False
        reason = f"compressed step {step_after:.4g} s breaks the {tpot_slo_s:.4g} s TPOT SLO"
    elif gain <= min_gain:
        worth_it = False
        reason = (f"throughput gain {gain:+.1%} does not beat {min_gain:.1%}: decompression "
                  f"eats what the {batch_after - batch_before} extra sequences bring")
    else:
        worth_it = True
        reason = (f"{batch_after - batch_before} more sequences fit; throughput {gain:+.1%}"
                  if batch_after > batch_before else
                  f"no more sequences fit, but dequantising reads faster than the "
                  f"uncompressed copy it replaces; throughput {gain:+.1%}")
    return KvCompressionVerdict(
        batch_before=batch_before,
        batch_after=batch_after,
        max_context_tokens_before=int(kv_budget_bytes // kv_bytes_per_token),
        max_context_tokens_after=int(kv_budget_bytes // (kv_bytes_per_token / compression_ratio)),
        step_s_before=step_before,
        step_s_after=step_after,
        tokens_per_s_before=tps_before,
        tokens_per_s_after=tps_after,
        throughput_gain=gain,
        worth_it=worth_it,
        reason=reason,
    )
