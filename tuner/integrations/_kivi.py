"""The KIVI cache's transformers layer and cache (the face is ``tuner.integrations.hf_kv_cache``).

transformers' own ``QuantizedLayer`` re-quantises the whole cache at every residual flush and
fixes ``nbits`` at construction; this layer keeps the project's incremental groups, whose width
can change between two decode steps.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicLayer

from tuner._kv_codec import check_bits
from tuner.kv_cache import KVCacheError, QuantizedKVCache

__all__ = ["KiviCache", "KiviLayer"]


class KiviLayer(DynamicLayer):
    """One attention layer's keys and values in a one-layer ``QuantizedKVCache``.

    A ``DynamicLayer`` (it grows with every token) whose storage is the KIVI codec's; it is
    created lazily on the first ``update``, which gives the heads, head size, device and dtype.
    New tokens attend to the dequantised cache plus their own exact keys and values, as
    quantised-cache servers do. Not croppable and no beam reordering: a packed token cannot be
    taken back or moved to another row without re-quantising it.
    """

    is_croppable = False

    def __init__(self, *, key_bits: int, value_bits: int, **cache_kwargs: Any) -> None:
        super().__init__()
        self.key_bits, self.value_bits = key_bits, value_bits
        self._kwargs = cache_kwargs
        self.store: QuantizedKVCache | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Create the store for these keys' heads, head size, device and dtype."""
        super().lazy_initialization(key_states, value_states)
        self.store = QuantizedKVCache(1, key_states.shape[1], key_states.shape[3],
                                      key_bits=self.key_bits, value_bits=self.value_bits,
                                      device=key_states.device, dtype=key_states.dtype,
                                      **self._kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens; return every key and value the attention reads."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.store is not None
        held = self.store.layer_len(0)
        both = self.store.keys_values(0, then=(key_states, value_states)) if held else None
        self.store.append(0, key_states, value_states)
        return (key_states, value_states) if both is None else both

    def set_bits(self, key_bits: int, value_bits: int) -> None:
        """The width of tokens quantised from now on (stored ones keep theirs)."""
        if self.store is not None:
            self.store.set_bits(key_bits=key_bits, value_bits=value_bits)
        self.key_bits, self.value_bits = key_bits, value_bits

    def get_seq_length(self) -> int:
        """Tokens held."""
        return 0 if self.store is None else self.store.layer_len(0)

    def reset(self) -> None:
        """Drop every token (the width stays)."""
        self.store = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: packed groups cannot be shortened (``is_croppable`` is False)."""
        raise KVCacheError("KiviCache cannot crop: its tokens are packed in groups")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: beam search is not supported on this cache."""
        raise KVCacheError("KiviCache does not support beam search (num_beams > 1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused, as ``reorder_cache``."""
        raise KVCacheError("KiviCache cannot repeat its batch (contrastive or beam search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused, as ``reorder_cache``."""
        raise KVCacheError("KiviCache cannot select rows of its batch")


class KiviCache(Cache):
    """A transformers ``Cache`` of :class:`KiviLayer`, one per decoder layer of ``config``.

    Args:
        config: the model's config (full attention only, as transformers' ``QuantizedCache``).
        key_bits, value_bits: 2, 4, 6, 8 (quantised) or 16 / 32 (bfloat16 / as is).
        group_size, residual_tokens, symmetric, clip_ratio: ``QuantizedKVCache``'s.
    """

    def __init__(self, config: PreTrainedConfig, *, key_bits: int = 4, value_bits: int = 4,
                 group_size: int = 32, residual_tokens: int = 32, symmetric: bool = False,
                 clip_ratio: float = 1.0) -> None:
        text = config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kwargs: dict[str, Any] = {"group_size": group_size, "residual_tokens": residual_tokens,
                                  "symmetric": symmetric, "clip_ratio": clip_ratio}
        # refuse a bad width or layout now, not at the first forward
        QuantizedKVCache(1, heads, head_dim, key_bits=key_bits, value_bits=value_bits, **kwargs)
        for kind in getattr(text, "layer_types", None) or ():
            if kind != "full_attention":
                raise KVCacheError(f"KiviCache holds full-attention layers only, the model "
                                   f"has {kind!r}")
        super().__init__(layers=[KiviLayer(key_bits=key_bits, value_bits=value_bits, **kwargs)
                                 for _ in range(text.num_hidden_layers)])

    @property
    def kivi_layers(self) -> list[KiviLayer]:
        """The layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, KiviLayer)]

    def bits(self) -> tuple[int, int]:
        """(key_bits, value_bits) new tokens are stored at."""
        first = self.kivi_layers[0]
        return first.key_bits, first.value_bits

    def set_bits(self, *, key_bits: int, value_bits: int) -> None:
        """Store tokens quantised from now on at these widths, in every layer."""
        check_bits("key_bits", key_bits)
        check_bits("value_bits", value_bits)
        for layer in self.kivi_layers:
            layer.set_bits(key_bits, value_bits)

    def tokens_by_bits(self) -> dict[str, int]:
        """Tokens stored per width (``"k4v4"``, ``"residual"``), summed over layers."""
        out: dict[str, int] = {}
        for layer in self.kivi_layers:
            if layer.store is not None:
                for key, n in layer.store.tokens_by_bits().items():
                    out[key] = out.get(key, 0) + n
        return out

    def nbytes(self) -> int:
        """Bytes held, measured from the stored tensors."""
        return sum(layer.store.nbytes() for layer in self.kivi_layers if layer.store is not None)
