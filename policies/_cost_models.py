"""The seed's cost models as plain functions, with units, sources and the seed's errors fixed.

Section numbers are the seed article's (its digest is kept outside this repository). Where the seed's
printed number does not follow from its own formula, the formula wins and the docstring says so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

# --------------------------------------------------------------------------------------------
# 2.1 Bandwidth saturation
# --------------------------------------------------------------------------------------------

ARTICLE_COUPLING_K = 0.8
"""The seed's "hardware coupling" coefficient k of the saturation model (section 2.1)."""


def bandwidth_saturation(demand: float, available: float, *, k: float = ARTICLE_COUPLING_K) -> float:
    """Effective compute fraction f(x) = 1 - exp(-k x / B) (seed section 2.1).

    ``demand`` (x) and ``available`` (B) in the same unit (GB/s in the seed); the result is a
    fraction in [0, 1). The seed prints 52.7% for x = 1500, B = 2048, k = 0.8; the formula gives
    44.3% (1 - exp(-0.586)); 52.7% would need k = 1.02.
    """
    if available <= 0:
        raise ValueError(f"available must be > 0, got {available}")
    if demand < 0:
        raise ValueError(f"demand must be >= 0, got {demand}")
    return 1.0 - math.exp(-k * demand / available)


def saturation_marginal_cost_ratio(
    pressure_from: float, pressure_to: float, *, k: float = ARTICLE_COUPLING_K
) -> float:
    """How many times more bandwidth pressure one unit of effective compute costs at
    ``pressure_to`` than at ``pressure_from`` (pressures are x/B, dimensionless).

    The cost is the inverse slope dx/df = exp(k x/B) / k, so the ratio is
    exp(k (to - from)). The seed says "past x/B ~ 0.7 each further 5% of pressure costs 2.3x
    more"; the formula says one 5% step multiplies the cost by exp(0.05 k) = 1.041 at k = 0.8,
    at any pressure (the curve has no knee), and the cost reaches 2.3x its zero-pressure value
    only at x/B = ln(2.3) / k = 1.04. A 2.3x jump per 5% step would need k = 16.7.
    """
    return math.exp(k * (pressure_to - pressure_from))


def pressure_for_marginal_cost_ratio(ratio: float, *, k: float = ARTICLE_COUPLING_K) -> float:
    """The pressure x/B at which compute costs ``ratio`` times its zero-pressure cost: ln(r)/k."""
    if ratio <= 0 or k <= 0:
        raise ValueError(f"ratio and k must be > 0, got {ratio}, {k}")
    return math.log(ratio) / k


