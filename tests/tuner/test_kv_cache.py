"""Quantised KV cache: packing, the derived error bound, measured bytes, live widths, decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from policies import dequantize, pack_uint, unpack_uint
from tuner.kv_cache import (
    KVCacheError,
    QuantizedKVCache,
    dequantize_groups,
    layout_bytes_per_token,
    pack_codes,
    quantize_groups,
    unpack_codes,
)
from tuner.kv_decode import cache_for, decode_step, kv_quality
from workloads.gpt import GPT, GPTConfig

WORD_CODES = {2: 4, 4: 2, 6: 4, 8: 1}
FP16_REL = 2.0 ** -10


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4, 6, 8]), rows=st.integers(1, 3),
       words=st.integers(0, 20).map(lambda n: 2 * n + 1), seed=st.integers(0, 2**31 - 1))
def test_pack_round_trip_is_exact_and_matches_the_numpy_layout(bits: int, rows: int, words: int,
                                                               seed: int) -> None:
    n = words * WORD_CODES[bits]  # an odd number of whole words
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, n), generator=g).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, n * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    flat = codes.numpy().reshape(-1)
    assert np.array_equal(packed.numpy().reshape(-1), pack_uint(flat, bits))
    assert np.array_equal(unpack_uint(packed.numpy().reshape(-1), bits), flat)


def test_six_bit_packs_four_codes_in_three_bytes() -> None:
    codes = torch.tensor([[0b111111, 0, 0b101010, 1]], dtype=torch.uint8)
    packed = pack_codes(codes, 6)
    word = 0b111111 | 0b101010 << 12 | 1 << 18
    assert packed.tolist() == [[word & 0xFF, word >> 8 & 0xFF, word >> 16 & 0xFF]]
    with pytest.raises(KVCacheError, match="whole"):
        pack_codes(torch.zeros(1, 3, dtype=torch.uint8), 6)


def _bound(x: torch.Tensor, dim: int, bits: int, symmetric: bool, clip: float) -> torch.Tensor:
    """docs/internals.md's bound (The KV codec), from the data alone (plus float32 arithmetic slack)."""
    x = x.double()
    if symmetric:
        a = x.abs().amax(dim, keepdim=True)
        step = torch.clamp(clip * a / ((1 << (bits - 1)) - 1), min=2.0 ** -14)
        rounding, clipped = step * (1 + FP16_REL) / 2, (1 - clip) * a
    else:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        r = hi - lo
        u = FP16_REL * (lo.abs() + r) + 2.0 ** -24
        step = torch.clamp((clip * r + u) / ((1 << bits) - 1), min=2.0 ** -14)
        rounding, clipped = step * (1 + FP16_REL) / 2 + 2.0 ** -25, (1 - clip) * r / 2
    return torch.maximum(rounding, clipped) + 1e-6 * x.abs().amax(dim, keepdim=True)


@settings(max_examples=80, deadline=None)
@given(x=arrays(np.float32, (3, 8, 16),
                elements=st.floats(-500, 500, width=32, allow_subnormal=False)),
       bits=st.sampled_from([2, 4, 6, 8]), dim=st.sampled_from([1, 2]),
       symmetric=st.booleans(), clip=st.sampled_from([1.0, 0.9, 0.6]),
       scale=st.sampled_from([1.0, 1e-3]))
def test_reconstruction_error_obeys_the_derived_bound(x: np.ndarray, bits: int, dim: int,
                                                      symmetric: bool, clip: float,
                                                      scale: float) -> None:
    t = torch.from_numpy(x) * scale
    q = quantize_groups(t, dim, bits, symmetric=symmetric, clip_ratio=clip)
    error = (dequantize_groups(q.codes, q.scale, q.zero, bits).double() - t.double()).abs()
    assert (error <= _bound(t, dim, bits, symmetric, clip)).all()
    assert int(q.codes.max()) < 1 << bits


def test_symmetric_codes_are_what_the_cost_model_dequantises() -> None:
    t = torch.linspace(-3, 3, 64).reshape(1, 64)
    q = quantize_groups(t, 1, 4, symmetric=True)
    ours = dequantize_groups(q.codes, q.scale, None, 4)
    theirs = dequantize(pack_uint(q.codes.numpy().reshape(-1), 4), 4, float(q.scale))
    assert np.allclose(ours.numpy().reshape(-1), theirs)


def test_the_seed_bound_is_too_tight_at_two_bits() -> None:
    """The seed's ||e|| <= alpha/(2^b - 1) fails for its own symmetric scale; ours holds."""
    t = torch.tensor([[-1.0, -0.5, 0.5, 1.0]])
    q = quantize_groups(t, 1, 2, symmetric=True)
    error = (dequantize_groups(q.codes, q.scale, None, 2) - t).abs().max()
    assert error > 1.0 / (2**2 - 1)
    assert error <= 1.0 / (2**2 - 2)


