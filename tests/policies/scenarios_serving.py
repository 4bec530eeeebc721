"""Serving detector scenarios for bench/detection.py: SYNTHETIC point streams.

There is no serving fleet with a KV budget or a prefix cache behind a load balancer on this
machine, so these reuse the synthetic streams of tests/policies/test_detectors_serving.py. The
fault (or its absence) holds over the whole stream: one evaluation at the stream's end, onset 0
for a positive scenario, so the bench reports detection and false positives, not a delay.
"""

from __future__ import annotations

from collections.abc import Callable

from collectors import Point
from policies import FrameStore
from policies.detectors import KvDecompressionCostDetector, LowCacheHitRateDetector
from tests.policies.scenarios_hardware import JOB, Built, Scenario
from tests.policies.test_detectors_serving import LOW_RATES, cache_points, kv_points

HIGH_RATES = [0.9, 0.85, 0.95, 0.88, 0.92, 0.87, 0.93, 0.9]


def _whole(points: Callable[[], list[Point]], positive: bool) -> Callable[[], Built]:
    def build() -> Built:
        stream = [Point(p.name, p.value, p.time_ns, {**p.attributes, "service.name": JOB})
                  for p in points()]
        times = sorted({p.time_ns for p in stream})
        span_s = (times[-1] - times[0]) / 1e9
        return Built(FrameStore.from_points(stream), [times[-1]], 0 if positive else None,
                     span_s)
    return build


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("positive_kv_demand_limited", "kv_decompression_cost", "synthetic", _whole(
        lambda: kv_points(bits=4, batch=8, queue=0, dequant_s_per_interval=2.0, usage=0.2),
        True), KvDecompressionCostDetector),
    Scenario("healthy_kv_queue_admitted", "kv_decompression_cost", "synthetic", _whole(
        lambda: kv_points(bits=4, batch=8, queue=56, dequant_s_per_interval=2.0, usage=0.5),
        False), KvDecompressionCostDetector),
    Scenario("healthy_kv_cheap_dequantise", "kv_decompression_cost", "synthetic", _whole(
        lambda: kv_points(bits=4, batch=8, queue=0, dequant_s_per_interval=0.05, usage=0.2),
        False), KvDecompressionCostDetector),
    Scenario("positive_low_hit_rate_tracks_p99", "low_cache_hit_rate", "synthetic", _whole(
        lambda: cache_points(rates=LOW_RATES, tail_follows_misses=True), True),
        LowCacheHitRateDetector),
    Scenario("healthy_low_hit_rate_flat_tail", "low_cache_hit_rate", "synthetic", _whole(
        lambda: cache_points(rates=LOW_RATES, tail_follows_misses=False), False),
        LowCacheHitRateDetector),
    Scenario("healthy_high_hit_rate", "low_cache_hit_rate", "synthetic", _whole(
        lambda: cache_points(rates=HIGH_RATES, tail_follows_misses=True), False),
        LowCacheHitRateDetector),
)
