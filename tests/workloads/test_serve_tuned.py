"""The serving engine takes a live config between decode steps (real engine, real model)."""

from __future__ import annotations

import dataclasses

import pytest

from tuner.kv_cache import QuantizedKVCache
from tuner.prefix_cache import PrefixCacheConfig
from workloads import loadgen
from workloads.serve_tuned import KNOBS, TunedConfig, build_engine, closed_loop, requests, serve

CONFIG = TunedConfig(load=loadgen.LoadConfig(n_prefixes=8), concurrency=4, max_batch=2,
                     kv_bits=(8, 8), prefix_cache=PrefixCacheConfig(capacity_entries=2),
                     quality_every=1, quality_min_tokens=1)


def test_apply_knobs_switches_kv_bits_prefix_cache_and_delay_between_steps() -> None:
    engine = build_engine(CONFIG)
    source = requests(CONFIG.load)
    for _ in range(4):
        engine.submit(next(source))
    engine.step()  # two running requests with 8-bit caches
    running = [r.cache for r in engine._running]
    assert running and all(isinstance(c, QuantizedKVCache) and c.bits(0) == (8, 8)
                           for c in running)
    engine.apply_knobs({**CONFIG.knob_values, "kv.key_bits": 16, "kv.value_bits": 4,
                        "prefix_cache.capacity_entries": 1, "serving.step_delay_s": 0.01})
    assert engine.config.kv_bits == (16, 4)
    assert all(c.bits(0) == (16, 4) for c in running)  # tokens from now on
    fresh = engine._new_cache()
    assert isinstance(fresh, QuantizedKVCache) and fresh.bits(3) == (16, 4)
    assert engine.prefix_cache.config.capacity_entries == 1 and len(engine.prefix_cache) <= 1
    assert engine.config.step_delay_s == 0.01
    assert not engine._checked  # the quality sample restarts with the config
    engine.apply_knobs({"routing.policy": "load_aware"})  # a launcher's knob: not the replica's
    assert engine.config.kv_bits == (16, 4)
    finished = []
    while not engine.idle:  # the running requests finish under the new config
        finished += engine.step()
    assert len(finished) == 4 and all(c.tokens for c in finished)
    summary = closed_loop(build_engine(CONFIG), requests(CONFIG.load), duration_s=1.0,
                          concurrency=2)
    assert summary["requests"] >= 1 and summary["tokens"] >= summary["requests"]


def test_the_job_declares_what_it_applies_and_serves_without_a_sidecar() -> None:
    names = {k.name for k in KNOBS}
    assert {"kv.key_bits", "kv.value_bits", "prefix_cache.capacity_entries",
            "serving.step_delay_s"} <= names
    assert set(CONFIG.knob_values) == names
    summary = serve(dataclasses.replace(CONFIG, concurrency=2), sidecar=None, job="t",
                    duration_s=1.0)
    assert summary["switches"] == [] and summary["requests"] >= 1
    assert summary["final"]["kv.key_bits"] == 8
    with pytest.raises(ValueError, match="concurrency"):
        TunedConfig(concurrency=0)


def test_closed_loop_measures_only_after_its_warm_up() -> None:
    engine = build_engine(CONFIG)
    completed: list[int] = []
    step = engine.step

    def counting_step() -> list:  # type: ignore[type-arg]
        done = step()
        completed.extend(c.id for c in done)
        return done

    engine.step = counting_step  # type: ignore[method-assign]
    summary = closed_loop(engine, requests(CONFIG.load), duration_s=0.5, concurrency=2,
                          warmup_s=0.5)
    assert summary["elapsed_s"] >= 0.5
    assert 1 <= summary["requests"] < len(completed)  # the warm-up's completions not counted
