"""Packed low-bit codes (seed 4.1): numpy packing, symmetric dequantisation, its measured speed.

The CPU stand-in for the seed's GPU unpack figures, and the reference layout the serving job's
quantised KV cache packs to.

Section numbers are the seed article's (its digest is kept outside this repository); where the
seed's printed number does not follow from its own formula, the formula wins and the
docstring says so.
"""

from __future__ import annotations

import math
import time

import numpy as np


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
