"""The sequential test's verdict on serving windows: one window's tail latency spike does not
end a trial that is measuring a gain, a p99 above the baseline's in most pairs does."""

from __future__ import annotations

import math

from tuner._compare import compare
from tuner._verdict import RolloutConfig, Trip, decide
from tuner._windows import Window

NS = 1_000_000_000
CONFIG = RolloutConfig()


def _windows(pairs: list[tuple[float, float, float, float]]) -> list[Window]:
    """Baseline, candidate, baseline... windows of 10 s from (baseline tokens/s, baseline p99,
    candidate tokens/s, candidate p99) per pair, and a closing baseline."""
    out: list[Window] = []
    for base_tps, base_p99, cand_tps, cand_p99 in pairs:
        for arm, tps, p99 in (("baseline", base_tps, base_p99), ("candidate", cand_tps, cand_p99)):
            start = len(out) * 10 * NS
            out.append(Window(version=1 if arm == "baseline" else 2, arm=arm, steps=100,  # type: ignore[arg-type]
                              step_s=0.01, tokens_per_s=tps, loss=math.nan,
                              nonfinite_loss=False, start_ns=start, end_ns=start + 10 * NS,
                              p99_s=p99, quality=1.0, quality_tokens=200))
    last_tps, last_p99 = pairs[-1][0], pairs[-1][1]
    start = len(out) * 10 * NS
    out.append(Window(version=1, arm="baseline", steps=100, step_s=0.01,
                      tokens_per_s=last_tps, loss=math.nan, nonfinite_loss=False,
                      start_ns=start, end_ns=start + 10 * NS, p99_s=last_p99, quality=1.0,
                      quality_tokens=200))
    return out


def _verdict(pairs: list[tuple[float, float, float, float]]) -> object:
    return decide(compare(_windows(pairs), CONFIG.measure), CONFIG, elapsed_s=10.0 * len(pairs))


def test_one_pairs_latency_spike_waits_for_more_pairs() -> None:
    spike = [(200.0, 2.0, 220.0, 4.0)]  # +10% tokens/s, the candidate window's p99 doubled
    assert CONFIG.min_pairs > 1
    assert _verdict(spike) is None  # measure another pair
    # the next pairs' p99 is the baseline's again, and the gain holds: kept at min_pairs
    steady = spike + [(200.0, 2.0, 220.0, 2.0)] * (CONFIG.min_pairs - 1)
    assert _verdict(steady) == "keep"


def test_a_p99_above_the_baselines_in_most_pairs_is_rolled_back_at_min_pairs() -> None:
    slower_tail = [(200.0, 2.0, 240.0, 2.6)]  # +20% tokens/s bought with +30% p99
    assert _verdict(slower_tail * (CONFIG.min_pairs - 1)) is None
    verdict = _verdict(slower_tail * CONFIG.min_pairs)
    assert isinstance(verdict, Trip) and verdict.kind == "config"
    assert "p99 latency +30.00% above the baseline's" in verdict.reason
    # one pair at the baseline's p99 among them does not hide it
    mostly = slower_tail * (CONFIG.min_pairs - 1) + [(200.0, 2.0, 240.0, 2.0)]
    assert isinstance(_verdict(mostly), Trip)
