"""The training scenario suite: its coverage, and the synthetic collapse case end to end."""

from __future__ import annotations

from policies.detectors import article_collapse_step
from tests.policies.scenarios_training import SCENARIOS, collapse_points

TRAINING_DETECTORS = {"gradient_collapse", "gradient_underflow", "non_finite", "input_bound",
                      "small_batch_precision", "tiny_buckets", "load_imbalance"}


def test_every_training_detector_has_a_positive_and_a_healthy_scenario() -> None:
    kinds = {(s.detector, s.healthy) for s in SCENARIOS}
    assert {d for d, _ in kinds} == TRAINING_DETECTORS
    assert kinds == {(d, h) for d in TRAINING_DETECTORS for h in (True, False)}
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)


def test_synthetic_collapse_is_found_when_the_seed_rule_first_holds() -> None:
    """SYNTHETIC norms: the finding comes at the evaluation of the step where the seed's rule
    first holds over the norms, not before, and never on the healthy decay."""
    by_name = {s.name: s for s in SCENARIOS if s.detector == "gradient_collapse"}
    flags, built = by_name["positive_norm_collapse_at_step_20"].run()
    norms = [p.value for p in collapse_points(collapse_at=20) if p.name.endswith("grad.norm")]
    rule_step = article_collapse_step(norms)
    assert built.onset is not None and rule_step is not None
    assert flags.index(True) - built.onset == rule_step - 20
    assert not any(flags[:built.onset])
    healthy, _ = by_name["healthy_slow_norm_decay"].run()
    assert len(healthy) > 0 and not any(healthy)
