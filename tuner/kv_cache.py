"""A quantised KV cache (KIVI layout): packed 2/4/6/8-bit keys and values, or unquantised.

Imported by the serving job only (it needs torch), never by the sidecar.

Layout (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache"):

- keys are quantised **per channel**: each channel of each head gets one (scale, zero) per group
  of ``group_size`` consecutive tokens (key outliers sit in fixed channels);
- values are quantised **per token**: each token of each head gets one (scale, zero) per group
  of ``group_size`` consecutive channels (``min(group_size, head_dim)``, dividing ``head_dim``);
- the newest tokens stay in full precision (the *residual*): tokens are quantised a whole key
  group at a time once more than ``residual_tokens + group_size - 1`` are unquantised, so between
  ``residual_tokens`` and ``residual_tokens + group_size - 1`` recent tokens are exact;
- codes are packed along ``head_dim``, least significant bits first, in the bit layout of
  :func:`policies._cost_models.pack_uint` (2-bit: 4 codes a byte; 4-bit: 2; 6-bit: 4 codes in 3
  bytes; 8-bit: 1); scales and zeros are float16. ``bits`` 16 and 32 store the tokens unquantised
  as bfloat16 / float32.

Quantiser and its error bound (``R = max - min`` of a group, ``A = max |x|``, ``c`` = the
``clip_ratio``, ``L = 2**bits - 1``):

- asymmetric (default): the range ``[mid - cR/2, mid + cR/2]`` (``mid`` the group's centre) is
  cut into ``L`` steps: ``lo`` is rounded *down* to float16, ``s = (hi - lo)/L`` is rounded
  *up* to float16, ``q = clamp(round((x - lo)/s), 0, L)``, ``x_rec = lo + q s``. The directed
  roundings keep ``[min, max]`` inside the representable range when ``c = 1``, so
  ``|x - x_rec| <= max(s/2, (1 - c) R/2)`` with ``s <= (cR + u)/L * (1 + 2**-10)``, ``u`` the
  float16 spacing at ``lo`` (``<= 2**-10 |lo|``) — i.e. ``R/(2L)`` up to float16 rounding when
  nothing is clipped, and the clipped tail adds at most ``(1 - c) R/2``.
- symmetric (``symmetric=True``, the seed's 4.1 scheme): ``alpha = c A``,
  ``s = alpha/(2**(bits-1) - 1)`` (rounded up to float16), ``q = clamp(round(x/s), -Q, Q)``
  with ``Q = 2**(bits-1) - 1``, stored offset-binary (``q + 2**(bits-1)``) so
  :func:`policies._cost_models.dequantize` reads it; ``|x - x_rec| <= max(s/2, (1 - c) A)``
  = ``max(cA/(2**bits - 2), (1 - c)A)`` up to float16 rounding. The seed's
  ``||e||_inf <= alpha/(2**bits - 1)`` understates the rounding term by ``(2**b - 1)/(2**b - 2)``
  (1.5x at 2 bits, where the symmetric grid has only 3 levels) and leaves clipping out.
Every bound holds for the float32 reconstruction; ``keys_values`` casts it to ``dtype``, which
adds half an ulp of that dtype. A group whose step would fall below float16's smallest normal
(``2**-14``, e.g. a constant group) uses that step.

Live bit-width changes (:meth:`QuantizedKVCache.set_bits`) apply to tokens quantised *from then
on*; tokens already quantised keep the width they were stored at. Re-quantising them could only
lower precision further (the full-precision originals are gone; a 4-bit code cannot become a
true 8-bit one), would cost a pass over the whole cache at the switch (a latency spike on the
step the tuner is measuring), and a rollback would not restore what was lost. Keeping old tokens
makes a switch free and exactly reversible for new tokens, and gives the seed's positional mix
(section 4.2: early context 6-bit, late context 4-bit). Tokens still in the residual window at
the switch are quantised at the new width.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from collectors import SeedanceError
from collectors.torch_serving import tensor_bytes

__all__ = [
    "BITS",
    "CodecTimer",
    "KVCacheError",
    "QuantizedGroups",
    "QuantizedKVCache",
    "dequantize_groups",
    "layout_bytes_per_token",
    "pack_codes",
    "quantize_groups",
    "unpack_codes",
]

QUANTIZED_BITS: tuple[int, ...] = (2, 4, 6, 8)
UNQUANTIZED_DTYPES: dict[int, torch.dtype] = {16: torch.bfloat16, 32: torch.float32}
BITS: tuple[int, ...] = QUANTIZED_BITS + tuple(UNQUANTIZED_DTYPES)
"""Accepted widths: 2/4/6/8 quantised; 16 = bfloat16 and 32 = float32 unquantised."""
_SCALE_DTYPE = torch.float16
_SCALE_FLOOR = 2.0 ** -14  # float16's smallest normal


class KVCacheError(SeedanceError):
    """A KV cache was configured or used inconsistently."""


def _check_bits(name: str, bits: int) -> None:
    if bits not in BITS:
        raise KVCacheError(f"{name} must be one of {list(BITS)}, got {bits!r}")


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def _word(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte word: 2 -> (4, 1), 4 -> (2, 1), 6 -> (4, 3)."""
    codes = math.lcm(bits, 8) // bits
    return codes, codes * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``codes`` (< 2**bits) along the last dim into uint8, LSB first.

    The last dim must hold whole words (a multiple of 4 codes at 2 and 6 bits, 2 at 4 bits).
    Same bit layout as ``policies._cost_models.pack_uint``; vectorised, no per-element loop.
    """
    if bits not in QUANTIZED_BITS:
        raise KVCacheError(f"bits must be one of {list(QUANTIZED_BITS)}, got {bits}")
    if bits == 8:
        return codes.to(torch.uint8)
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


# --------------------------------------------------------------------------------------------
# Group quantisation
# --------------------------------------------------------------------------------------------


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
    _check_bits("key_bits", key_bits)
    _check_bits("value_bits", value_bits)
    per_group = (1 if symmetric else 2) * torch.finfo(_SCALE_DTYPE).bits / 8
    value_group = min(group_size, head_dim)

    def part(bits: int, groups_per_token: float) -> float:
        if bits in UNQUANTIZED_DTYPES:
            return head_dim * bits / 8
        return head_dim * bits / 8 + groups_per_token * per_group

    keys = part(key_bits, head_dim / group_size)
    values = part(value_bits, head_dim / value_group)
    return n_layers * n_heads * (keys + values)


# --------------------------------------------------------------------------------------------
# Timing hooks
# --------------------------------------------------------------------------------------------


@runtime_checkable
class CodecTimer(Protocol):
    """Times KV (de)quantisation; ``collectors.torch_serving.ServingInstrumentation`` is one."""

    def quantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        """Times the block as quantisation; a CUDA ``device`` is synchronised around it."""
        ...

    def dequantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        """Times the block as dequantisation; a CUDA ``device`` is synchronised around it."""
        ...


TimeCallback = Callable[[str, float], None]
"""``callback(kind, seconds)`` with kind ``"quantize"`` or ``"dequantize"``."""


class _CallbackTimer:
    """Adapts a callback to :class:`CodecTimer` (CUDA is synchronised around the block)."""

    def __init__(self, callback: TimeCallback) -> None:
        self._callback = callback

    @contextlib.contextmanager
    def _timed(self, kind: str, device: torch.device | None) -> Iterator[None]:
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(device)
        self._callback(kind, time.perf_counter() - start)

    def quantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        return self._timed("quantize", device)

    def dequantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        return self._timed("dequantize", device)


class _NullTimer:
    def quantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def dequantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Part:
    """Keys or values of a run of tokens stored at one width.

    ``data``: packed uint8 codes [b, h, t, head_dim * bits / 8] or raw [b, h, t, head_dim];
    ``scale``/``zero``: float16, keys [b, h, t / group, 1, head_dim], values
    [b, h, t, head_dim / group, 1]; None when unquantised (``zero`` also when symmetric).
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.zero) if t is not None]

    def extend(self, other: _Part) -> _Part:
        """A new part holding this part's tokens then ``other``'s (same width)."""
        pairs = zip((self.data, self.scale, self.zero), (other.data, other.scale, other.zero),
                    strict=True)
        data, scale, zero = (None if a is None or b is None else torch.cat((a, b), dim=2)
                             for a, b in pairs)
        assert data is not None
        return _Part(data, scale, zero)


