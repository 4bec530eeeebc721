"""Serving workload: cached decode is exact, a prefix hit changes nothing but the work, the load
is seeded, and the guardrails read the metrics the engine really exports."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from collectors._otel import TelemetryConfig, setup_telemetry
from collectors._otlp_decode import DecodedMetrics
from collectors._points import Point
from policies import histogram_quantile
from policies._window import FrameStore, StoreWindow
from tests.collectors.test_otel import (  # noqa: F401 (otlp_http is a fixture)
    _OtlpHttpSink,
    metric_names,
    otlp_http,
    parse_requests,
    resource_attrs,
)
from tuner.prefix_cache import PrefixCacheConfig
from tuner.serving_guardrails import (
    AGREEING_TOKENS_METRIC,
    CHECKED_TOKENS_METRIC,
    QUALITY_METRIC,
    ServingGuardrailConfig,
    check_guardrails,
    window_agreement,
)
from workloads import loadgen
from workloads.gpt import GPTConfig
from workloads.serve import build_model, quantile
from workloads.serve_engine import Engine, ReplicaConfig, quantized_cache_factory

MODEL = GPTConfig(n_layer=2, n_head=2, n_embd=64)
LOAD = loadgen.LoadConfig(rate_rps=50.0, duration_s=1.0, n_prefixes=4, prefix_tokens=24,
                          seed=3)


def _engine(**kwargs: object) -> Engine:
    torch.set_num_threads(1)
    model = build_model(MODEL, 0)
    kv = quantized_cache_factory(MODEL, key_bits=32, value_bits=32, group_size=16,
                                 residual_tokens=4)
    return Engine(model, kv, ReplicaConfig(**kwargs))  # type: ignore[arg-type]


def _serve(engine: Engine, requests: list[loadgen.Request]) -> dict[int, tuple[int, ...]]:
    for r in requests:
        engine.submit(r)
    out = {}
    while not engine.idle:
        out.update({c.id: c.tokens for c in engine.step()})
    return out


def test_batched_cached_decode_matches_a_cache_free_forward() -> None:
    requests = loadgen.generate(LOAD)[:12]
    engine = _engine(max_batch=5, quality_every=1)
    tokens = _serve(engine, requests)
    assert len(tokens) == 12
    checked = list(engine._checked)
    assert len(checked) == sum(r.max_new_tokens for r in requests)
    assert all(checked)


def test_a_prefix_hit_gives_the_same_tokens_as_a_miss() -> None:
    requests = loadgen.generate(LOAD)[:10]
    cached = _engine(prefix_cache=PrefixCacheConfig(capacity_entries=8))
    uncached = _engine(prefix_cache=PrefixCacheConfig(capacity_entries=1, capacity_bytes=1))
    assert _serve(cached, requests) == _serve(uncached, requests)
    assert cached.prefix_cache.stats().hits > 0 and uncached.prefix_cache.stats().hits == 0


def test_the_load_is_seeded_and_the_prefix_mix_is_zipf() -> None:
    config = loadgen.LoadConfig(rate_rps=200.0, duration_s=10.0, n_prefixes=16, seed=1)
    trace = loadgen.generate(config)
    assert trace == loadgen.generate(config)
    assert trace != loadgen.generate(loadgen.LoadConfig(**{**config.__dict__, "seed": 2}))
    gaps = np.diff([r.arrival_s for r in trace])
    assert gaps.mean() == pytest.approx(1 / 200.0, rel=0.15)
    counts = Counter(r.prefix_id for r in trace)
    assert counts[0] > counts[1] > counts[8]
    assert all(r.prompt[:r.prefix_len] == loadgen.prefixes(config)[r.prefix_id] for r in trace)
    assert max(len(r.prompt) + r.max_new_tokens for r in trace) <= config.max_tokens


def test_quantile_is_an_exact_order_statistic() -> None:
    values = np.arange(1, 101, dtype=float)
    assert quantile(values, 0.99) == 99.0 and quantile(values, 0.5) == 50.0


def test_histogram_quantile_interpolates_and_flags_the_overflow_bucket() -> None:
    assert histogram_quantile(0.5, {1.0: 0, 2.0: 10, math.inf: 10}) == pytest.approx(1.5)
    assert histogram_quantile(0.99, {1.0: 50, math.inf: 100}) == math.inf
    assert math.isnan(histogram_quantile(0.99, {}))


def test_guardrails_read_the_engines_exported_latency_and_quality() -> None:
    points: list[Point] = []

    def sink(decoded: DecodedMetrics) -> None:
        points.extend(decoded.points)

    telemetry = setup_telemetry(TelemetryConfig(job="serve-test", export_interval_s=3600.0),
                                store_sink=sink)
    try:
        engine = _engine(quality_every=1)
        engine = Engine(engine.model, engine._new_cache, engine.config,
                        meter=telemetry.meter("workloads.serve"))
        _serve(engine, loadgen.generate(LOAD)[:30])
        telemetry.force_flush()
    finally:
        telemetry.shutdown()
    store = FrameStore.from_points(points)
    times = [p.time_ns for p in points]
    window = StoreWindow(store, job="serve-test", since_ns=min(times), until_ns=max(times))
    whole = dict(series_start_in_window=True, min_requests=10)
    assert check_guardrails(window, ServingGuardrailConfig(p99_slo_s=60.0, **whole)) == []
    (breach,) = check_guardrails(window, ServingGuardrailConfig(p99_slo_s=1e-6, **whole))
    assert "over 30 requests" in breach
    # unquantised cache: every sampled token agrees, so even the strictest bound holds
    strict = ServingGuardrailConfig(p99_slo_s=60.0, min_token_agreement=1.0, **whole)
    assert check_guardrails(window, strict) == []
    # the agreement is judged on the counted tokens: every request was checked
    counted = window_agreement(window, strict)
    generated = sum(int(p.value) for p in points if p.name == "seedance.serve.generation_tokens")
    assert counted is not None and counted.agreement == 1.0
    assert 0 < counted.tokens <= generated
    # one export per series and no claim that the series started in the window: no verdict
    assert check_guardrails(window, ServingGuardrailConfig(p99_slo_s=1e-6)) == []


def test_quality_below_its_bound_is_a_breach() -> None:
    """Synthetic points (labelled so): the check itself, for a degraded KV cache."""
    frame = pd.DataFrame({"time": [1, 2], "value": [0.9, 0.92], "service.name": ["j", "j"]})
    store = FrameStore({QUALITY_METRIC: frame})
    (breach,) = check_guardrails(StoreWindow(store, job="j", since_ns=0, until_ns=10),
                                 ServingGuardrailConfig(min_token_agreement=0.95))
    assert "token agreement 0.9100" in breach


def test_the_quantised_kv_cache_serves_and_its_quality_is_measured() -> None:
    requests = loadgen.generate(LOAD)[:10]
    plain = _engine(quality_every=1)
    quantised = Engine(plain.model, quantized_cache_factory(
        MODEL, key_bits=2, value_bits=2, group_size=16, residual_tokens=4),
        ReplicaConfig(quality_every=1, kv_bits=(2, 2)))
    assert len(_serve(quantised, requests)) == len(_serve(plain, requests)) == 10
    agreement = sum(quantised._checked) / len(quantised._checked)
    assert 0.0 <= agreement <= sum(plain._checked) / len(plain._checked) == 1.0


@pytest.mark.integration
def test_replica_processes_export_to_the_sidecar_over_otlp(
        otlp_http: _OtlpHttpSink) -> None:  # noqa: F811 (the imported fixture)
    """``python -m workloads.serve`` with two replica processes and the quantised KV cache."""
    port = otlp_http.server_address[1]
    proc = subprocess.run(
        [sys.executable, "-m", "workloads.serve", "--replicas", "2", "--rate-rps", "8",
         "--duration-s", "2", "--prefix-tokens", "32",
         "--kv-bits", "8", "8", "--quality-every", "2", "--job", "serve-otlp",
         "--otlp-endpoint", f"http://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["requests"] > 0 and summary["lost"] == 0
    assert sum(summary["requests_per_replica"]) == summary["requests"]
    requests = parse_requests([body for path, _, body in otlp_http.requests
                               if path == "/v1/metrics"])
    assert {resource_attrs(r)["seedance.rank"] for r in requests} == {0, 1}
    assert {resource_attrs(r)["service.name"] for r in requests} == {"serve-otlp"}
    names = metric_names(requests)
    assert {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
            "seedance.serve.prefix_cache.queries", "seedance.serve.kv_cache.bytes",
            QUALITY_METRIC, CHECKED_TOKENS_METRIC, AGREEING_TOKENS_METRIC} <= names



def test_without_an_slo_only_the_quality_bound_is_checked() -> None:
    """Synthetic points (labelled so): the default guardrail every serving job gets."""
    now = 10**18
    slow = {"service.name": "serve", "le": "+Inf"}
    store = FrameStore.from_points([
        Point("seedance.serve.quality.token_agreement", 0.9, now, {"service.name": "serve"}),
        Point("gen_ai.server.request.duration.bucket", 100.0, now, slow)])
    window = StoreWindow(store, job="serve", since_ns=now - 1, until_ns=now + 1)
    whole = dict(series_start_in_window=True, min_requests=10)
    (breach,) = check_guardrails(window, ServingGuardrailConfig(**whole))
    assert "token agreement" in breach  # and no latency verdict: no SLO was set
