"""How a trial is judged: the rollout's timings and sizes, and the sequential test's verdict
after each pair (``decide``, pure, so a bench replays recorded windows through the
controller's own rule)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from collectors import ConfigError
from tuner._change import Change, Mode, Trip
from tuner._windows import Comparison, MeasureConfig


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Timings and sizes of a rollout; ``auto_bounds`` are the operator's per-knob limits for
    auto-approval: a tuple (low, high) for numbers or a set of allowed values. A knob with no
    entry may auto-approve anywhere in its domain.

    A trial is a sequential test: pairs of windows are added until the confidence sequence
    decides (kept from ``min_pairs`` on when it excludes zero from above; rolled back from
    ``early_stop_pairs`` on when it excludes zero from below, and from ``min_pairs`` on when
    its upper end is below ``min_gain``, a gain not worth having), or until ``max_pairs`` or
    ``trial_budget_s`` of job time since the candidate was acked (then rolled back: no
    measured gain). A serving candidate whose token agreement over all its windows is below
    ``measure.min_token_agreement``, or whose median p99 over its pairs is more than
    ``measure.latency_tolerance`` above its baselines', is rolled back from ``min_pairs`` on,
    so it is never kept. Whatever the test says, two candidate windows that ran below
    ``max_slowdown`` of their baselines' tokens/s end the trial at once: it harms the job (one
    such window may be a neighbour's burst on a shared box)."""

    min_pairs: int = 3
    max_pairs: int = 24
    trial_budget_s: float = 90.0
    min_gain: float = 0.03
    max_slowdown: float = 0.4
    proposal_ttl_s: float = 3600.0
    ack_timeout_s: float = 60.0
    restore_attempts: int = 3
    """Times a rollback's baseline is sent before the change needs a person."""
    window_timeout_s: float = 600.0
    early_stop_pairs: int = 2
    default_mode: Mode = "suggest"
    auto_bounds: Mapping[str, Any] = field(default_factory=dict)
    measure: MeasureConfig = field(default_factory=MeasureConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.min_pairs <= self.max_pairs:
            raise ConfigError(f"RolloutConfig.min_pairs must be >= 1 and <= max_pairs, got "
                             f"{self.min_pairs} and {self.max_pairs}")
        if self.restore_attempts < 1:
            raise ConfigError(f"RolloutConfig.restore_attempts must be >= 1, "
                             f"got {self.restore_attempts}")
        if self.early_stop_pairs < 1:
            raise ConfigError(f"RolloutConfig.early_stop_pairs must be >= 1, "
                             f"got {self.early_stop_pairs}")
        if not 0 <= self.max_slowdown < 1:
            raise ConfigError(f"RolloutConfig.max_slowdown must be in [0, 1), "
                             f"got {self.max_slowdown}")
        if self.min_gain < 0:
            raise ConfigError(f"RolloutConfig.min_gain must be >= 0, got {self.min_gain}")
        for name in ("proposal_ttl_s", "ack_timeout_s", "window_timeout_s", "trial_budget_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"RolloutConfig.{name} must be > 0")
        if self.default_mode not in ("auto", "suggest", "off"):
            raise ConfigError(f"RolloutConfig.default_mode must be auto|suggest|off, "
                             f"got {self.default_mode!r}")



def decide(comparison: Comparison, config: RolloutConfig, elapsed_s: float
           ) -> Literal["keep"] | Trip | None:
    """The sequential test's verdict after a pair (``RolloutConfig``): keep, a rollback (the
    trip says why) or None (measure another pair). ``elapsed_s``: job time since the
    candidate was first acked. Pure, so a bench replays recorded windows through exactly the
    controller's rule."""
    pairs = comparison.pairs
    # loss from min_pairs on: one short window's loss is noisy, and a guardrail that knows the
    # cause (an underflow finding on one group: a local rollback) gets the time to speak first
    if pairs >= config.min_pairs and not comparison.loss_ok:
        return Trip(kind="config", reason=(
            f"loss {comparison.loss_excess:+.2%} above the baseline's trajectory"))
    # latency likewise: one window's p99 is its few slowest requests, and on a shared box one
    # neighbour's burst doubles it (a 6 -> 8 bit KV trial, +9.5% tokens/s, was rolled back
    # on one pair's +97%); the absolute SLO is a guardrail of its own and acts at once
    if pairs >= config.min_pairs and not comparison.latency_ok:
        return Trip(kind="config", reason=(
            f"p99 latency {comparison.latency_excess:+.2%} above the baseline's"))
    if pairs >= config.min_pairs and not comparison.quality_ok:
        return Trip(kind="config", reason=(
            f"token agreement {comparison.quality:.4f} over the candidate's "
            f"{comparison.quality_tokens} checked tokens is below the bound "
            f"{config.measure.min_token_agreement:.4f}"))
    slow = sorted(r for r in comparison.pair_ratios if r < config.max_slowdown)
    if len(slow) >= 2:
        return Trip(kind="config", reason=(
            f"harms the job: {len(slow)} candidate windows ran at {slow[-1]:.0%} or less of "
            f"their baselines' tokens/s (bound {config.max_slowdown:.0%})"))
    if pairs >= config.early_stop_pairs and comparison.regresses:
        return Trip(kind="config", reason=f"measured regression {interval_text(comparison)}")
    if comparison.improves:
        return "keep" if pairs >= config.min_pairs else None
    if pairs >= config.min_pairs and comparison.ci_high < config.min_gain:
        return Trip(kind="config", reason=(
            f"no gain worth having (below {config.min_gain:+.0%}): gain "
            f"{interval_text(comparison)}"))
    if pairs >= config.max_pairs or elapsed_s >= config.trial_budget_s:
        spent = (f"{pairs} pairs" if pairs >= config.max_pairs
                 else f"the trial's {config.trial_budget_s:g} s")
        return Trip(kind="config", inconclusive=True, reason=(
            f"no measured gain in {spent}: gain {interval_text(comparison)}"))
    return None


def interval_text(comparison: Comparison) -> str:
    return (f"{comparison.gain:+.2%} [{comparison.ci_low:+.2%}, {comparison.ci_high:+.2%}] "
            f"after {comparison.pairs} pair(s)"
            + (f" and {comparison.earlier_pairs} of the undecided trial it continues"
               if comparison.earlier_pairs else ""))


def auto_approvable(change: Change, bounds: Mapping[str, Any]) -> bool:
    """Whether ``auto`` mode may approve the change without a person: live, low risk, and
    every value within the operator's bound for its knob (a ``(low, high)`` range or a set of
    allowed values; a knob without a bound is unbounded)."""
    if change.scope != "live" or change.risk != "low":
        return False
    for name, value in change.values.items():
        bound = bounds.get(name)
        if bound is None:
            continue
        if isinstance(bound, tuple) and len(bound) == 2 and not isinstance(value, str):
            if not bound[0] <= value <= bound[1]:
                return False
        elif value not in bound:
            return False
    return True
