"""A quantised KV cache (KIVI layout): packed 2/4/6/8-bit keys and values, or unquantised.

Imported by the serving job only (it needs torch), never by the sidecar. The public face of the
cache's codec (``tuner._kv_codec``) and its timing hooks (``tuner._kv_timer``) too. Keys are
quantised per channel, values per token, and the newest tokens stay exact; a live bit-width
change (:meth:`QuantizedKVCache.set_bits`) applies only to tokens quantised from then on.

docs/internals.md, 'The quantised KV cache' explains the layout and why old tokens keep their width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from collectors.torch_serving import tensor_bytes
from tuner._kv_codec import (
    BITS,
    QUANTIZED_BITS,
    UNQUANTIZED_DTYPES,
    KVCacheError,
    QuantizedGroups,
    check_bits,
    dequantize_groups,
    layout_bytes_per_token,
    pack_codes,
    quantize_groups,
    unpack_codes,
)
from tuner._kv_native import dequantize_into
from tuner._kv_timer import CodecTimer, TimeCallback, codec_timer

__all__ = [
    "BITS",
    "CodecTimer",
    "KVCacheError",
    "QUANTIZED_BITS",
    "QuantizedGroups",
    "QuantizedKVCache",
    "dequantize_groups",
    "layout_bytes_per_token",
    "pack_codes",
    "quantize_groups",
    "unpack_codes",
]


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
        symmetric, clip_ratio: the quantiser (:func:`quantize_groups`).
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
        check_bits("key_bits", key_bits)
        check_bits("value_bits", value_bits)
        self.n_layers, self.n_heads, self.head_dim = n_layers, n_heads, head_dim
        self.group_size = group_size
        self.value_group_size = min(group_size, head_dim)
        self.residual_tokens = residual_tokens
        self.device = torch.device(device)
        self.dtype = dtype
        self.symmetric = symmetric
        self.clip_ratio = clip_ratio
        self.timer: CodecTimer = codec_timer(timer)
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
            check_bits("key_bits", key_bits)
        if value_bits is not None:
            check_bits("value_bits", value_bits)
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

    def keys_values(self, layer: int, *, then: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values of ``layer``, dequantised: [batch, heads, seq_len, head_dim].

        With ``then`` (new keys and values, [batch, heads, new, head_dim]), those follow in the
        same buffers, of their dtype: the attention's operands, built in one pass rather than
        dequantised and then concatenated. Each stored part is written straight into its slice
        (the fused kernel of ``tuner._kv_native`` on CPU float32, else the torch path).
        """
        state = self._layers[self._check_layer(layer)]
        extra = 0 if then is None else then[0].shape[2]
        batch = self.batch or (0 if then is None else then[0].shape[0])
        shape = (batch, self.n_heads, state.tokens + extra, self.head_dim)
        dtype = self.dtype if then is None else then[0].dtype
        keys = torch.empty(shape, device=self.device, dtype=dtype)
        values = torch.empty(shape, device=self.device, dtype=dtype)
        at = 0
        if state.segments:
            with self.timer.dequantize(self.device):
                for seg in state.segments:  # narrow: a view at a fraction of [:, :, a:b]'s cost
                    self._decode_into(keys.narrow(2, at, seg.tokens), seg.keys, seg.key_bits,
                                      keys=True)
                    self._decode_into(values.narrow(2, at, seg.tokens), seg.values,
                                      seg.value_bits, keys=False)
                    at += seg.tokens
        parts = [] if state.residual_k is None else [(state.residual_k, state.residual_v)]
        for k, v in parts + ([] if then is None else [then]):
            keys.narrow(2, at, k.shape[2]).copy_(k)
            values.narrow(2, at, k.shape[2]).copy_(v)  # type: ignore[arg-type]
            at += k.shape[2]
        return keys, values

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

    def _decode_into(self, out: torch.Tensor, part: _Part, bits: int, *, keys: bool) -> None:
        """Dequantise ``part`` into ``out``; the same numbers as dequantising to ``dtype`` and
        then converting to ``out``'s dtype, whichever path does it."""
        if bits in UNQUANTIZED_DTYPES:
            out.copy_(part.data.to(self.dtype))
            return
        assert part.scale is not None
        group = self.group_size if keys else self.value_group_size
        if self.dtype == torch.float32 and dequantize_into(
                out, part.data, part.scale, part.zero, bits, keys=keys, group=group):
            return
        b, h, t = part.data.shape[:3]
        grouped = (t // group, group, self.head_dim) if keys else (
            t, self.head_dim // group, group)
        codes = unpack_codes(part.data, bits).reshape(b, h, *grouped)
        x = dequantize_groups(codes, part.scale, part.zero, bits)
        out.copy_(x.reshape(b, h, t, self.head_dim).to(self.dtype))
