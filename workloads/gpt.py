"""A small GPT (about 5M parameters) that trains on CPU in the demo job.

Submodule names follow nanoGPT / GPT-2 (``wte``, ``wpe``, ``h.N.ln_1``, ``h.N.attn.qkv``,
``h.N.attn.proj``, ``h.N.ln_2``, ``h.N.mlp.fc``, ``h.N.mlp.proj``, ``ln_f``, ``lm_head``) so the
instrumentation's default module groups and the layer-wise precision policies find them by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from collectors import SeedanceError
from workloads.corpus import VOCAB_SIZE


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Model shape; the defaults give about 5M parameters."""

    vocab_size: int = VOCAB_SIZE
    block_size: int = 128
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise SeedanceError(f"GPTConfig.{name} must be positive")
        if self.n_embd % self.n_head:
            raise SeedanceError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise SeedanceError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention with fused ``qkv`` (nanoGPT naming)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, n_embd) -> (batch, seq, n_embd); dropout only while training."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """The block's feed-forward: ``fc`` -> GELU -> ``proj`` (4x wide), then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n_embd) -> (..., n_embd)."""
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, n_embd) -> (batch, seq, n_embd)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The demo model: GPT-2 layout and initialisation (residual projections scaled down)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab), or the mean cross-entropy when targets are given."""
        t = idx.shape[1]
        if t > self.config.block_size:
            raise SeedanceError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def count_parameters(model: nn.Module) -> int:
    """Every parameter's elements, trainable or not (the "about 5M" of GPTConfig)."""
    return sum(p.numel() for p in model.parameters())
