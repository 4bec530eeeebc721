"""Model families for the generalisation benchmark: jobs the tuner was not built around.

The demo job is one small GPT; a tuner that only works there has learned the demo, not the
problem. Each family here is a model the way a user would write it (usual module names, no
hooks for the tuner), a fixed global batch of deterministic synthetic data the model can learn,
its loss, what one step's "tokens" mean, and the launch config its author might have left.
docs/tuning.md ("The model families") lists them with their measured default steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from collectors import SeedanceError

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FamilyError(SeedanceError):
    """A family name or build argument is invalid."""


# ---- data -------------------------------------------------------------------------------------


class SyntheticBatches:
    """A fixed global batch per step, the same sequence for the same seed.

    Every step draws a fresh batch (as a data loader would: a model that saw the same few
    batches again and again would memorise them and drive the loss to zero, where a relative
    loss check means nothing). Drawing costs about a millisecond, nothing next to a step.
    """

    def __init__(self, draw: Callable[[torch.Generator], Batch], *, seed: int) -> None:
        self._draw = draw
        self._generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self._draw(self._generator)


LABEL_NOISE = 0.2
"""Share of classification labels drawn at random: real data has an irreducible loss, so the
loss levels off instead of falling to zero."""


def _noisy_labels(y: torch.Tensor, classes: int, g: torch.Generator) -> torch.Tensor:
    flip = torch.rand(len(y), generator=g) < LABEL_NOISE
    return torch.where(flip, torch.randint(classes, y.shape, generator=g), y)


def _image_draw(batch: int, classes: int, size: int, seed: int
                ) -> Callable[[torch.Generator], Batch]:
    """Images = noise + a faint fixed template of their class; some labels are noise."""
    templates = torch.randn(classes, 3, size, size,
                            generator=torch.Generator().manual_seed(seed + 10_000))

    def draw(g: torch.Generator) -> Batch:
        y = torch.randint(classes, (batch,), generator=g)
        x = templates[y] * 0.3 + torch.randn(batch, 3, size, size, generator=g)
        return x, _noisy_labels(y, classes, g)

    return draw


def _sequence_draw(batch: int, seq_len: int, vocab: int, seed: int
                   ) -> Callable[[torch.Generator], Batch]:
    """Token sequences from a fixed sparse Markov chain (4 successors a token, so the loss
    levels off at ln 4): next-token prediction is learnable, never perfectly."""
    g0 = torch.Generator().manual_seed(seed + 20_000)
    successors = torch.randint(vocab, (vocab, 4), generator=g0)

    def draw(g: torch.Generator) -> Batch:
        seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(vocab, (batch,), generator=g)
        picks = torch.randint(4, (batch, seq_len), generator=g)
        for t in range(seq_len):
            seq[:, t + 1] = successors[seq[:, t], picks[:, t]]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return draw


def _feature_draw(batch: int, features: int, classes: int, seed: int
                  ) -> Callable[[torch.Generator], Batch]:
    """Feature vectors labelled by a fixed random two-layer teacher; some labels are noise."""
    g0 = torch.Generator().manual_seed(seed + 30_000)
    w1 = torch.randn(features, 64, generator=g0) / math.sqrt(features)
    w2 = torch.randn(64, classes, generator=g0)

    def draw(g: torch.Generator) -> Batch:
        x = torch.randn(batch, features, generator=g)
        return x, _noisy_labels((torch.tanh(x @ w1) @ w2).argmax(dim=1), classes, g)

    return draw


def _classification_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), target)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1))


# ---- models -----------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """VGG-style: stages of (Conv3x3 -> BatchNorm2d -> ReLU) x 2 and a max-pool, then a
    classifier; torchvision's ``features`` / ``classifier`` naming."""

    def __init__(self, *, widths: Sequence[int] = (32, 64, 128), classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in widths:
            for _ in range(2):
                layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False),
                           nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(channels, 256),
                                        nn.ReLU(inplace=True), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, 3, H, W) images -> (batch, classes) logits."""
        return self.classifier(self.pool(self.features(x)))


class Attention(nn.Module):
    """Multi-head self-attention with one fused ``qkv`` projection (timm naming), no mask."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, dim) -> (batch, tokens, dim)."""
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    """The ViT block's feed-forward: ``fc1`` -> GELU -> ``fc2`` (timm naming)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (..., dim)."""
        return self.fc2(self.act(self.fc1(x)))


