"""Prefix cache: policies, capacities, prewarm, metrics; and, measured on the real serving
engine under a Zipf prefix mix, pinning + prewarm against plain LRU at the same capacity."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from collectors._errors import SeedanceError
from collectors.torch_serving import ServingInstrumentation
from tests.collectors._otel_points import metric_points
from tuner._knobs import KnobSpace
from tuner.prefix_cache import PREFIX_CACHE_KNOBS, PrefixCache, PrefixCacheConfig


def _fill(cache: PrefixCache[str], keys: list[str]) -> None:
    for key in keys:
        if cache.get(key) is None:
            cache.put(key, key.upper(), 1)


def test_lru_evicts_the_least_recently_used() -> None:
    cache: PrefixCache[str] = PrefixCache(PrefixCacheConfig(capacity_entries=2))
    _fill(cache, ["a", "b", "a", "c"])  # b is the least recent when c arrives
    assert "a" in cache and "c" in cache and "b" not in cache
    assert cache.get("a") == "A"
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions) == (2, 3, 1)


def test_pinned_keeps_the_hot_prefix_through_a_burst_of_one_offs() -> None:
    traffic = ["hot"] * 5 + [f"tail{i}" for i in range(6)] + ["hot"]
    lru: PrefixCache[str] = PrefixCache(PrefixCacheConfig(capacity_entries=3))
    pinned: PrefixCache[str] = PrefixCache(PrefixCacheConfig(policy="pinned",
                                                             capacity_entries=3, pin_top_k=1))
    _fill(lru, traffic)
    _fill(pinned, traffic)
    assert pinned.pinned() == {"hot"}
    assert pinned.stats().hits == lru.stats().hits + 1  # the last "hot" only pinned keeps


def test_all_pinned_falls_back_to_lru() -> None:
    cache: PrefixCache[str] = PrefixCache(PrefixCacheConfig(policy="pinned",
                                                            capacity_entries=2, pin_top_k=5))
    _fill(cache, ["a", "b", "c"])
    assert len(cache) == 2 and "a" not in cache


def test_byte_capacity_binds_and_oversized_values_are_refused() -> None:
    cache: PrefixCache[str] = PrefixCache(PrefixCacheConfig(capacity_entries=10,
                                                            capacity_bytes=100))
    for key in "abc":
        assert cache.put(key, key, 40)
    assert cache.stats().bytes == 80 and "a" not in cache
    assert not cache.put("huge", "x", 101)


def test_shrinking_the_capacity_live_evicts_at_once() -> None:
    cache: PrefixCache[str] = PrefixCache(PrefixCacheConfig(capacity_entries=4))
    _fill(cache, list("abcd"))
    cache.config = PrefixCacheConfig(capacity_entries=2)
    assert len(cache) == 2 and "c" in cache and "d" in cache


def test_prewarm_computes_the_most_frequent_recent_prefixes() -> None:
    cache: PrefixCache[str] = PrefixCache(PrefixCacheConfig(capacity_entries=8,
                                                            prewarm_top_k=2))
    computed: list[str] = []

    def compute(key: object) -> tuple[str, int]:
        computed.append(str(key))
        if key == "broken":
            raise RuntimeError("no")
        return str(key).upper(), 1

    added = cache.prewarm(compute, history=["x", "y", "x", "z", "x", "y"])
    assert added == 2 and sorted(computed) == ["x", "y"]
    assert cache.get("x") == "X"
    # on demand, from the cache's own look-ups; a failing compute is skipped
    for _ in range(5):
        cache.get("broken")
    assert cache.prewarm(compute, top_k=4) == 1  # broken fails, x and y cached: z added
    assert "z" in cache and cache.stats().prewarmed == 3


def test_metrics_go_to_the_serving_instrumentation() -> None:
    reader = InMemoryMetricReader()
    ins = ServingInstrumentation(MeterProvider(metric_readers=[reader]).get_meter("t"),
                                 config_version=3)
    cache: PrefixCache[str] = PrefixCache(PrefixCacheConfig(capacity_entries=1), ins)
    _fill(cache, ["a", "a", "b"])
    points = metric_points(reader)
    total = {name: sum(r["value"] for r in rows) for name, rows in points.items()}
    assert total["seedance.serve.prefix_cache.hits"] == 1
    assert total["seedance.serve.prefix_cache.misses"] == 2
    assert total["seedance.serve.prefix_cache.queries"] == 3
    assert total["seedance.serve.prefix_cache.evictions"] == 1
    assert total["seedance.serve.prefix_cache.distinct_prefixes"] == 2  # a and b, last value


def test_knobs_build_a_config_and_bad_configs_name_the_field() -> None:
    space = KnobSpace.of(PREFIX_CACHE_KNOBS)
    values = space.validate({"prefix_cache.policy": "pinned",
                             "prefix_cache.capacity_entries": 4})
    config = PrefixCacheConfig.from_knobs(values)
    assert config.policy == "pinned" and config.capacity_entries == 4
    assert all(k.scope == "live" for k in PREFIX_CACHE_KNOBS)
    with pytest.raises(SeedanceError, match="capacity_entries"):
        PrefixCacheConfig(capacity_entries=0)
    with pytest.raises(SeedanceError, match="policy"):
        PrefixCacheConfig(policy="lfu")  # type: ignore[arg-type]


@pytest.mark.integration
def test_pinning_and_prewarm_beat_lru_on_the_real_serving_engine() -> None:
    """The same seeded Zipf trace through the real engine, capacity equal: pinning and
    prewarming hit more often. What that buys in latency is a timing, measured with repeats in
    ``bench/serving.py`` (``bench/results/serving.json``); one run's p99 of 70 requests is
    its slowest request, which a neighbour on a shared box decides."""
    from workloads.serving_experiments import policy_runs

    runs = policy_runs(requests=70, repeats=1)
    lru, warm = runs["lru"], runs["pinned+prewarm"]
    assert warm["hit_rate"] > lru["hit_rate"], runs
    assert all(r["lost"] == 0 for r in warm["runs"] + lru["runs"])
