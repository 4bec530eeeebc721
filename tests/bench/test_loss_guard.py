"""The loss-guard bench's two readings of a window: the gauge's (the last step's loss at each
export) and every step's; its new verdicts come from the rollout's own ``compare``."""

from __future__ import annotations

import numpy as np
import pytest

from bench.loss_guard import judge, window_loss
from tuner._windows import MeasureConfig


def test_the_gauge_reading_is_the_last_step_before_each_export() -> None:
    steps = [(0.3, 1.0), (0.8, 2.0), (1.2, 3.0), (1.9, 4.0), (2.4, 5.0)]
    assert window_loss(steps, "readings", 1.0) == [2.0, 4.0, 5.0]
    assert window_loss(steps, "steps", 1.0) == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_one_noisy_step_per_export_trips_where_every_steps_mean_does_not() -> None:
    """An A/A on a flat loss: every window's steps average 2.0, but the step just before
    each candidate window's exports is 20% high (one unlucky mini-batch a second)."""
    recorded, t = [], 0.0
    for index in range(6):
        arm = "candidate" if index % 2 == 0 else "baseline"
        losses = np.full(10, 2.0)
        if arm == "candidate":
            losses[[4, 9]] = 2.4
            losses[[0, 1, 2, 3, 5, 6, 7, 8]] -= 0.8 / 8
        steps = [(t + 0.2 * (i + 1) - 0.01, float(x)) for i, x in enumerate(losses)]
        recorded.append({"arm": arm, "start_s": t, "steps": steps})
        t += 2.0
    [verdict] = judge(recorded, MeasureConfig(), min_pairs=3, export_s=1.0)
    assert verdict["new_excess"] == pytest.approx(0.0, abs=1e-12)
    assert not verdict["new_trip"] and not verdict["steps_old_rule_trip"]
    assert verdict["old_excess"] > 0.05 and verdict["old_trip"]
    assert verdict["readings_new_rule_trip"]
