"""How the quantised KV cache stores a group of numbers: widths, packing, the quantiser.

Codes are packed along ``head_dim`` in the bit layout of :func:`policies.pack_uint`, with
float16 scales and zeros; widths 16 and 32 store tokens unquantised. The quantiser is
asymmetric by default, symmetric (the seed's 4.1 scheme) on request, each with an error bound.
``tuner.kv_cache`` is the public face of these functions.

docs/internals.md, 'The KV codec' gives the packing, the quantisers and their error bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from collectors import SeedanceError

QUANTIZED_BITS: tuple[int, ...] = (2, 4, 6, 8)
UNQUANTIZED_DTYPES: dict[int, torch.dtype] = {16: torch.bfloat16, 32: torch.float32}
BITS: tuple[int, ...] = QUANTIZED_BITS + tuple(UNQUANTIZED_DTYPES)
"""Accepted widths: 2/4/6/8 quantised; 16 = bfloat16 and 32 = float32 unquantised."""
_SCALE_DTYPE = torch.float16
_SCALE_FLOOR = 2.0 ** -14  # float16's smallest normal


class KVCacheError(SeedanceError):
    """A KV cache was configured or used inconsistently."""


def check_bits(name: str, bits: int) -> None:
    """Refuse a width the cache cannot store (KVCacheError naming ``name``)."""
    if bits not in BITS:
        raise KVCacheError(f"{name} must be one of {list(BITS)}, got {bits!r}")


def _word(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte word: 2 -> (4, 1), 4 -> (2, 1), 6 -> (4, 3)."""
    codes = math.lcm(bits, 8) // bits
    return codes, codes * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``codes`` (< 2**bits) along the last dim into uint8, LSB first.

    The last dim must hold whole words (a multiple of 4 codes at 2 and 6 bits, 2 at 4 bits).
    Same bit layout as ``policies.pack_uint``; vectorised, no per-element loop.
    """
    if bits not in QUANTIZED_BITS:
        raise KVCacheError(f"bits must be one of {list(QUANTIZED_BITS)}, got {bits}")
    if bits == 8:  # contiguous like the other widths' words: the fused reader wants rows
        return codes.to(torch.uint8).contiguous()
    n_codes, n_bytes = _word(bits)
    if codes.shape[-1] % n_codes:
        raise KVCacheError(f"{codes.shape[-1]} codes do not fill whole {bits}-bit words "
                           f"of {n_codes} codes")
    lead = codes.shape[:-1]
    c = codes.reshape(*lead, -1, n_codes).to(torch.int32)
    shifts = torch.arange(n_codes, device=codes.device, dtype=torch.int32) * bits
    word = (c << shifts).sum(-1, dtype=torch.int32)  # fields do not overlap: sum == or
    byte_shifts = torch.arange(n_bytes, device=codes.device, dtype=torch.int32) * 8
    return ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*lead, -1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: uint8 codes, ``8 / bits`` as many along the last dim."""
    if bits not in QUANTIZED_BITS:
        raise KVCacheError(f"bits must be one of {list(QUANTIZED_BITS)}, got {bits}")
    if bits == 8:
        return packed
    n_codes, n_bytes = _word(bits)
    lead = packed.shape[:-1]
    b = packed.reshape(*lead, -1, n_bytes).to(torch.int32)
    byte_shifts = torch.arange(n_bytes, device=packed.device, dtype=torch.int32) * 8
    word = (b << byte_shifts).sum(-1, dtype=torch.int32)
    shifts = torch.arange(n_codes, device=packed.device, dtype=torch.int32) * bits
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(*lead, -1)


@dataclass(frozen=True, slots=True)
class QuantizedGroups:
    """Codes (uint8, unpacked, same shape as the input) and float16 per-group scale and zero.

    ``scale``/``zero`` keep the reduced dim with size 1 so they broadcast against ``codes``;
    ``zero`` is None for symmetric quantisation.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    symmetric: bool


def _round_fp16(x: torch.Tensor, *, up: bool) -> torch.Tensor:
    """``x`` (float32) rounded to float16 towards +inf (``up``) or -inf, as float16."""
    h = x.to(_SCALE_DTYPE)
    wrong = h.float() < x if up else h.float() > x
    toward = torch.full_like(h, math.inf if up else -math.inf)
    return torch.where(wrong, torch.nextafter(h, toward), h)


def quantize_groups(x: torch.Tensor, dim: int, bits: int, *, symmetric: bool = False,
                    clip_ratio: float = 1.0) -> QuantizedGroups:
    """Quantise ``x`` with one (scale, zero) per slice along ``dim`` (see the module docstring
    for the scheme and its error bound)."""
    if bits not in QUANTIZED_BITS:
        raise KVCacheError(f"bits must be one of {list(QUANTIZED_BITS)}, got {bits}")
    if not 0.0 < clip_ratio <= 1.0:
        raise KVCacheError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    x = x.float()
    if symmetric:
        q_max = (1 << (bits - 1)) - 1
        alpha = x.abs().amax(dim, keepdim=True) * clip_ratio
        scale = _round_fp16((alpha / q_max).clamp_min(_SCALE_FLOOR), up=True)
        q = torch.round(x / scale.float()).clamp_(-q_max, q_max) + (1 << (bits - 1))
        return QuantizedGroups(q.to(torch.uint8), scale, None, bits, True)
    levels = (1 << bits) - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    if clip_ratio < 1.0:
        mid, half = (lo + hi) / 2, (hi - lo) * (clip_ratio / 2)
        lo, hi = mid - half, mid + half
    zero = _round_fp16(lo, up=False)
    scale = _round_fp16(((hi - zero.float()) / levels).clamp_min(_SCALE_FLOOR), up=True)
    q = torch.round((x - zero.float()) / scale.float()).clamp_(0, levels)
    return QuantizedGroups(q.to(torch.uint8), scale, zero, bits, False)


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                      bits: int) -> torch.Tensor:
    """float32 reconstruction: ``zero + q s`` (asymmetric) or ``(q - 2**(bits-1)) s``."""
    q = codes.float()
    if zero is None:
        return (q - (1 << (bits - 1))) * scale.float()
    return torch.addcmul(zero.float(), q, scale.float())


def layout_bytes_per_token(*, n_layers: int, n_heads: int, head_dim: int, key_bits: int,
                           value_bits: int, group_size: int, symmetric: bool = False) -> float:
    """Bytes one quantised token costs in this layout (codes + amortised scales/zeros), all
    layers, keys and values; the expectation ``nbytes()`` is checked against."""
    check_bits("key_bits", key_bits)
    check_bits("value_bits", value_bits)
    per_group = (1 if symmetric else 2) * torch.finfo(_SCALE_DTYPE).bits / 8
    value_group = min(group_size, head_dim)

    def part(bits: int, groups_per_token: float) -> float:
        if bits in UNQUANTIZED_DTYPES:
            return head_dim * bits / 8
        return head_dim * bits / 8 + groups_per_token * per_group

    keys = part(key_bits, head_dim / group_size)
    values = part(value_bits, head_dim / value_group)
    return n_layers * n_heads * (keys + values)
