"""The sidecar's rollout thread (``tuner._tuning_loop.TuningLoop``) on its own: when it ticks."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest

from tuner import _tuning_loop
from tuner._tuning_loop import TuningLoop


def test_loops_started_together_spread_their_ticks_over_the_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sidecars of a fleet restarted at once tick at different instants of each interval,
    and no loop ticks again sooner than ``interval_s``."""
    monkeypatch.setattr(_tuning_loop, "_phases", random.Random(0))
    interval_s = 0.5
    ticks: dict[int, list[float]] = {}
    loops = []
    for i in range(6):
        loop = TuningLoop(None, interval_s=interval_s)  # type: ignore[arg-type]
        times = ticks.setdefault(i, [])

        def step(times: list[float] = times) -> Any:
            times.append(time.monotonic())

        loop.step = step  # type: ignore[method-assign]
        loops.append(loop)
    started = time.monotonic()
    for loop in loops:
        loop.start()
    deadline = started + 20
    while min(map(len, ticks.values())) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    for loop in loops:
        loop.shutdown()
    assert min(map(len, ticks.values())) >= 3, ticks
    for times in ticks.values():
        assert min(b - a for a, b in itertools.pairwise(times)) >= interval_s
    firsts = [times[0] for times in ticks.values()]
    assert max(firsts) - min(firsts) >= 0.3 * interval_s, firsts
