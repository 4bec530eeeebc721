"""The sequential test's verdict at the trial's budget: a promising trial is measured on."""

from __future__ import annotations

import pytest

from collectors import ConfigError
from tuner._change import Trip
from tuner._measure import Comparison
from tuner._verdict import RolloutConfig, decide


def _undecided(gain: float, pairs: int = 8) -> Comparison:
    """An interval that straddles zero, around ``gain``."""
    return Comparison(pairs=pairs, gain=gain, ci_low=-0.05, ci_high=gain + 0.2,
                      confidence=0.95, loss_excess=float("nan"), loss_ok=True)


def test_a_promising_trial_runs_on_past_its_budget_up_to_twice_it() -> None:
    config = RolloutConfig()  # a 90 s budget, +3% worth having
    assert config.promising_horizon_s == 180.0
    assert decide(_undecided(0.15), config, elapsed_s=60.0) is None
    assert decide(_undecided(0.15), config, elapsed_s=120.0) is None  # past 90 s, promising
    ended = decide(_undecided(0.15), config, elapsed_s=181.0)
    assert isinstance(ended, Trip) and ended.inconclusive
    assert ended.reason.startswith("no measured gain in the trial's 181 s: gain +15.00%")


def test_an_unpromising_trial_ends_at_its_budget() -> None:
    ended = decide(_undecided(0.01), RolloutConfig(), elapsed_s=91.0)
    assert isinstance(ended, Trip) and ended.inconclusive
    # and max_pairs ends any trial, promising or not
    ended = decide(_undecided(0.15, pairs=24), RolloutConfig(), elapsed_s=10.0)
    assert isinstance(ended, Trip) and "24 pairs" in ended.reason


def test_the_promising_budget_is_set_and_checked() -> None:
    config = RolloutConfig(trial_budget_s=60.0, promising_budget_s=90.0)
    assert decide(_undecided(0.15), config, elapsed_s=80.0) is None
    assert isinstance(decide(_undecided(0.15), config, elapsed_s=95.0), Trip)
    with pytest.raises(ConfigError, match="promising_budget_s must be >= trial_budget_s"):
        RolloutConfig(trial_budget_s=60.0, promising_budget_s=30.0)
