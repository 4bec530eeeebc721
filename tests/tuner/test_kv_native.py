"""The fused CPU dequantiser: bit for bit the torch reference on both of its paths, the cache
reading through it unchanged, and a failed build falling back without leaving a file behind."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tuner import _kv_native
from tuner._kv_codec import dequantize_groups, pack_codes, quantize_groups, unpack_codes
from tuner.kv_cache import QuantizedKVCache


@pytest.fixture(autouse=True)
def fresh_library() -> Iterator[None]:
    """Each test loads (or refuses) the library under its own environment."""
    _kv_native.library.cache_clear()
    yield
    _kv_native.library.cache_clear()


def _part(x: torch.Tensor, bits: int, *, keys: bool, group: int, symmetric: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(packed, scale, zero, reference reconstruction) of ``x`` [b, h, t, d] as the cache
    stores keys (groups of tokens per channel) or values (groups of channels per token)."""
    b, h, t, d = x.shape
    grouped = x.reshape(b, h, t // group, group, d) if keys else x.reshape(b, h, t, d // group,
                                                                            group)
    q = quantize_groups(grouped, 3 if keys else 4, bits, symmetric=symmetric)
    packed = pack_codes(q.codes.reshape(b, h, t, d), bits)
    codes = unpack_codes(packed, bits).reshape(grouped.shape)
    reference = dequantize_groups(codes, q.scale, q.zero, bits).reshape(b, h, t, d)
    return packed, q.scale, q.zero, reference


@pytest.mark.parametrize("simd", [True, False], ids=["avx2-if-present", "portable"])
@pytest.mark.parametrize("bits", [2, 4, 6, 8])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 16), (40, 8), (128, 32), (96, 4), (8, 8)])
def test_the_kernel_reproduces_the_torch_reference_bit_for_bit(
        simd: bool, bits: int, symmetric: bool, head_dim: int, group: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + head_dim)
    # heavy tails and an outlier channel: scales far apart, as real keys have them
    x = torch.randn(2, 3, 2 * group, head_dim, generator=gen) ** 3
    x[..., 1] *= 40.0
    for keys in (True, False):
        packed, scale, zero, reference = _part(x, bits, keys=keys, group=group,
                                               symmetric=symmetric)
        out = torch.full_like(x, float("nan"))
        assert _kv_native.dequantize_into(out, packed, scale, zero, bits, keys=keys,
                                          group=group, simd=simd)
        assert torch.equal(out, reference), (keys, (out - reference).abs().max())


def test_the_kernel_writes_only_its_slice_of_a_larger_buffer() -> None:
    x = torch.randn(2, 4, 32, 64)
    packed, scale, zero, reference = _part(x, 4, keys=True, group=16, symmetric=False)
    buffer = torch.zeros(2, 4, 50, 64)
    assert _kv_native.dequantize_into(buffer[:, :, 9:41], packed, scale, zero, 4, keys=True,
                                      group=16)
    assert torch.equal(buffer[:, :, 9:41], reference)
    assert not buffer[:, :, :9].any() and not buffer[:, :, 41:].any()


def _filled(**kwargs: object) -> QuantizedKVCache:
    gen = torch.Generator().manual_seed(7)
    cache = QuantizedKVCache(2, 4, 64, group_size=16, residual_tokens=8, **kwargs)  # type: ignore[arg-type]
    for bits in (4, 2, 8):  # segments of several widths, then the residual window
        cache.set_bits(key_bits=bits, value_bits=bits)
        for layer in range(2):
            cache.append(layer, torch.randn(1, 4, 21, 64, generator=gen),
                         torch.randn(1, 4, 21, 64, generator=gen))
    return cache


