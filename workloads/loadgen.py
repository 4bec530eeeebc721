"""Seeded open-loop load for the serving workload: Poisson arrivals, a Zipf mix of shared
prompt prefixes (system prompts, few-shot headers), and prompt and output length distributions.

Every request is a shared prefix (one of ``n_prefixes``, prefix k drawn with probability
proportional to ``1 / k**zipf_s``) followed by a user suffix of uniform length; the number of
tokens to generate is geometric (mean ``mean_output_tokens``), clipped to the range. The trace is
a pure function of the config, so two policies can be compared on the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from collectors import SeedanceError


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """The traffic: rate, duration and the shape of prompts and outputs."""

    rate_rps: float = 20.0
    duration_s: float = 30.0
    n_prefixes: int = 64
    zipf_s: float = 1.1
    prefix_tokens: int = 64
    suffix_tokens: tuple[int, int] = (4, 16)
    mean_output_tokens: float = 8.0
    output_tokens: tuple[int, int] = (2, 24)
    vocab_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rate_rps", "duration_s", "zipf_s", "mean_output_tokens"):
            if not getattr(self, name) > 0:
                raise SeedanceError(f"LoadConfig.{name} must be > 0")
        for name in ("n_prefixes", "prefix_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise SeedanceError(f"LoadConfig.{name} must be >= 1")
        for name in ("suffix_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise SeedanceError(f"LoadConfig.{name} must be (low, high) with 1 <= low <= "
                                    f"high, got {(low, high)}")

    @property
    def max_tokens(self) -> int:
        """The longest sequence a request can reach (prompt plus output)."""
        return self.prefix_tokens + self.suffix_tokens[1] + self.output_tokens[1]


@dataclass(frozen=True, kw_only=True)
class Request:
    """One request: ``arrival_s`` after the start of the run; ``prompt[:prefix_len]`` is the
    shared prefix ``prefix_id``."""

    id: int
    arrival_s: float
    prefix_id: int
    prefix_len: int
    prompt: tuple[int, ...]
    max_new_tokens: int


def prefixes(config: LoadConfig) -> list[tuple[int, ...]]:
    """The shared prefixes (a function of the seed alone, so traces of one seed share them)."""
    rng = np.random.default_rng([config.seed, 1])
    table = rng.integers(0, config.vocab_size, size=(config.n_prefixes, config.prefix_tokens))
    return [tuple(int(t) for t in row) for row in table]


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    """Zipf weights ``1 / rank**s`` over ``n`` ranks, normalised to sum to 1."""
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def prefix_ids(config: LoadConfig, count: int, *, stream: int = 0) -> list[int]:
    """``count`` prefix ids drawn from the Zipf mix (``stream`` picks an independent draw)."""
    rng = np.random.default_rng([config.seed, 2, stream])
    p = zipf_probabilities(config.n_prefixes, config.zipf_s)
    return [int(i) for i in rng.choice(config.n_prefixes, size=count, p=p)]


def generate(config: LoadConfig) -> list[Request]:
    """The run's requests in arrival order."""
    rng = np.random.default_rng([config.seed, 0])
    table = prefixes(config)
    gaps = rng.exponential(1.0 / config.rate_rps, size=int(config.rate_rps * config.duration_s
                                                           * 2) + 16)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < config.duration_s]
    ids = prefix_ids(config, len(arrivals))
    lo, hi = config.output_tokens
    out: list[Request] = []
    for n, (at, pid) in enumerate(zip(arrivals, ids, strict=True)):
        suffix = rng.integers(0, config.vocab_size,
                              size=int(rng.integers(config.suffix_tokens[0],
                                                    config.suffix_tokens[1] + 1)))
        new_tokens = int(np.clip(rng.geometric(1.0 / config.mean_output_tokens), lo, hi))
        out.append(Request(id=n, arrival_s=float(at), prefix_id=pid,
                           prefix_len=config.prefix_tokens,
                           prompt=table[pid] + tuple(int(t) for t in suffix),
                           max_new_tokens=new_tokens))
    return out


def recent_history(config: LoadConfig, count: int) -> list[tuple[int, ...]]:
    """Prefixes of ``count`` earlier requests from the same mix (an independent draw): the
    "recent traffic" a replica prewarms from at start."""
    table = prefixes(config)
    return [table[i] for i in prefix_ids(config, count, stream=1)]