@dataclass(slots=True)
class _Segment:
    """A run of consecutive quantised tokens of one layer at one (key, value) width."""

    key_bits: int
    value_bits: int
    tokens: int
    keys: _Part
    values: _Part


@dataclass(slots=True)
class _Layer:
    key_bits: int
    value_bits: int
    segments: list[_Segment] = field(default_factory=list)
    residual_k: torch.Tensor | None = None
    residual_v: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        fp = 0 if self.residual_k is None else self.residual_k.shape[2]
        return sum(s.tokens for s in self.segments) + fp


AppendHook = Callable[[int, torch.Tensor, torch.Tensor], None]
"""``hook(layer, k, v)`` called with each appended chunk (before it is stored)."""


class QuantizedKVCache:
    """Keys and values of one batch of equal-length sequences, all layers, stored quantised.

    Use one cache per sequence (batch 1) when sequences have different lengths;
    ``tuner.kv_decode.decode_step`` takes a list of them. Not thread-safe: one decode loop owns
    a cache. Stored tensors are never modified in place, so :meth:`fork` can share them (a
    prefix cache hands out forks).

    Args:
        n_layers, n_heads, head_dim: the model's shape (``head_dim`` a multiple of 8, so every
            width packs into whole bytes).
        key_bits, value_bits: 2, 4, 6, 8 (quantised) or 16 / 32 (bfloat16 / float32 as is).
        group_size: tokens per key scale group; channels per value group (at most head_dim,
            must divide it).
        residual_tokens: recent tokens always kept in full precision (see the module docstring).
        device: where the cache lives.
        dtype: dtype of the residual window and of what :meth:`keys_values` returns.
        symmetric, clip_ratio: the quantiser (module docstring).
        timer: a :class:`CodecTimer` (e.g. ``ServingInstrumentation``) or a
            ``callback(kind, seconds)``; quantise and dequantise calls are timed with it.
    """

    def __init__(self, n_layers: int, n_heads: int, head_dim: int, *, key_bits: int = 4,
                 value_bits: int = 4, group_size: int = 32, residual_tokens: int = 32,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 symmetric: bool = False, clip_ratio: float = 1.0,
                 timer: CodecTimer | TimeCallback | None = None) -> None:
        for name, value in (("n_layers", n_layers), ("n_heads", n_heads),
                            ("head_dim", head_dim), ("group_size", group_size)):
            if value <= 0:
                raise KVCacheError(f"{name} must be > 0, got {value}")
        if head_dim % 8:
            raise KVCacheError(f"head_dim must be a multiple of 8, got {head_dim}")
        if residual_tokens < 0:
            raise KVCacheError(f"residual_tokens must be >= 0, got {residual_tokens}")
        if head_dim % min(group_size, head_dim):
            raise KVCacheError(f"group_size {group_size} must divide head_dim {head_dim} "
                               "(values are grouped over channels)")
        if not 0.0 < clip_ratio <= 1.0:
            raise KVCacheError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
        _check_bits("key_bits", key_bits)
        _check_bits("value_bits", value_bits)
        self.n_layers, self.n_heads, self.head_dim = n_layers, n_heads, head_dim
        self.group_size = group_size
        self.value_group_size = min(group_size, head_dim)
        self.residual_tokens = residual_tokens
        self.device = torch.device(device)
        self.dtype = dtype
        self.symmetric = symmetric
        self.clip_ratio = clip_ratio
        self.timer: CodecTimer = (
            _NullTimer() if timer is None
            else timer if isinstance(timer, CodecTimer) else _CallbackTimer(timer))
        self._layers = [_Layer(key_bits, value_bits) for _ in range(n_layers)]
        self._append_hooks: list[AppendHook] = []

    # -- configuration -----------------------------------------------------------------------

    def bits(self, layer: int) -> tuple[int, int]:
        """(key_bits, value_bits) new tokens of ``layer`` are stored at."""
        state = self._layers[self._check_layer(layer)]
        return state.key_bits, state.value_bits

    def set_bits(self, *, key_bits: int | None = None, value_bits: int | None = None,
                 layers: Iterable[int] | None = None) -> None:
        """Change the width of tokens quantised from now on, for ``layers`` (default all).

        Tokens already quantised keep their width (module docstring says why).
        """
        if key_bits is not None:
            _check_bits("key_bits", key_bits)
        if value_bits is not None:
            _check_bits("value_bits", value_bits)
        chosen = range(self.n_layers) if layers is None else [self._check_layer(i)
                                                              for i in layers]
        for i in chosen:
            if key_bits is not None:
                self._layers[i].key_bits = key_bits
            if value_bits is not None:
                self._layers[i].value_bits = value_bits

    def add_append_hook(self, hook: AppendHook) -> None:
        """Call ``hook(layer, k, v)`` with every appended chunk (the adaptive quantiser's feed)."""
        self._append_hooks.append(hook)

    # -- state -------------------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        """Tokens held per sequence (of the last layer, so complete once a step has run)."""
        return self._layers[-1].tokens

    def layer_len(self, layer: int) -> int:
        """Tokens held per sequence in ``layer``."""
        return self._layers[self._check_layer(layer)].tokens

    @property
    def batch(self) -> int:
        """Sequences in the cache (0 before the first append)."""
        for state in self._layers:
            if state.residual_k is not None:
                return int(state.residual_k.shape[0])
            if state.segments:
                return int(state.segments[0].keys.data.shape[0])
        return 0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds: packed codes, scales, zeros, residual windows."""
        out: list[torch.Tensor] = []
        for state in self._layers:
            for seg in state.segments:
                out += seg.keys.tensors() + seg.values.tensors()
            out += [t for t in (state.residual_k, state.residual_v) if t is not None]
        return out

    def nbytes(self) -> int:
        """Bytes held, measured from the tensors themselves (:meth:`tensors`)."""
        return tensor_bytes(self.tensors())

    def tokens_by_bits(self) -> dict[str, int]:
        """Tokens per sequence and layer by storage, summed over layers: ``"k4v4"``,
        ``"residual"``; how the positional mix of widths looks (seed 4.2)."""
        out: dict[str, int] = {}
        for state in self._layers:
            for seg in state.segments:
                key = f"k{seg.key_bits}v{seg.value_bits}"
                out[key] = out.get(key, 0) + seg.tokens
            if state.residual_k is not None and state.residual_k.shape[2]:
                out["residual"] = out.get("residual", 0) + int(state.residual_k.shape[2])
        return out

    def fork(self) -> QuantizedKVCache:
        """An independent cache with the same contents; stored tensors are shared, not copied
        (they are immutable), so the fork costs no memory until one side grows."""
        other = QuantizedKVCache.__new__(QuantizedKVCache)
        for name in ("n_layers", "n_heads", "head_dim", "group_size", "value_group_size",
                     "residual_tokens", "device", "dtype", "symmetric", "clip_ratio", "timer"):
            setattr(other, name, getattr(self, name))
        other._layers = [_Layer(s.key_bits, s.value_bits, list(s.segments), s.residual_k,
                                s.residual_v) for s in self._layers]
        other._append_hooks = []
        return other

    # -- writing and reading -----------------------------------------------------------------

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens ``k``, ``v`` of shape [batch, heads, new_tokens, head_dim]."""
        state = self._layers[self._check_layer(layer)]
        if k.shape != v.shape or k.dim() != 4 or k.shape[1] != self.n_heads \
                or k.shape[3] != self.head_dim:
            raise KVCacheError(f"k and v must both be [batch, {self.n_heads}, tokens, "
                               f"{self.head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}")
        batch = self.batch
        if batch and k.shape[0] != batch:
            raise KVCacheError(f"cache holds batch {batch}, got k with batch {k.shape[0]}")
        for hook in self._append_hooks:
            hook(layer, k, v)
        k, v = (t.to(device=self.device, dtype=self.dtype) for t in (k, v))
        if state.residual_k is not None:
            k = torch.cat((state.residual_k, k), dim=2)
            v = torch.cat((state.residual_v, v), dim=2)  # type: ignore[arg-type]
        unquantised = k.shape[2]
        flush = 0
        if unquantised >= self.residual_tokens + self.group_size:
            flush = (unquantised - self.residual_tokens) // self.group_size * self.group_size
        if flush:
            with self.timer.quantize(self.device):
                self._store(state, k[:, :, :flush], v[:, :, :flush])
        state.residual_k = k[:, :, flush:].clone() if flush else k
        state.residual_v = v[:, :, flush:].clone() if flush else v

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values of ``layer``, dequantised: [batch, heads, seq_len, head_dim]."""
        state = self._layers[self._check_layer(layer)]
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        if state.segments:
            with self.timer.dequantize(self.device):
                for seg in state.segments:
                    ks.append(self._load_keys(seg))
                    vs.append(self._load_values(seg))
        if state.residual_k is not None:
            ks.append(state.residual_k)
            vs.append(state.residual_v)  # type: ignore[arg-type]
        if not ks:
            empty = torch.empty(0, self.n_heads, 0, self.head_dim, device=self.device,
                                dtype=self.dtype)
            return empty, empty
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    # -- internals ---------------------------------------------------------------------------

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.n_layers:
            raise KVCacheError(f"layer must be in [0, {self.n_layers}), got {layer}")
        return layer

    def _store(self, state: _Layer, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, t, d = k.shape
        keys = self._encode(k.reshape(b, h, t // self.group_size, self.group_size, d), 3,
                            state.key_bits)
        values = self._encode(v.reshape(b, h, t, d // self.value_group_size,
                                        self.value_group_size), 4, state.value_bits)
        last = state.segments[-1] if state.segments else None
        if last is not None and (last.key_bits, last.value_bits) == (state.key_bits,
                                                                      state.value_bits):
            state.segments[-1] = _Segment(last.key_bits, last.value_bits, last.tokens + t,
                                          last.keys.extend(keys), last.values.extend(values))
        else:
            state.segments.append(_Segment(state.key_bits, state.value_bits, t, keys, values))

    def _encode(self, x: torch.Tensor, dim: int, bits: int) -> _Part:
        """Quantise and pack a 5-d grouped view; codes are packed along head_dim."""
        b, h = x.shape[:2]
        if bits in UNQUANTIZED_DTYPES:
            return _Part(x.reshape(b, h, -1, self.head_dim).to(UNQUANTIZED_DTYPES[bits]))
        q = quantize_groups(x, dim, bits, symmetric=self.symmetric, clip_ratio=self.clip_ratio)
        packed = pack_codes(q.codes.reshape(b, h, -1, self.head_dim), bits)
        return _Part(packed, q.scale, q.zero)

    def _decode(self, part: _Part, bits: int, grouped: tuple[int, ...]) -> torch.Tensor:
        if bits in UNQUANTIZED_DTYPES:
            return part.data.to(self.dtype)
        assert part.scale is not None
        b, h, t = part.data.shape[:3]
        codes = unpack_codes(part.data, bits).reshape(b, h, *grouped)
        x = dequantize_groups(codes, part.scale, part.zero, bits)
        return x.reshape(b, h, t, self.head_dim).to(self.dtype)

    def _load_keys(self, seg: _Segment) -> torch.Tensor:
        g = self.group_size
        return self._decode(seg.keys, seg.key_bits, (seg.tokens // g, g, self.head_dim))

    def _load_values(self, seg: _Segment) -> torch.Tensor:
        g = self.value_group_size
        return self._decode(seg.values, seg.value_bits, (seg.tokens, self.head_dim // g, g))
