"""Serving detectors over SYNTHETIC point streams (no serving fleet on this machine).

Every scenario here is made up from points (FrameStore.from_points) and labelled SYNTHETIC;
each detector has a positive and a healthy case, and the healthy one differs in the one
quantity the detector judges, so a detector that always (or never) fires fails a test.
"""

from __future__ import annotations

import pytest

from collectors import ConfigError, Point
from policies import FrameStore, StoreWindow
from policies.detectors import (
    KvDecompressionConfig,
    KvDecompressionCostDetector,
    LowCacheHitConfig,
    LowCacheHitRateDetector,
)

JOB = "serve-a"
S = 10**9
ATTRS = {"service.name": JOB}
INTERVALS = 10


def _window(points: list[Point]) -> StoreWindow:
    times = [p.time_ns for p in points]
    return StoreWindow(FrameStore.from_points(points), job=JOB, since_ns=min(times),
                       until_ns=max(times))


def kv_points(*, bits: int, batch: int, queue: int, dequant_s_per_interval: float,
              usage: float) -> list[Point]:
    """SYNTHETIC: 10 s intervals at 200 tokens/s, 64 MiB of KV held, ``usage`` of the cache."""
    points, dequant_sum, dequant_n = [], 0.0, 0
    for i in range(INTERVALS):
        t = 1000 * S + i * 10 * S
        dequant_sum += dequant_s_per_interval
        dequant_n += 2000
        points += [Point("seedance.serve.tokens_per_second", 200.0, t, ATTRS),
                   Point("seedance.serve.batch_size", float(batch), t, ATTRS),
                   Point("seedance.serve.queue_depth", float(queue), t, ATTRS),
                   Point("seedance.serve.kv_cache.bytes", 64.0 * 2**20, t, ATTRS),
                   Point("seedance.serve.kv_cache.usage", usage, t, ATTRS),
                   Point("seedance.serve.kv.dequantize.duration.sum", dequant_sum, t, ATTRS),
                   Point("seedance.serve.kv.dequantize.duration.count", float(dequant_n), t,
                         ATTRS)]
        points += [Point("seedance.serve.kv_cache.bits", float(bits), t,
                         {**ATTRS, "seedance.kv.part": part}) for part in ("key", "value")]
    return points


def test_kv_compression_flagged_when_batch_is_demand_limited() -> None:
    """SYNTHETIC: 4-bit KV, 8 requests and no queue, budget 320 MiB: the 256 MiB the batch
    needs at 16 bits fits, so compression frees memory nobody uses; dequantising costs 20 %."""
    points = kv_points(bits=4, batch=8, queue=0, dequant_s_per_interval=2.0, usage=0.2)
    findings = KvDecompressionCostDetector().evaluate(_window(points))
    assert len(findings) == 1
    finding = findings[0]
    values = {m.name: m.value for m in finding.evidence.measurements}
    assert values["batch_compressed"] == values["batch_uncompressed"]  # memory buys nothing
    assert values["throughput_gain"] < 0
    assert abs(values["kv_bytes_saved"] - 3 * 64 * 2**20) < 1  # 4 -> 16 bits: 4x the bytes
    assert {(c.knob, c.value) for c in finding.suggested_changes} == {
        ("kv.key_bits", 6), ("kv.value_bits", 6)}


def test_kv_dequantisation_is_weighed_against_the_copy_it_replaces() -> None:
    """SYNTHETIC: the demand-limited case above, on an engine that copies its uncompressed
    cache every step: each sequence's 32 MiB at 16 bits read at 20 GB/s (1.7 ms a token)
    costs more than dequantising (1 ms), so compression is not flagged; at 100 GB/s (0.34 ms)
    it still is, and the evidence gives the copy it weighed."""
    points = kv_points(bits=4, batch=8, queue=0, dequant_s_per_interval=2.0, usage=0.2)
    slow_copy = KvDecompressionConfig(uncompressed_read_bytes_per_s=20e9)
    assert KvDecompressionCostDetector(slow_copy).evaluate(_window(points)) == []
    fast_copy = KvDecompressionConfig(uncompressed_read_bytes_per_s=100e9)
    (finding,) = KvDecompressionCostDetector(fast_copy).evaluate(_window(points))
    values = {m.name: m.value for m in finding.evidence.measurements}
    assert abs(values["replaced_read_per_token"] - 32 * 2**20 / 100e9) < 1e-9
    assert values["throughput_gain"] < 0 and "100 GB/s" in finding.evidence.model
    with pytest.raises(ConfigError, match="uncompressed_read_bytes_per_s"):
        KvDecompressionConfig(uncompressed_read_bytes_per_s=0)


