"""Adaptive KV quantiser: the entropy, the seed's rule, the decision log, live widths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tuner._knobs import KnobError, KnobSpace
from tuner.kv_adaptive import (
    KV_ADAPTIVE_KNOBS,
    AdaptiveKVConfig,
    AdaptiveKVQuantizer,
    choose_bits,
    key_norm_entropy,
)
from tuner.kv_cache import KVCacheError, QuantizedKVCache

ARTICLE_FIELDS = {"seq_pos", "kv_len", "entropy", "target_bw", "reason"}


@settings(max_examples=60, deadline=None)
@given(norms=arrays(np.float32, st.integers(1, 80),
                   elements=st.floats(0, 100, width=32, allow_subnormal=False)),
       scale=st.floats(0.01, 100), shift=st.floats(0, 50))
def test_entropy_is_normalised_and_free_of_scale_and_shift(norms: np.ndarray, scale: float,
                                                            shift: float) -> None:
    t = torch.from_numpy(norms).double()
    h = key_norm_entropy(t)
    assert 0.0 <= h <= 1.0 + 1e-6
    # float32 bin edges can move a value on an edge to the next bin, hence the tolerance;
    # ranges float32 cannot resolve after the shift are degenerate, not a property failure
    assume(norms.size < 2 or float(np.ptp(norms)) * scale > 1e-4 * (shift + 100 * scale))
    assert key_norm_entropy(t * scale + shift) == pytest.approx(h, abs=0.13)


def test_entropy_is_high_for_even_norms_and_low_when_a_few_stand_out() -> None:
    g = torch.Generator().manual_seed(0)
    even = torch.rand(64, generator=g) * 2 + 10
    outliers = torch.cat([torch.full((60,), 10.0) + torch.rand(60, generator=g) * 0.1,
                          torch.tensor([40.0, 45.0, 50.0, 60.0])])
    assert key_norm_entropy(even) > 0.85
    assert key_norm_entropy(outliers) < 0.3
    assert key_norm_entropy(torch.full((10,), 3.0)) == 1.0


def test_rule_is_the_seeds() -> None:
    seed = AdaptiveKVConfig()
    assert choose_bits(127892, 0.912, seed) == (4, "high_entropy_long_context")
    assert choose_bits(127892, 0.80, seed) == (6, "low_entropy")
    assert choose_bits(65536, 0.99, seed) == (6, "short_context")


def test_knobs_build_configs_and_reject_bad_values() -> None:
    space = KnobSpace.of(KV_ADAPTIVE_KNOBS)
    values = space.validate({"kv.adaptive.low_bits": 2, "kv.adaptive.length_threshold": 512})
    config = AdaptiveKVConfig.from_knobs(values, window_tokens=32)
    assert (config.low_bits, config.high_bits, config.length_threshold) == (2, 6, 512)
    assert config.window_tokens == 32
    with pytest.raises(KnobError):
        AdaptiveKVConfig.from_knobs({"kv.adaptive.low_bits": 3})
    with pytest.raises(KVCacheError, match="low_bits"):
        AdaptiveKVConfig(low_bits=8, high_bits=4)


def _decode(cache: QuantizedKVCache, adaptive: AdaptiveKVQuantizer, tokens: int,
            norms: torch.Tensor) -> None:
    """Append tokens whose keys have the given L2 norms (per token), deciding after each."""
    g = torch.Generator().manual_seed(0)
    for i in range(tokens):
        direction = torch.nn.functional.normalize(
            torch.randn(1, cache.n_heads, 1, cache.head_dim, generator=g), dim=-1)
        k = direction * norms[i % len(norms)]
        for layer in range(cache.n_layers):
            cache.append(layer, k, torch.randn(k.shape, generator=g))
        adaptive.step()


def test_decisions_are_logged_with_the_seed_fields_and_change_widths_live(tmp_path: Path
                                                                          ) -> None:
    cache = QuantizedKVCache(2, 2, 16, key_bits=8, value_bits=8, group_size=8,
                             residual_tokens=0)
    log = tmp_path / "kv-decisions.jsonl"
    config = AdaptiveKVConfig(length_threshold=48, window_tokens=32, decide_every_tokens=16,
                              low_bits=2, high_bits=8)
    adaptive = AdaptiveKVQuantizer(cache, config, log_path=log)
    even = torch.linspace(5.0, 7.0, 32)
    _decode(cache, adaptive, 128, even)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records == adaptive.decisions
    assert all(ARTICLE_FIELDS <= set(r) for r in records)
    assert [r["seq_pos"] for r in records] == [0, 16, 32, 48, 64, 80, 96, 112]
    reasons = [r["reason"] for r in records]
    assert [r["kv_len"] for r in records] == [1, 17, 33, 49, 65, 81, 97, 113]
    assert reasons[:3] == ["short_context"] * 3  # kv_len <= 48
    assert reasons[3:] == ["high_entropy_long_context"] * 5
    assert all(r["entropy"] > 0.85 for r in records[2:])
    assert cache.bits(0) == (2, 2)
    mix = cache.tokens_by_bits()
    assert mix["k8v8"] > 0 and mix["k2v2"] > 0  # old tokens kept their width


def test_outlier_keys_keep_high_bits_in_long_context() -> None:
    cache = QuantizedKVCache(1, 2, 16, group_size=8, residual_tokens=0)
    adaptive = AdaptiveKVQuantizer(cache, AdaptiveKVConfig(length_threshold=16,
                                                           window_tokens=32))
    norms = torch.cat([torch.full((30,), 5.0), torch.tensor([50.0, 60.0])])
    _decode(cache, adaptive, 64, norms)
    last = adaptive.decide()[0]
    assert last["reason"] == "low_entropy" and last["target_bw"] == 6


def test_a_log_that_cannot_be_written_does_not_stop_decisions(tmp_path: Path) -> None:
    cache = QuantizedKVCache(1, 1, 8, group_size=4)
    adaptive = AdaptiveKVQuantizer(cache, log_path=tmp_path / "missing" / "log.jsonl")
    assert adaptive.decide()[0]["reason"] == "short_context"
