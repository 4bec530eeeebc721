"""GenerationalMap: per-series state that forgets series which stopped arriving."""

from __future__ import annotations

import pytest

from collectors._generations import GenerationalMap


def test_an_entry_used_once_per_period_stays_and_an_unused_one_goes() -> None:
    now = [0.0]
    cache: GenerationalMap[str, int] = GenerationalMap(10.0, clock=lambda: now[0])
    cache["used"], cache["idle"] = 1, 2
    for _ in range(5):
        now[0] += 10.0
        dropped = cache.expire()
        assert cache.get("used") == 1
    assert cache.get("idle") is None
    assert len(cache) == 1 and dropped == {}  # "idle" went in an earlier rotation


def test_expire_returns_what_it_dropped_only_once_the_period_is_up() -> None:
    now = [0.0]
    cache: GenerationalMap[str, int] = GenerationalMap(10.0, clock=lambda: now[0])
    cache["a"] = 1
    now[0] = 9.0
    assert cache.expire() == {}
    now[0] = 10.0
    assert cache.expire() == {}  # "a" moved to the previous generation: still readable
    now[0] = 20.0
    assert cache.expire() == {"a": 1}
    assert cache.get("a") is None and len(cache) == 0


def test_a_long_silence_drops_both_generations_at_once() -> None:
    now = [0.0]
    cache: GenerationalMap[str, int] = GenerationalMap(10.0, clock=lambda: now[0])
    cache["a"] = 1
    now[0] = 25.0
    assert cache.expire() == {"a": 1}


def test_the_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="idle_s"):
        GenerationalMap(0.0)