def test_kv_compression_healthy_when_freed_memory_admits_a_queue() -> None:
    """SYNTHETIC: same cost, budget 128 MiB and 56 requests queue: at 16 bits 4 sequences fit,
    compressed 16 do, and the bigger batch outweighs the dequantisation."""
    points = kv_points(bits=4, batch=8, queue=56, dequant_s_per_interval=2.0, usage=0.5)
    assert KvDecompressionCostDetector().evaluate(_window(points)) == []


def test_kv_compression_cheap_dequantise_not_flagged() -> None:
    """SYNTHETIC: demand-limited, but dequantising is 0.5 % of decode (under the 2 % floor)."""
    points = kv_points(bits=4, batch=8, queue=0, dequant_s_per_interval=0.05, usage=0.2)
    assert KvDecompressionCostDetector(KvDecompressionConfig()).evaluate(_window(points)) == []


def cache_points(*, rates: list[float], tail_follows_misses: bool) -> list[Point]:
    """SYNTHETIC: 100 look-ups per interval at the given hit rates; request-duration buckets
    where the slow share is the miss share (misses recompute the prefix) or a fixed 5 %."""
    bounds = ("0.1", "0.5", "2.0", "+Inf")
    points, hits, queries, cum = [], 0.0, 0.0, [0.0] * len(bounds)
    for i, rate in enumerate([1.0, *rates]):
        t = 1000 * S + i * 10 * S
        if i:
            hits, queries = hits + 100 * rate, queries + 100
            slow = round(100 * (1 - rate)) if tail_follows_misses else 5
            cum = [c + n for c, n in zip(cum, (100 - slow, 100 - slow // 2, 100, 100),
                                         strict=True)]
        points += [Point("seedance.serve.prefix_cache.hits", hits, t, ATTRS),
                   Point("seedance.serve.prefix_cache.queries", queries, t, ATTRS)]
        points += [Point("gen_ai.server.request.duration.bucket", c, t, {**ATTRS, "le": le})
                   for le, c in zip(bounds, cum, strict=True)]
    return points


LOW_RATES = [0.6, 0.3, 0.5, 0.2, 0.4, 0.35, 0.55, 0.25]


def test_low_hit_rate_that_tracks_p99_is_flagged() -> None:
    """SYNTHETIC: ~39 % hits and p99 worst in the intervals that miss most."""
    findings = LowCacheHitRateDetector().evaluate(
        _window(cache_points(rates=LOW_RATES, tail_follows_misses=True)))
    assert len(findings) == 1
    values = {m.name: m.value for m in findings[0].evidence.measurements}
    assert values["hit_rate"] < 0.7
    assert values["rate_p99_correlation"] <= -0.5
    assert {c.knob for c in findings[0].suggested_changes} == {
        "prefix_cache.policy", "prefix_cache.prewarm_top_k", "prefix_cache.capacity_entries"}


def test_low_hit_rate_with_flat_tail_not_flagged_unless_slo_broken() -> None:
    """SYNTHETIC: same low hit rate, p99 independent of it: no finding without an SLO; with
    an SLO below the measured p99 the SLO rule fires instead."""
    window = _window(cache_points(rates=LOW_RATES, tail_follows_misses=False))
    assert LowCacheHitRateDetector().evaluate(window) == []
    slo = LowCacheHitRateDetector(LowCacheHitConfig(p99_slo_s=0.2)).evaluate(window)
    assert len(slo) == 1


def test_high_hit_rate_not_flagged() -> None:
    """SYNTHETIC: ~90 % hits, even though the few misses still track p99."""
    rates = [0.9, 0.85, 0.95, 0.88, 0.92, 0.87, 0.93, 0.9]
    assert LowCacheHitRateDetector().evaluate(
        _window(cache_points(rates=rates, tail_follows_misses=True))) == []