def test_the_cache_reads_the_same_numbers_with_and_without_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _filled()
    assert len(cache.tokens_by_bits()) > 2  # three widths and the residual
    assert _kv_native.library() is not None
    fused = [cache.keys_values(layer) for layer in range(2)]
    monkeypatch.setenv("SEEDANCE_KV_NATIVE", "0")
    _kv_native.library.cache_clear()
    assert _kv_native.library() is None
    for layer, (k, v) in enumerate(fused):
        ref_k, ref_v = cache.keys_values(layer)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


@pytest.mark.parametrize("then_dtype", [torch.float32, torch.bfloat16])
def test_new_tokens_follow_the_cached_ones_in_one_buffer(then_dtype: torch.dtype) -> None:
    cache = _filled()
    new_k, new_v = torch.randn(1, 4, 3, 64).to(then_dtype), torch.randn(1, 4, 3, 64).to(then_dtype)
    keys, values = cache.keys_values(1, then=(new_k, new_v))
    old_k, old_v = cache.keys_values(1)
    assert keys.dtype == then_dtype and keys.shape == (1, 4, cache.layer_len(1) + 3, 64)
    assert torch.equal(keys, torch.cat((old_k.to(then_dtype), new_k), dim=2))
    assert torch.equal(values, torch.cat((old_v.to(then_dtype), new_v), dim=2))


def test_a_bfloat16_cache_keeps_its_rounding() -> None:
    """A cache of dtype bfloat16 returns what the torch path gives at that dtype (the kernel
    writes float32 only, so it stands aside)."""
    cache = _filled(dtype=torch.bfloat16)
    keys, _ = cache.keys_values(0)
    assert keys.dtype == torch.bfloat16
    keys32, _ = cache.keys_values(0, then=(torch.empty(1, 4, 0, 64), torch.empty(1, 4, 0, 64)))
    assert torch.equal(keys32, keys.float())


def test_without_a_compiler_the_cache_falls_back_and_leaves_nothing_behind(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SEEDANCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="tuner._kv_native"):
        assert _kv_native.library() is None
    (record,) = caplog.records
    assert "slower torch path" in record.getMessage()
    assert list(tmp_path.iterdir()) == []  # no half-written library
    cache = _filled()
    keys, _ = cache.keys_values(0)
    assert keys.shape == (1, 4, cache.layer_len(0), 64) and torch.isfinite(keys).all()


def test_a_build_is_cached_by_source_and_compiler(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("SEEDANCE_CACHE_DIR", str(tmp_path))
    first = _kv_native.library()
    assert first is not None
    (built,) = tmp_path.glob("kv_dequant-*.so")
    stamp = built.stat().st_mtime_ns
    _kv_native.library.cache_clear()
    assert _kv_native.library() is not None
    assert [p.name for p in tmp_path.iterdir()] == [built.name] and \
        built.stat().st_mtime_ns == stamp  # loaded again, not rebuilt


@pytest.mark.parametrize("simd", [True, False], ids=["avx2-if-present", "portable"])
def test_every_float16_scale_and_zero_converts_exactly(simd: bool) -> None:
    """Zeros and scales over all of float16's finite values, subnormals and -0 included."""
    every = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(
        torch.float16)
    finite = every[torch.isfinite(every)]
    n = finite.numel() // 64 * 64
    zero = finite[:n].reshape(1, 1, n // 64, 1, 64)  # keys: one per channel per group
    scale = finite[:n].flip(0).abs().reshape(1, 1, n // 64, 1, 64)
    codes = torch.randint(0, 16, (1, 1, n // 64, 16, 64), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(3))
    reference = dequantize_groups(codes, scale, zero, 4).reshape(1, 1, n // 4, 64)
    out = torch.empty_like(reference)
    packed = pack_codes(codes.reshape(1, 1, n // 4, 64), 4)
    assert _kv_native.dequantize_into(out, packed, scale, zero, 4, keys=True, group=16,
                                      simd=simd)
    assert torch.equal(out.isnan(), reference.isnan())
    assert torch.equal(out.nan_to_num(), reference.nan_to_num())
