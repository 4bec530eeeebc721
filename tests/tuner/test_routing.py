"""Routing: round-robin, the seed's load-aware rule (threshold, cooldown, formula, floor),
knob declarations; and, measured with real replica processes, load-aware routing against
round-robin when one replica is slowed."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from collectors._errors import SeedanceError
from tuner._knobs import KnobSpace
from tuner.routing import (
    ROUTING_KNOBS,
    SHARDING_KNOB,
    LoadAwareConfig,
    LoadAwareRouter,
    RoundRobinRouter,
)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_round_robin_cycles() -> None:
    router = RoundRobinRouter(3)
    assert [router.route() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.observe([9.0, 0.0, 0.0])  # ignored
    assert router.route() == 0


def test_equal_weights_route_exactly_round_robin_and_shares_follow_weights() -> None:
    router = LoadAwareRouter(2)
    assert [router.route() for _ in range(4)] == [0, 1, 0, 1]
    router = LoadAwareRouter(2, LoadAwareConfig(capacities=(3.0, 1.0)))
    counts = Counter(router.route() for _ in range(400))
    assert counts[0] == 300 and counts[1] == 100


def test_a_move_follows_the_seed_formula() -> None:
    clock = Clock()
    config = LoadAwareConfig(alpha=0.82, tau_s=45.0, threshold=0.15)
    router = LoadAwareRouter(2, config, clock=clock)
    router.observe([30.0, 10.0])
    (move,) = router.moves
    expected = min(0.5, 0.5) * 0.82 * (1 - math.exp(-20.0 / 45.0))
    assert (move.src, move.dst) == (0, 1)
    assert move.weight == pytest.approx(expected)
    assert router.weights == pytest.approx((0.5 - expected, 0.5 + expected))


def test_differences_under_the_threshold_do_not_move() -> None:
    router = LoadAwareRouter(2, LoadAwareConfig(threshold=0.15), clock=Clock())
    router.observe([10.0, 8.6])  # 1.4 < 0.15 * 10
    router.observe([0.0, 0.0])
    assert router.moves == [] and router.weights == (0.5, 0.5)
    router.observe([10.0, 8.4])
    assert len(router.moves) == 1


def test_a_pair_waits_out_its_cooldown_of_tau() -> None:
    clock = Clock()
    router = LoadAwareRouter(2, LoadAwareConfig(tau_s=5.0), clock=clock)
    router.observe([4.0, 0.0])
    clock.now_s = 4.9
    router.observe([4.0, 0.0])
    assert len(router.moves) == 1
    clock.now_s = 5.0
    router.observe([4.0, 0.0])
    assert len(router.moves) == 2


def test_weight_never_falls_below_the_floor() -> None:
    clock = Clock()
    router = LoadAwareRouter(2, LoadAwareConfig(alpha=1.0, tau_s=0.1, min_weight=0.05),
                             clock=clock)
    for step in range(20):
        clock.now_s = step
        router.observe([100.0, 0.0])
    assert router.weights[0] == pytest.approx(0.05)
    assert sum(router.weights) == pytest.approx(1.0)


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(SeedanceError, match="alpha"):
        LoadAwareConfig(alpha=0.0)
    with pytest.raises(SeedanceError, match="tau_s"):
        LoadAwareConfig(tau_s=0.0)
    with pytest.raises(SeedanceError, match="capacities"):
        LoadAwareRouter(3, LoadAwareConfig(capacities=(1.0, 1.0)))


def test_knobs_routing_is_live_and_sharding_waits_for_a_person() -> None:
    space = KnobSpace.of((*ROUTING_KNOBS, SHARDING_KNOB))
    assert space.defaults()["routing.alpha"] == 0.82
    assert space.defaults()["routing.tau_s"] == 45.0
    assert space.scope_of(["routing.alpha", "routing.tau_s"]) == "live"
    assert space.scope_of(["serving.sharding"]) == "restart"
    assert space.risk_of({"serving.sharding": "autoscale"}) == "high"


@pytest.mark.integration
def test_load_aware_routing_beats_round_robin_with_a_slow_replica() -> None:
    """Measured: two replica processes, replica 1 sleeps per step; same trace for both."""
    from workloads.serving_experiments import router_runs

    runs = router_runs(duration_s=8.0)
    rr, la = runs["round_robin"], runs["load_aware"]
    assert la["requests_per_replica"][0][1] < rr["requests_per_replica"][0][1]
    assert la["p99_s"] < rr["p99_s"], runs
