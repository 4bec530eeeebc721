"""English-like training text from a seeded grammar, so the demo job needs no download.

The text is generated, not real English: a small phrase grammar over a fixed vocabulary. It has
enough structure (agreement, clauses, punctuation) for a byte-level model's loss to fall well
below the uniform 8 bits per byte, and the same seed always gives the same bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from collectors import SeedanceError

VOCAB_SIZE = 256
"""Byte-level: every UTF-8 byte is a token."""

_DETERMINERS = ("the", "a", "every", "one", "that", "this", "some", "no")
_ADJECTIVES = (
    "small", "quiet", "bright", "old", "heavy", "green", "careful", "distant", "warm", "broken",
    "patient", "narrow", "golden", "silent", "curious", "tired", "rapid", "gentle",
)
_NOUNS = (
    "river", "engineer", "garden", "machine", "teacher", "window", "city", "lantern", "farmer",
    "signal", "bridge", "student", "forest", "kernel", "harbour", "painter", "clock", "letter",
    "mountain", "server", "captain", "library", "tower", "message",
)
_VERBS = (
    "watches", "builds", "carries", "finds", "follows", "measures", "remembers", "opens",
    "repairs", "answers", "crosses", "paints", "counts", "sends", "keeps", "moves",
)
_ADVERBS = ("slowly", "quickly", "often", "never", "again", "carefully", "quietly", "today")
_PREPOSITIONS = ("near", "under", "behind", "across", "beside", "beyond", "inside", "above")
_CONJUNCTIONS = ("and", "but", "because", "while", "so")


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS))
    if rng.random() < 0.25:
        words += [rng.choice(_PREPOSITIONS), rng.choice(_DETERMINERS), rng.choice(_NOUNS)]
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    parts = [_noun_phrase(rng), rng.choice(_VERBS), _noun_phrase(rng)]
    if rng.random() < 0.4:
        parts.append(rng.choice(_ADVERBS))
    return " ".join(parts)


def sentence(rng: random.Random) -> str:
    """One sentence: a clause, sometimes joined to a second by a conjunction."""
    text = _clause(rng)
    if rng.random() < 0.35:
        text += f", {rng.choice(_CONJUNCTIONS)} {_clause(rng)}"
    end = "?" if rng.random() < 0.1 else "."
    return text[0].upper() + text[1:] + end


def generate_text(*, n_bytes: int, seed: int) -> str:
    """At least ``n_bytes`` of generated text (ASCII, so bytes == characters)."""
    if n_bytes <= 0:
        raise SeedanceError(f"n_bytes must be positive, got {n_bytes}")
    rng = random.Random(seed)
    sentences: list[str] = []
    size = 0
    while size < n_bytes:
        s = sentence(rng)
        sentences.append(s)
        size += len(s) + 1
    return " ".join(sentences)


@dataclass(frozen=True, slots=True, kw_only=True)
class CorpusConfig:
    """How much text to generate and how much of it to hold out."""

    n_bytes: int = 1_000_000
    held_out_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_bytes < 1024:
            raise SeedanceError(f"CorpusConfig.n_bytes must be >= 1024, got {self.n_bytes}")
        if not 0.0 < self.held_out_fraction < 0.5:
            raise SeedanceError(
                "CorpusConfig.held_out_fraction must be in (0, 0.5), "
                f"got {self.held_out_fraction}"
            )


@dataclass(frozen=True, slots=True)
class Corpus:
    """Byte tokens of the generated text, split into train and held-out parts."""

    train: torch.Tensor
    held_out: torch.Tensor

    @classmethod
    def generate(cls, config: CorpusConfig) -> Corpus:
        """The corpus for ``config`` (same seed, same bytes); the held-out part is the tail."""
        data = torch.frombuffer(
            bytearray(generate_text(n_bytes=config.n_bytes, seed=config.seed).encode("ascii")),
            dtype=torch.uint8,
        ).long()
        split = int(len(data) * (1.0 - config.held_out_fraction))
        return cls(train=data[:split], held_out=data[split:])

    @staticmethod
    def batch(
        data: torch.Tensor, *, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs (batch_size, seq_len) and the next-byte targets."""
        if len(data) <= seq_len + 1:
            raise SeedanceError(f"seq_len {seq_len} does not fit in {len(data)} tokens")
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        index = starts[:, None] + torch.arange(seq_len + 1)
        window = data[index]
        return window[:, :-1], window[:, 1:]


def decode(tokens: torch.Tensor) -> str:
    """Bytes back to text (for samples and debugging)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("ascii", errors="replace")