class ViTBlock(nn.Module):
    """A pre-norm ViT block: attention and MLP, each residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, dim) -> (batch, tokens, dim)."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small vision transformer (timm naming): patch embedding, class token, learned
    positions, pre-norm blocks, head on the class token."""

    def __init__(self, *, image: int = 32, patch: int = 4, dim: int = 192, depth: int = 6,
                 heads: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.patches = (image // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, 3, image, image) -> (batch, classes) logits from the class token."""
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1).to(x.dtype), x], dim=1)
        x = self.blocks(x + self.pos_embed.to(x.dtype))
        return self.head(self.norm(x)[:, 0])


class LSTMLanguageModel(nn.Module):
    """Embedding, a stacked LSTM and a linear head: next-token prediction."""

    def __init__(self, *, vocab: int = 64, dim: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq) token ids -> (batch, seq, vocab) next-token logits."""
        out, _ = self.lstm(self.embed(x))
        return self.head(out)


class DeepMLP(nn.Module):
    """A plain deep MLP: ``layers.N`` Linear layers with GELU between them, then a head."""

    def __init__(self, *, features: int = 512, width: int = 1024, depth: int = 8,
                 classes: int = 10) -> None:
        super().__init__()
        dims = [features, *([width] * depth)]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, features) -> (batch, classes) logits."""
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class DecoderAttention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections (Hugging Face Llama naming)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim); each position sees only earlier ones."""
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    """Llama's gated feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (..., dim)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm (RMSNorm) decoder layer: causal attention and SwiGLU, each residual."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim)
        self.self_attn = DecoderAttention(dim, heads)
        self.post_attention_layernorm = nn.RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """A Llama-style decoder (Hugging Face naming), wider and deeper than the demo GPT
    (6 layers x 256): token embedding, learned positions, RMSNorm, SwiGLU, untied head."""

    def __init__(self, *, vocab: int = 256, seq_len: int = 64, dim: int = 384,
                 layers: int = 8, heads: int = 6, hidden: int = 1024) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.embed_positions = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq) token ids -> (batch, seq, vocab) next-token logits."""
        positions = torch.arange(x.size(1), device=x.device)
        h = self.embed_tokens(x) + self.embed_positions(positions)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


# ---- the registry -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Built:
    """One family made ready to train: what a user's script holds before its loop."""

    family: Family
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: SyntheticBatches
    loss_fn: LossFn

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, fixed whatever the micro-batch (``Family.global_batch``)."""
        return self.family.global_batch

    @property
    def tokens_per_batch(self) -> int:
        """Tokens of one global batch, in the family's unit (``Family.token_unit``)."""
        return self.family.global_batch * self.family.tokens_per_sample

    @property
    def module_groups(self) -> Mapping[str, Sequence[str]] | None:
        """Groups for ``attach``; None: the project's default grouping by module names."""
        return self.family.module_groups


@dataclass(frozen=True, kw_only=True)
class Family:
    """How to build one family; ``build(seed)`` is deterministic for a seed."""

    name: str
    description: str
    global_batch: int
    tokens_per_sample: int
    token_unit: str
    make_model: Callable[..., nn.Module]
    make_draw: Callable[[int, int], Callable[[torch.Generator], Batch]]
    """(global_batch, seed) -> one batch from a generator."""
    loss_fn: LossFn
    lr: float = 1e-3
    module_groups: Mapping[str, Sequence[str]] | None = None
    """Passed to ``attach``; None: the project's default grouping by module names."""
    tiny: Mapping[str, Any] = field(default_factory=dict)
    """Model arguments of a tiny variant (same architecture, names and data): fast tests."""
    small: Mapping[str, Any] = field(default_factory=dict)
    """Model arguments of a smaller size of the family (same architecture, names and data,
    about a quarter of the parameters): the fleet bench's first job of a family."""
    launch_micro_batch: int | None = None
    """The micro-batch its author launched with (None: the whole global batch at once)."""
    launch_threads: int | None = None
    """The torch threads its author set at launch (None: torch's default)."""

    def build(self, seed: int = 0, *, tiny: bool = False, small: bool = False) -> Built:
        """A fresh model, AdamW and data stream; ``tiny`` builds the variant for tests,
        ``small`` the family's smaller size."""
        if tiny and small:
            raise FamilyError(f"family {self.name}: build tiny or small, not both")
        torch.manual_seed(seed)
        model = self.make_model(**(self.tiny if tiny else self.small if small else {}))
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)
        batches = SyntheticBatches(self.make_draw(self.global_batch, seed), seed=seed)
        return Built(family=self, model=model, optimizer=optimizer, batches=batches,
                     loss_fn=self.loss_fn)


