"""An unquantised KV cache with ``tuner.kv_cache.QuantizedKVCache``'s interface (a test helper
and the serving workload's ``--kv-cache plain`` until the quantised cache lands)."""

from __future__ import annotations

import torch


class PlainKVCache:
    """Per-layer keys and values of one sequence, (1, n_heads, tokens, head_dim), as given."""

    def __init__(self, n_layers: int, n_heads: int, head_dim: int, **_: object) -> None:
        self.n_heads, self.head_dim = n_heads, head_dim
        self._k: list[torch.Tensor | None] = [None] * n_layers
        self._v: list[torch.Tensor | None] = [None] * n_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old_k, old_v = self._k[layer], self._v[layer]
        self._k[layer] = k if old_k is None else torch.cat((old_k, k), dim=-2)
        self._v[layer] = v if old_v is None else torch.cat((old_v, v), dim=-2)

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._k[layer], self._v[layer]
        assert k is not None and v is not None, f"layer {layer} holds nothing yet"
        return k, v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v) if t is not None)

    def set_bits(self, *args: object, **kwargs: object) -> None:
        """Nothing to change: this cache keeps full precision."""