# --------------------------------------------------------------------------------------------
# 4.4 KV-cache decompression cost
# --------------------------------------------------------------------------------------------

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


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def unpack_uint(packed: np.ndarray, bits: int) -> np.ndarray:
    """Unpack ``bits``-wide unsigned fields from a uint8 buffer, least significant bits first.

    Every ``bits`` bytes hold exactly 8 fields, so each group is widened to one uint64 word and
    the 8 fields are cut out with full-length shift-and-mask passes (no per-element loop, no
    bit-by-bit ``np.unpackbits``). Trailing bits that do not fill a field are dropped.
    """
    _check_bits(bits)
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
    n_fields = packed.size * 8 // bits
    groups = -(-packed.size // bits)
    padded = np.zeros(groups * bits, dtype=np.uint8)
    padded[: packed.size] = packed
    columns = padded.reshape(groups, bits)
    word = np.zeros(groups, dtype=np.uint64)
    for j in range(bits):
        word |= columns[:, j].astype(np.uint64) << np.uint64(8 * j)
    out = np.empty((groups, 8), dtype=np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for i in range(8):
        out[:, i] = (word >> np.uint64(i * bits)) & mask
    return out.reshape(-1)[:n_fields]


def pack_uint(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``values`` < 2**bits into a uint8 buffer; the inverse of :func:`unpack_uint`."""
    _check_bits(bits)
    values = np.asarray(values)
    if values.size and (values.min() < 0 or values.max() >= 1 << bits):
        raise ValueError(f"values must be in [0, {1 << bits}), got [{values.min()}, {values.max()}]")
    fields = np.unpackbits(values.astype(np.uint8)[:, None], axis=1, bitorder="little")[:, :bits]
    return np.packbits(fields.reshape(-1), bitorder="little")


def dequantize(packed: np.ndarray, bits: int, scale: float) -> np.ndarray:
    """Symmetric dequantisation (seed 4.1): x = (q - 2**(bits-1)) * scale, as float32.

    Codes are stored offset-binary so they are unsigned; scale = alpha / (2**(bits-1) - 1).
    """
    q = unpack_uint(packed, bits).astype(np.float32)
    q -= 1 << (bits - 1)
    q *= scale
    return q


def measure_dequantize_throughput(
    bits: int, n_bytes: int = 1 << 22, repeats: int = 5, *, seed: int = 0
) -> float:
    """Measured CPU dequantisation throughput, in compressed bytes per second (min of N).

    Really unpacks ``n_bytes`` of random packed codes with numpy and rescales them to float32,
    ``repeats`` times, and divides by the fastest run: the CPU stand-in for the seed's GPU
    unpack figures (section 4.3: 4-bit LUT 28.6 GB/s, 2-bit unaligned 9.1 GB/s).
    """
    if n_bytes <= 0 or repeats <= 0:
        raise ValueError(f"n_bytes and repeats must be > 0, got {n_bytes}, {repeats}")
    packed = np.random.default_rng(seed).integers(0, 256, size=n_bytes, dtype=np.uint8)
    best_ns = math.inf
    for _ in range(repeats):
        start = time.perf_counter_ns()
        dequantize(packed, bits, 0.01)
        best_ns = min(best_ns, time.perf_counter_ns() - start)
    return n_bytes / (max(best_ns, 1) * 1e-9)


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
    max_batch: int | None = None,
    tpot_slo_s: float | None = None,
    min_gain: float = 0.0,
) -> KvCompressionVerdict:
    """Compare the decode time compression adds with the batch its freed memory admits.

    Model (decode is one step per generated token for every sequence in the batch):
    - memory: a sequence holds ``kv_bytes_per_token x context_tokens`` bytes of KV
      (``/ compression_ratio`` when compressed); the batch is as many sequences as fit in
      ``kv_budget_bytes``, capped at ``max_batch`` (the requests there are to serve);
    - time: a step takes ``step_base_s + batch x step_per_sequence_s`` (fit it on measured
      steps), plus ``batch x decompress_s_per_sequence`` when compressed
      (:func:`kv_decompression_cost_s` for one sequence's compressed KV);
    - worth it when throughput rises by more than ``min_gain`` (fraction) and the compressed
      step still meets ``tpot_slo_s`` (time per output token), if one is given.
    The longest context one sequence can hold is reported too (the "context that fits" value).
    """
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
    step_before = step_base_s + batch_before * step_per_sequence_s
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
        reason = f"{batch_after - batch_before} more sequences fit; throughput {gain:+.1%}"
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


# --------------------------------------------------------------------------------------------
# Truth 3: communication volume
# --------------------------------------------------------------------------------------------


def ring_allreduce_bytes_per_rank(size_bytes: float, n_ranks: int) -> float:
    """Bytes each rank sends in one ring all-reduce of ``size_bytes``: 2(n-1)/n x S.

    (Reduce-scatter then all-gather, n-1 steps each of S/n bytes; Patarasuk & Yuan 2009,
    and nccl-tests' busbw = algbw x 2(n-1)/n.)
    """
    if n_ranks < 1 or size_bytes < 0:
        raise ValueError(f"n_ranks must be >= 1 and size_bytes >= 0, got {n_ranks}, {size_bytes}")
    return 2 * (n_ranks - 1) / n_ranks * size_bytes


def allreduce_calls(size_bytes: float, bucket_bytes: float) -> int:
    """Collective calls to all-reduce ``size_bytes`` in buckets of ``bucket_bytes``: ceil(S/b)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    return math.ceil(size_bytes / bucket_bytes)


def allreduce_time_s(
    size_bytes: float, n_ranks: int, *, bucket_bytes: float, alpha_s: float,
    beta_s_per_byte: float,
) -> float:
    """Alpha-beta time of a bucketed ring all-reduce: calls x alpha + bytes per rank x beta.

    ``alpha_s`` is the fixed cost of one call (launch plus the ring's 2(n-1) hop latencies),
    ``beta_s_per_byte`` the inverse link bandwidth. Smaller buckets add calls, not bytes.
    """
    return (allreduce_calls(size_bytes, bucket_bytes) * alpha_s
            + ring_allreduce_bytes_per_rank(size_bytes, n_ranks) * beta_s_per_byte)


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitCommunication:
    """Communication of one training step of a model cut into pipeline segments.

    Bytes are summed over every rank that sends them, per step.
    """

    segments: int
    allreduce_calls: int
    allreduce_bytes: float
    boundary_bytes: float

    @property
    def total_bytes(self) -> float:
        """All bytes sent in one step: gradient all-reduce plus segment-boundary traffic."""
        return self.allreduce_bytes + self.boundary_bytes


def microbatches_for_bubble(segments: int, bubble_fraction: float) -> int:
    """Micro-batches that keep a GPipe/1F1B pipeline's idle fraction at ``bubble_fraction``.

    Bubble = (p - 1) / (m + p - 1) (Huang et al. 2019, GPipe; Narayanan et al. 2021), so
    m = ceil((p - 1)(1 - b) / b), at least 1.
    """
    if not 0 < bubble_fraction < 1:
        raise ValueError(f"bubble_fraction must be in (0, 1), got {bubble_fraction}")
    return max(1, math.ceil((segments - 1) * (1 - bubble_fraction) / bubble_fraction))


def split_communication(
    *, segments: int, params_bytes: float, dp_ranks: int, activation_bytes: float,
    microbatches: int, bucket_bytes: float,
) -> SplitCommunication:
    """Per-step communication of a model cut into ``segments`` pipeline stages (truth 3).

    - gradients: each segment all-reduces its own params_bytes / segments over ``dp_ranks``
      replicas in buckets of ``bucket_bytes``; summed over ranks that is 2(dp-1) x params_bytes,
      the same for every split; the call count grows with the segments;
    - boundaries: each of the segments - 1 cuts sends one micro-batch's ``activation_bytes``
      forward and its gradient back, per micro-batch, in each of the dp_ranks pipelines.
    Truth 3 (16 vs 8 segments -> 3.7x all-reduce traffic) does not follow from this model:
    gradient bytes stay 1.0x, calls double, boundary bytes grow (16-1)/(8-1) = 2.14x at a fixed
    micro-batch count and (15/7)^2 = 4.59x when the micro-batches grow to hold the bubble
    fraction (:func:`microbatches_for_bubble`). 3.7x lies between those two, so it could be a
    job whose traffic is mostly boundary activations with micro-batches scaled with depth; the
    seed gives no sizes to tell.
    """
    if segments < 1 or dp_ranks < 1 or microbatches < 1:
        raise ValueError(f"segments, dp_ranks and microbatches must be >= 1, got "
                         f"{segments}, {dp_ranks}, {microbatches}")
    segment_bytes = params_bytes / segments
    return SplitCommunication(
        segments=segments,
        allreduce_calls=segments * allreduce_calls(segment_bytes, bucket_bytes),
        allreduce_bytes=segments * dp_ranks * ring_allreduce_bytes_per_rank(segment_bytes,
                                                                             dp_ranks),
        boundary_bytes=2.0 * (segments - 1) * microbatches * activation_bytes * dp_ranks,
    )


# --------------------------------------------------------------------------------------------
# 2.5 ROI of repairing utilisation vs scaling out
# --------------------------------------------------------------------------------------------

ARTICLE_GAMMA = 0.78
"""The seed's cross-elasticity gamma, "fitted on 23 clusters" (section 2.5)."""


def _check_gamma(gamma: float) -> None:
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")


def equivalent_scale_out_nodes(
    n_nodes: float, utilisation_gain: float, *, gamma: float = ARTICLE_GAMMA
) -> float:
    """Nodes one would have to add to match a utilisation repair (seed 2.5 "等效扩容节省").

    Model: delivered throughput T = u x n^gamma (u mean utilisation, fraction; n nodes; gamma
    the elasticity of throughput to node count, < 1 because scale-out adds communication,
    truth 1). Raising u by the relative ``utilisation_gain`` g (0.18 = +18%) delivers what
    n' = n (1 + g)^(1/gamma) nodes deliver at the old u, so it saves n' - n nodes.
    With gamma = 0.78 one cluster of n = 7.2 nodes reproduces both seed examples (+18% -> 1.7,
    +32% -> 3.1); the seed does not state n.
    """
    _check_gamma(gamma)
    if n_nodes < 0 or utilisation_gain <= -1:
        raise ValueError(f"n_nodes must be >= 0 and utilisation_gain > -1, got "
                         f"{n_nodes}, {utilisation_gain}")
    return n_nodes * ((1 + utilisation_gain) ** (1 / gamma) - 1)


def payback_months(fix_cost: float, nodes_saved: float, node_cost_per_month: float) -> float:
    """Months until a fix costing ``fix_cost`` pays for itself (inf when it saves nothing).

    ``fix_cost`` and ``node_cost_per_month`` in the same currency; savings accrue from month 0.
    The seed's months (4.2 for 1.7 nodes, 2.8 for 3.1 nodes) imply fix costs of 7.1 and 8.7
    node-months; it states neither, so they cannot be reproduced independently.
    """
    if fix_cost < 0 or node_cost_per_month <= 0:
        raise ValueError(f"fix_cost must be >= 0 and node_cost_per_month > 0, got "
                         f"{fix_cost}, {node_cost_per_month}")
    savings = nodes_saved * node_cost_per_month
    return fix_cost / savings if savings > 0 else math.inf


def roi_delta(
    utilisation: float, scale_out: float, *, n_nodes: float, target_utilisation: float,
    node_cost_per_month: float, fix_cost: float, horizon_months: float,
    gamma: float = ARTICLE_GAMMA,
) -> float:
    """ROI of repairing utilisation instead of running a planned scale-out, over a horizon.

    The plan is ``n_nodes x scale_out`` nodes at mean ``utilisation`` (fraction). Repairing
    utilisation to ``target_utilisation`` (ratio r = target / utilisation, at least 1) delivers
    the plan's throughput (T = u n^gamma, :func:`equivalent_scale_out_nodes`) with
    n s r^(-1/gamma) nodes, saving n s (1 - r^(-1/gamma)) nodes a month at
    ``node_cost_per_month`` each. ROI = (savings x ``horizon_months`` - ``fix_cost``) /
    ``fix_cost`` (fraction; -1 = the fix is wasted). It rises with the scale-out avoided and
    falls as the current utilisation nears the target.
    """
    _check_gamma(gamma)
    if not 0 < utilisation <= 1 or not 0 < target_utilisation <= 1:
        raise ValueError(f"utilisation and target_utilisation must be in (0, 1], got "
                         f"{utilisation}, {target_utilisation}")
    if scale_out < 1 or fix_cost <= 0 or horizon_months <= 0:
        raise ValueError(f"scale_out must be >= 1, fix_cost and horizon_months > 0, got "
                         f"{scale_out}, {fix_cost}, {horizon_months}")
    if n_nodes <= 0 or node_cost_per_month <= 0:
        raise ValueError(f"n_nodes and node_cost_per_month must be > 0, got "
                         f"{n_nodes}, {node_cost_per_month}")
    repair = max(target_utilisation / utilisation, 1.0)
    nodes_saved = n_nodes * scale_out * (1 - repair ** (-1 / gamma))
    return (nodes_saved * node_cost_per_month * horizon_months - fix_cost) / fix_cost


ARTICLE_UTILISATION_GRID: tuple[float, ...] = tuple(np.linspace(0.4, 0.9, 6).tolist())
ARTICLE_SCALE_OUT_GRID: tuple[float, ...] = tuple(np.linspace(1.0, 2.5, 5).tolist())


def roi_matrix(
    *, utilisation_grid: tuple[float, ...] = ARTICLE_UTILISATION_GRID,
    scale_out_grid: tuple[float, ...] = ARTICLE_SCALE_OUT_GRID, **roi_params: float,
) -> pd.DataFrame:
    """The seed's ROI table (2.5): :func:`roi_delta` over scale-out (rows) x utilisation (cols).

    Defaults are the seed's grids (6 utilisations 0.4..0.9, 5 scale-outs 1.0..2.5);
    ``roi_params`` are :func:`roi_delta`'s keyword parameters.
    """
    values = [[roi_delta(u, s, **roi_params) for u in utilisation_grid] for s in scale_out_grid]
    return pd.DataFrame(
        values,
        index=pd.Index(scale_out_grid, name="scale_out"),
        columns=pd.Index(utilisation_grid, name="utilisation"),
    )