FAMILIES: Mapping[str, Family] = {f.name: f for f in (
    Family(name="cnn_bn", description="VGG-style CNN with BatchNorm, 32x32 images, 10 classes",
           global_batch=32, tokens_per_sample=1, token_unit="images",
           make_model=ConvNet, make_draw=lambda b, s: _image_draw(b, 10, 32, s),
           loss_fn=_classification_loss, tiny={"widths": (4, 8)},
           small={"widths": (16, 32, 64)}),
    Family(name="vit", description="ViT (6 blocks x 192, 4x4 patches of 32x32 images)",
           global_batch=16, tokens_per_sample=64, token_unit="patch tokens (64 per image)",
           make_model=ViT, make_draw=lambda b, s: _image_draw(b, 10, 32, s),
           loss_fn=_classification_loss, tiny={"dim": 16, "depth": 1, "heads": 2},
           small={"dim": 128, "depth": 3, "heads": 2}, launch_micro_batch=4),
    Family(name="rnn", description="2-layer LSTM language model (256 wide) on 64-step "
                                   "sequences of a 64-token vocabulary",
           global_batch=32, tokens_per_sample=64, token_unit="sequence positions",
           make_model=LSTMLanguageModel, make_draw=lambda b, s: _sequence_draw(b, 64, 64, s),
           loss_fn=_lm_loss, tiny={"dim": 16, "layers": 1}, small={"dim": 128},
           launch_threads=1),
    Family(name="mlp", description="deep MLP (8 x 1024) on 512 features, 10 classes",
           global_batch=256, tokens_per_sample=1, token_unit="samples",
           make_model=DeepMLP, make_draw=lambda b, s: _feature_draw(b, 512, 10, s),
           loss_fn=_classification_loss, tiny={"width": 32, "depth": 2},
           small={"width": 512, "depth": 6}, launch_micro_batch=32),
    Family(name="wide_transformer", description="Llama-style decoder, 8 layers x 384 "
                                                "(demo GPT: 6 x 256), 64-token context",
           global_batch=8, tokens_per_sample=64, token_unit="sequence positions",
           make_model=Decoder, make_draw=lambda b, s: _sequence_draw(b, 64, 256, s),
           loss_fn=_lm_loss, lr=3e-4, tiny={"dim": 32, "layers": 1, "heads": 2, "hidden": 64},
           small={"dim": 256, "layers": 4, "heads": 4, "hidden": 512},
           launch_micro_batch=2, launch_threads=1),
)}
"""Every family by name; none of them is the demo GPT."""



def family(name: str) -> Family:
    """The family called ``name``; ``FamilyError`` names the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise FamilyError(f"unknown family {name!r}; families: {', '.join(FAMILIES)}") from None


def _measure(names: Sequence[str], steps: int = 10, warmup: int = 3) -> None:
    """Print each family's default step time (how the docstring's numbers were measured)."""
    import statistics
    import time

    for name in names:
        built = family(name).build()
        times = []
        for i in range(warmup + steps):
            x, y = next(built.batches)
            t0 = time.perf_counter()
            built.loss_fn(built.model(x), y).backward()
            built.optimizer.step()
            built.optimizer.zero_grad(set_to_none=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        params = sum(p.numel() for p in built.model.parameters())
        print(f"{name}: {params / 1e6:.2f}M parameters, step {statistics.median(times):.3f} s "
              f"(median of {steps}, threads {torch.get_num_threads()})", flush=True)


if __name__ == "__main__":
    import sys

    _measure(sys.argv[1:] or list(FAMILIES))
