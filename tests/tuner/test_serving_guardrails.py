"""The serving guardrail judges the candidate, on what it measured.

Points here are synthetic (labelled so), shaped as the serving workload exports them: token
counters cumulative per config version. ``tests/workloads/test_serve.py`` reads the engine's
real export through the same functions.
"""

from __future__ import annotations

import math

import pytest

from collectors._points import CONFIG_VERSION_ATTR, Point
from policies._window import FrameStore, StoreWindow
from tuner._change import Change, Trip
from tuner._compare import compare
from tuner._verdict import RolloutConfig, decide
from tuner._windows import MeasureConfig, Window
from tuner.serving_guardrails import (
    AGREEING_TOKENS_METRIC,
    CHECKED_TOKENS_METRIC,
    ServingGuardrailConfig,
    ServingSLOGuardrail,
    check_guardrails,
    window_agreement,
)

JOB = "serve"
BOUND = ServingGuardrailConfig(min_token_agreement=0.98, series_start_in_window=True)


def _counted(version: int, agreeing: int, checked: int, t: int = 1,
             rank: str = "0") -> list[Point]:
    """Synthetic: one export of a replica's cumulative token counters under a version."""
    attrs = {"service.name": JOB, CONFIG_VERSION_ATTR: str(version), "seedance.rank": rank}
    return [Point(CHECKED_TOKENS_METRIC, float(checked), t, attrs),
            Point(AGREEING_TOKENS_METRIC, float(agreeing), t, attrs)]


def _window(points: list[Point]) -> StoreWindow:
    return StoreWindow(FrameStore.from_points(points), job=JOB, since_ns=0, until_ns=10)


def test_a_few_disagreeing_tokens_are_not_a_breach_but_a_measured_shortfall_is() -> None:
    # 125 of 128: 0.977 as a point estimate, yet a config at 0.99 shows 3 misses in 128 in
    # 14% of samples; the guardrail looks on every tick, so it waits for a measured shortfall
    few = window_agreement(_window(_counted(1, 125, 128)), BOUND)
    assert few is not None and few.agreement == pytest.approx(125 / 128)
    assert few.tokens == 128 and few.upper > 0.98
    assert check_guardrails(_window(_counted(1, 125, 128)), BOUND) == []
    # one miss in the six tokens a slow window checked: too few to say it is below 0.98
    assert check_guardrails(_window(_counted(1, 5, 6)), BOUND) == []
    assert check_guardrails(_window(_counted(1, 3, 6)), BOUND)  # three misses in six: is
    (breach,) = check_guardrails(_window(_counted(1, 380, 400)), BOUND)
    assert breach == "token agreement 0.9500 over 400 checked tokens is below the bound 0.9800"
    # two replicas' counters add up: 2 x (122 of 128) is a measured 0.953
    both = _counted(1, 122, 128, rank="0") + _counted(1, 122, 128, rank="1")
    assert check_guardrails(_window(both), BOUND)


def test_counters_of_a_series_that_began_before_the_window_count_their_increase() -> None:
    points = _counted(1, 1000, 1000, t=1) + _counted(1, 1380, 1400, t=5)
    got = window_agreement(_window(points), ServingGuardrailConfig())
    assert got is not None and (got.agreement, got.tokens) == (pytest.approx(0.95), 400)


def _change(*, index: int, version: int, windows: tuple[Window, ...] = ()) -> Change:
    return Change(id="c1", job=JOB, state="observing", source="trial", reason="test",
                  risk="low", scope="config", values={"kv.key_bits": 8},
                  baseline={"kv.key_bits": 6}, created_at_s=0.0, expires_at_s=1e9,
                  plan={"arms": ["candidate", "baseline", "candidate", "baseline"],
                        "index": index, "version": version}, windows=windows)


def _served(version: int, arm: str, *, quality: float = math.nan, tokens: int = 0) -> Window:
    return Window(version=version, arm=arm, steps=100, step_s=0.05,  # type: ignore[arg-type]
                  tokens_per_s=100.0, loss=math.nan, nonfinite_loss=False, start_ns=0,
                  end_ns=1, quality=quality, quality_tokens=tokens)


def test_the_guardrail_judges_candidate_windows_and_not_the_baseline() -> None:
    """A baseline window runs the job's config of before; its breach is not the candidate's."""
    store = FrameStore.from_points(_counted(11, 380, 400) + _counted(12, 380, 400))
    guardrail = ServingSLOGuardrail(ServingGuardrailConfig(min_token_agreement=0.98))
    candidate_window = (_served(11, "candidate"),)
    on_baseline = _change(index=1, version=12, windows=candidate_window)
    assert on_baseline.arm_of(12) == "baseline" and on_baseline.arm_of(11) == "candidate"
    assert guardrail.check(on_baseline, 12, store) is None
    trip = guardrail.check(on_baseline, 11, store)  # the candidate's version, not acked
    assert isinstance(trip, Trip) and "0.9500 over 400 checked tokens" in trip.reason
    assert guardrail.check(_change(index=0, version=11), 11, store) is not None
    assert _change(index=0, version=11).arm_of(99) is None


def test_a_candidate_is_kept_only_within_the_bound_over_all_its_tokens() -> None:
    measure = MeasureConfig(min_token_agreement=0.98)
    config = RolloutConfig(measure=measure)
    fast = [(_served(1, "candidate", quality=0.99, tokens=300), 1.3),
            (_served(3, "candidate", quality=0.96, tokens=500), 1.3),
            (_served(5, "candidate", quality=0.985, tokens=200), 1.3)]
    windows: list[Window] = []
    for i, (c, ratio) in enumerate(fast):
        windows += [Window(**{**c.__dict__, "tokens_per_s": 100.0 * ratio}),
                    _served(2 * i + 2, "baseline")]
    comparison = compare(windows, measure)
    assert comparison.improves  # +30% in every pair: the throughput test alone would keep it
    pooled = (0.99 * 300 + 0.96 * 500 + 0.985 * 200) / 1000
    assert comparison.quality == pytest.approx(pooled) and comparison.quality_tokens == 1000
    verdict = decide(comparison, config, elapsed_s=10.0)
    assert isinstance(verdict, Trip)
    assert verdict.reason == (f"token agreement {pooled:.4f} over the candidate's 1000 checked "
                              "tokens is below the bound 0.9800")
    # the same windows within the bound, or with no bound set: kept
    assert decide(compare(windows, MeasureConfig(min_token_agreement=0.97)), config, 10.0) == \
        "keep"
    assert decide(compare(windows, MeasureConfig()), config, 10.0) == "keep"
