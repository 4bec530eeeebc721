"""ServingInstrumentation driven by a scripted request sequence on a controllable clock."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

from collectors import SeedanceError  # noqa: E402
from collectors.torch_serving import ServingInstrumentation, tensor_bytes  # noqa: E402
from tests.collectors._otel_points import metric_points  # noqa: E402

V1 = {"seedance.config.version": 1, "seedance.rank": 3}
V2 = {"seedance.config.version": 2, "seedance.rank": 3}


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def serving(clock: Clock, reader: InMemoryMetricReader) -> ServingInstrumentation:
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    return ServingInstrumentation(
        meter, config_version=1, attributes={"seedance.rank": 3}, clock=clock, rate_window_s=10.0
    )


def _only(points: dict[str, list[dict[str, Any]]], name: str) -> dict[str, Any]:
    assert len(points[name]) == 1, points[name]
    return points[name][0]


# (time_s, call, request id) — two overlapping requests; times are exact binary fractions.
SCRIPT = [
    (1.0, "request_started", "a"),
    (2.5, "request_started", "b"),
    (3.0, "first_token", "a"),
    (3.5, "token", "a"),
    (4.0, "first_token", "b"),
    (4.5, "token", "a"),
    (4.5, "token", "b"),
    (5.0, "request_finished", "a"),
    (6.0, "request_finished", "b"),
]


def _play(serving: ServingInstrumentation, clock: Clock) -> dict[str, int]:
    output_tokens = {"a": 0, "b": 0}
    for time_s, call, req_id in SCRIPT:
        clock.now_s = time_s
        if call in ("first_token", "token"):
            output_tokens[req_id] += 1
        if call == "request_finished":
            serving.request_finished(req_id, output_tokens[req_id])
        else:
            getattr(serving, call)(req_id)
    return output_tokens


def _times(call: str) -> dict[str, float]:
    return {req_id: t for t, c, req_id in SCRIPT if c == call}


def test_latency_histograms_are_exact(
    serving: ServingInstrumentation, clock: Clock, reader: InMemoryMetricReader
) -> None:
    output_tokens = _play(serving, clock)
    started, first, finished = (
        _times("request_started"), _times("first_token"), _times("request_finished")
    )
    ttft = [first[r] - started[r] for r in started]
    e2e = [finished[r] - started[r] for r in started]
    tpot = [(finished[r] - first[r]) / (output_tokens[r] - 1) for r in started]
    points = metric_points(reader)
    for name, values in (("gen_ai.server.time_to_first_token", ttft),
                         ("gen_ai.server.request.duration", e2e),
                         ("gen_ai.server.time_per_output_token", tpot)):
        assert _only(points, name) == {"attributes": V1, "count": 2, "sum": sum(values)}


def test_tokens_per_second_over_the_window(
    serving: ServingInstrumentation, clock: Clock, reader: InMemoryMetricReader
) -> None:
    output_tokens = _play(serving, clock)
    # The server is 6 s old, younger than the 10 s window: every token so far over 6 s.
    assert _only(metric_points(reader), "seedance.serve.tokens_per_second") == {
        "attributes": V1, "value": sum(output_tokens.values()) / clock.now_s,
    }
    clock.now_s = 14.0  # window (4, 14]: only the tokens at 4.5 s remain
    in_window = [t for t, c, _ in SCRIPT if c in ("first_token", "token") and t > 4.0]
    assert _only(metric_points(reader), "seedance.serve.tokens_per_second") == {
        "attributes": V1, "value": len(in_window) / 10.0,
    }


def test_a_request_that_straddles_a_config_change_counts_for_neither(
    serving: ServingInstrumentation, clock: Clock, reader: InMemoryMetricReader
) -> None:
    version = {"now": 1}
    serving.config_version = lambda: version["now"]  # as a lease client hands it in
    serving.request_started("old")
    version["now"] = 2
    clock.now_s = 1.0
    serving.request_started("new")
    clock.now_s = 2.0
    for req_id in ("old", "new"):
        serving.first_token(req_id)
        serving.token(req_id)
    clock.now_s = 4.0
    for req_id in ("old", "new"):
        serving.request_finished(req_id, output_tokens=2)
    points = metric_points(reader)
    assert _only(points, "gen_ai.server.time_to_first_token") == {
        "attributes": V2, "count": 1, "sum": 1.0}
    assert _only(points, "gen_ai.server.request.duration") == {
        "attributes": V2, "count": 1, "sum": 3.0}
    assert _only(points, "gen_ai.server.time_per_output_token") == {
        "attributes": V2, "count": 1, "sum": 2.0}


def test_calls_about_unknown_requests_are_ignored(
    serving: ServingInstrumentation, clock: Clock, reader: InMemoryMetricReader
) -> None:
    serving.first_token("ghost")
    serving.token("ghost")
    serving.request_finished("ghost", output_tokens=3)
    serving.request_started("once")
    serving.request_finished("once", output_tokens=0)  # aborted before any token
    points = metric_points(reader)
    assert "gen_ai.server.time_to_first_token" not in points
    assert "gen_ai.server.time_per_output_token" not in points
    assert _only(points, "gen_ai.server.request.duration")["count"] == 1


def test_load_kv_cache_and_prefix_cache(
    serving: ServingInstrumentation, reader: InMemoryMetricReader
) -> None:
    keys = torch.zeros(2, 4, 8, dtype=torch.int8)
    values = torch.zeros(2, 4, 8, dtype=torch.float16)
    kv_bytes = tensor_bytes([keys, values])
    assert kv_bytes == keys.numel() * 1 + values.numel() * 2
    serving.set_batch_size(3)
    serving.set_queue_depth(5)
    serving.set_kv_cache(size_bytes=kv_bytes, key_bits=4, value_bits=8)
    serving.prefix_cache_hit(2)
    serving.prefix_cache_miss()
    serving.prefix_cache_evicted(3)
    points = metric_points(reader)
    assert _only(points, "seedance.serve.batch_size") == {"attributes": V1, "value": 3}
    assert _only(points, "seedance.serve.queue_depth") == {"attributes": V1, "value": 5}
    assert _only(points, "seedance.serve.kv_cache.bytes") == {"attributes": V1, "value": kv_bytes}
    bits = {p["attributes"]["seedance.kv.part"]: p["value"]
            for p in points["seedance.serve.kv_cache.bits"]}
    assert bits == {"key": 4, "value": 8}
    for name, value in (("seedance.serve.prefix_cache.hits", 2),
                        ("seedance.serve.prefix_cache.misses", 1),
                        ("seedance.serve.prefix_cache.queries", 3),
                        ("seedance.serve.prefix_cache.evictions", 3)):
        assert _only(points, name) == {"attributes": V1, "value": value}


def test_checked_tokens_count_for_the_version_they_ran_under(
    serving: ServingInstrumentation, reader: InMemoryMetricReader
) -> None:
    serving.tokens_checked(24, 20)
    serving.tokens_checked(10, 10, version=2)
    serving.tokens_checked(8, 7)
    points = metric_points(reader)
    for name, v1, v2 in (("seedance.serve.quality.checked_tokens", 32, 10),
                         ("seedance.serve.quality.agreeing_tokens", 27, 10)):
        assert sorted(points[name], key=lambda p: p["attributes"]["seedance.config.version"]) \
            == [{"attributes": V1, "value": v1}, {"attributes": V2, "value": v2}]
    with pytest.raises(SeedanceError, match=r"agreeing tokens must be in \[0, checked=3\]"):
        serving.tokens_checked(3, 4)


def test_quantise_timing_skips_blocks_that_raise(
    serving: ServingInstrumentation, clock: Clock, reader: InMemoryMetricReader
) -> None:
    with serving.quantize():
        clock.now_s += 0.25
    with serving.dequantize():
        clock.now_s += 0.125
    with pytest.raises(RuntimeError), serving.dequantize():
        clock.now_s += 1.0
        raise RuntimeError("decode failed")
    points = metric_points(reader)
    assert _only(points, "seedance.serve.kv.quantize.duration") == {
        "attributes": V1, "count": 1, "sum": 0.25}
    assert _only(points, "seedance.serve.kv.dequantize.duration") == {
        "attributes": V1, "count": 1, "sum": 0.125}


def test_every_point_carries_the_config_version(
    serving: ServingInstrumentation, clock: Clock, reader: InMemoryMetricReader
) -> None:
    _play(serving, clock)
    serving.set_kv_cache(size_bytes=1, key_bits=16, value_bits=16)
    with serving.quantize():
        pass
    serving.prefix_cache_miss()
    for rows in metric_points(reader).values():
        for row in rows:
            assert row["attributes"]["seedance.config.version"] == 1


def test_concurrent_requests_are_all_counted(reader: InMemoryMetricReader) -> None:
    serving = ServingInstrumentation(
        MeterProvider(metric_readers=[reader]).get_meter("test"), config_version=1
    )
    threads, per_thread = 8, 200

    def run(worker: int) -> None:
        for i in range(per_thread):
            req_id = (worker, i)
            serving.request_started(req_id)
            serving.first_token(req_id)
            serving.token(req_id)
            serving.request_finished(req_id, output_tokens=2)

    workers = [threading.Thread(target=run, args=(w,)) for w in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    points = metric_points(reader)
    for name in ("gen_ai.server.time_to_first_token", "gen_ai.server.request.duration",
                 "gen_ai.server.time_per_output_token"):
        assert _only(points, name)["count"] == threads * per_thread