def _fill(cache: QuantizedKVCache, tokens: int, *, chunk: int = 1, seed: int = 0,
          batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, cache.n_heads, tokens, cache.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    for start in range(0, tokens, chunk):
        for layer in range(cache.n_layers):
            cache.append(layer, k[:, :, start:start + chunk], v[:, :, start:start + chunk])
    return k, v


@pytest.mark.parametrize("bits", [2, 4, 6, 8, 16, 32])
@pytest.mark.parametrize("symmetric", [False, True])
def test_measured_bytes_per_token_match_the_layout(bits: int, symmetric: bool) -> None:
    shape = {"n_layers": 2, "n_heads": 2, "head_dim": 32}
    cache = QuantizedKVCache(**shape, key_bits=bits, value_bits=bits, group_size=16,
                             residual_tokens=8, symmetric=symmetric)
    _fill(cache, 200, chunk=7)
    residual = cache.tokens_by_bits()["residual"] // shape["n_layers"]
    quantised = cache.seq_len - residual
    expected = (layout_bytes_per_token(**shape, key_bits=bits, value_bits=bits, group_size=16,
                                       symmetric=symmetric) * quantised
                + residual * 2 * 2 * 2 * 32 * 4)  # layers x (k, v) x heads x dim x fp32
    assert cache.seq_len == 200
    assert abs(cache.nbytes() - expected) <= 0.05 * expected


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_cache_reconstruction_obeys_the_bound_per_group(bits: int) -> None:
    cache = QuantizedKVCache(1, 2, 16, key_bits=bits, value_bits=bits, group_size=8,
                             residual_tokens=4)
    k, v = _fill(cache, 37, chunk=5, batch=2)
    got_k, got_v = cache.keys_values(0)
    n = 32  # quantised tokens: 37 - 4 residual, floored to groups of 8
    key_groups = k[:, :, :n].reshape(2, 2, n // 8, 8, 16)
    value_groups = v[:, :, :n].reshape(2, 2, n, 2, 8)
    key_err = (got_k[:, :, :n].reshape(key_groups.shape) - key_groups).abs().double()
    value_err = (got_v[:, :, :n].reshape(value_groups.shape) - value_groups).abs().double()
    assert (key_err <= _bound(key_groups, 3, bits, False, 1.0)).all()
    assert (value_err <= _bound(value_groups, 4, bits, False, 1.0)).all()
    assert torch.equal(got_k[:, :, n:], k[:, :, n:]) and torch.equal(got_v[:, :, n:], v[:, :, n:])


def test_set_bits_live_keeps_old_tokens_and_writes_new_ones_at_the_new_width() -> None:
    cache = QuantizedKVCache(3, 2, 32, key_bits=8, value_bits=8, group_size=16,
                             residual_tokens=0)
    _fill(cache, 64, seed=1)
    before = cache.nbytes()
    cache.set_bits(key_bits=2, value_bits=4, layers=[1, 2])
    assert cache.bits(0) == (8, 8) and cache.bits(1) == (2, 4)
    _fill(cache, 64, seed=2)
    assert cache.tokens_by_bits() == {"k8v8": 64 * 3 + 64, "k2v4": 64 * 2}
    grown = cache.nbytes() - before
    assert grown < before  # the second 64 tokens cost less in two of three layers
    k, _ = cache.keys_values(1)
    assert k.shape == (1, 2, 128, 32)
    with pytest.raises(KVCacheError, match="key_bits"):
        cache.set_bits(key_bits=3)


def test_timer_callback_sees_quantise_and_dequantise() -> None:
    seen: list[str] = []
    cache = QuantizedKVCache(1, 1, 8, group_size=4, residual_tokens=0,
                             timer=lambda kind, s: seen.append(kind) if s >= 0 else None)
    _fill(cache, 8)
    cache.keys_values(0)
    assert seen.count("quantize") == 2 and seen.count("dequantize") == 1


def test_serving_instrumentation_times_the_codec() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from collectors.torch_serving import ServingInstrumentation

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    cache = QuantizedKVCache(1, 1, 8, group_size=4, residual_tokens=0,
                             timer=ServingInstrumentation(meter, config_version=3))
    _fill(cache, 8)
    cache.keys_values(0)
    counts = {m.name: m.data.data_points[0].count
              for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics if m.name.endswith(".duration")}
    assert counts["seedance.serve.kv.quantize.duration"] == 2
    assert counts["seedance.serve.kv.dequantize.duration"] == 1


def test_fork_shares_storage_and_diverges() -> None:
    cache = QuantizedKVCache(1, 1, 8, group_size=4, residual_tokens=2)
    _fill(cache, 9)
    fork = cache.fork()
    _fill(fork, 4, seed=3)
    assert cache.seq_len == 9 and fork.seq_len == 13
    quantised = 9 - cache.tokens_by_bits()["residual"]
    assert quantised > 0
    assert torch.equal(fork.keys_values(0)[0][:, :, :quantised],
                       cache.keys_values(0)[0][:, :, :quantised])


def test_decode_step_with_an_unquantised_cache_reproduces_the_model() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)).eval()
    idx = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        reference = model(idx)
    cache = cache_for(model, key_bits=32, value_bits=32, group_size=8, residual_tokens=4)
    steps = [decode_step(model, cache, idx[:, :17])]
    steps += [decode_step(model, cache, idx[:, i:i + 1]) for i in range(17, 40)]
    assert torch.allclose(torch.cat(steps, dim=1), reference, atol=1e-4)
    rows = [cache_for(model, key_bits=32, value_bits=32) for _ in range(2)]
    decode_step(model, rows[0], idx[:1, :5])
    decode_step(model, rows[1], idx[1:, :11])
    out = decode_step(model, rows, torch.stack([idx[0, 5:6], idx[1, 11:12]]))
    assert torch.allclose(out[0, 0], reference[0, 5], atol=1e-4)
    assert torch.allclose(out[1, 0], reference[1, 11], atol=1e-4)


@pytest.mark.integration
def test_quality_loss_grows_as_bits_fall_on_held_out_text() -> None:
    from tests.tuner.kv_model import held_out_windows, trained_gpt

    model, held_out = trained_gpt()
    tokens = held_out_windows(held_out, n=4, seq_len=128)
    kl = {}
    for bits in (8, 6, 4, 2):
        cache = cache_for(model, key_bits=bits, value_bits=bits, group_size=16,
                          residual_tokens=0)
        quality = kv_quality(model, tokens, cache)
        kl[bits] = quality.kl_nats
    assert kl[8] < kl[6] < kl[4] < kl[2], kl
    assert quality.perplexity_ratio > 1.0  # 2 bits costs perplexity
