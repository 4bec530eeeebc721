"""How ``bench/fleet_priors.py`` counts the trials to a kept config: the same rule for the
cold and the warm search, the rollout's resolution beside the strict count."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from bench.fleet_priors import MIN_GAIN, trials_to

LAUNCH = SimpleNamespace(launch={"threads": 2, "micro_batch": 4, "precision.all": "fp32"})


def run(*steps: tuple[str, float]) -> dict[str, Any]:
    return {"trials": [{"baseline_after": config, "baseline_relative": relative}
                       for config, relative in steps]}


def test_reaching_k_counts_the_config_itself_or_one_within_the_rollouts_resolution() -> None:
    k, k_relative = "t2/mb8/bf16", 1.50
    search = run(("t2/mb8/fp32", 1.20), ("t2/mb16/bf16", 1.49), ("t2/mb8/bf16", 1.50))
    # 1.49 is within 3% of 1.50: a change from it to K would not be kept
    assert trials_to(search, k, k_relative, LAUNCH, resolution=MIN_GAIN) == (
        2, "a config measured within 3%")
    assert trials_to(search, k, k_relative, LAUNCH) == (3, "the same config")
    # 1.40 is not: the count goes on to K itself
    below = run(("t2/mb16/bf16", 1.40), ("t2/mb8/bf16", 1.50))
    assert trials_to(below, k, k_relative, LAUNCH, resolution=MIN_GAIN) == (
        2, "the same config")
    faster = run(("t1/mb8/bf16", 1.60))
    assert trials_to(faster, k, k_relative, LAUNCH) == (1, "a config measured at least as fast")
    assert trials_to(run(("t2/mb2/fp32", 1.1)), k, k_relative, LAUNCH,
                     resolution=MIN_GAIN) == (None, "never reached")


def test_a_search_that_keeps_its_launch_config_needs_no_trial() -> None:
    assert trials_to(run(("t2/mb8/bf16", 1.5)), "t2/mb4/fp32", 1.0, LAUNCH,
                     resolution=MIN_GAIN) == (0, "the launch config")
