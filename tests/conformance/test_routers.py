"""Every router keeps the ``tuner.routing.Router`` contract: each request goes to a replica
that exists, traffic over many requests follows ``weights`` (which sum to 1), and equal loads
move nothing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from tuner.routing import LoadAwareRouter, RoundRobinRouter, Router

ROUTERS: dict[str, Callable[[int], Router]] = {
    "round_robin": RoundRobinRouter,
    "load_aware": LoadAwareRouter,
}


def test_every_router_is_covered() -> None:
    """A new Router subclass must be added to ROUTERS (and so to this suite)."""
    assert {c.__name__ for c in Router.__subclasses__()
            if not c.__module__.startswith("tests.")} == {
        f(1).__class__.__name__ for f in ROUTERS.values()}


@pytest.mark.parametrize("make", ROUTERS.values(), ids=ROUTERS.keys())
@pytest.mark.parametrize("replicas", [1, 3])
def test_requests_go_to_replicas_in_the_shares_of_the_weights(
        make: Callable[[int], Router], replicas: int) -> None:
    router = make(replicas)
    assert len(router.weights) == replicas
    assert sum(router.weights) == pytest.approx(1.0)
    picks = Counter(router.route() for _ in range(300 * replicas))
    assert set(picks) <= set(range(replicas))
    for i, w in enumerate(router.weights):
        assert picks[i] / (300 * replicas) == pytest.approx(w, abs=0.02)


@pytest.mark.parametrize("make", ROUTERS.values(), ids=ROUTERS.keys())
def test_equal_loads_move_nothing(make: Callable[[int], Router]) -> None:
    router = make(3)
    before = router.weights
    router.observe([2.0, 2.0, 2.0])
    router.observe([0.0, 0.0, 0.0])
    assert router.weights == pytest.approx(before)
