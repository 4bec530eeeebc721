"""The project's one histogram quantile, and the imbalance detector's reading of it."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from policies import histogram_quantile
from policies.detectors import p99_per_interval


def test_a_rank_past_the_last_bound_is_infinite_never_the_last_bound() -> None:
    assert histogram_quantile(0.99, {0.1: 10, 1.0: 90, math.inf: 100}) == math.inf
    assert histogram_quantile(0.5, {0.1: 10, 1.0: 90, math.inf: 100}) == pytest.approx(0.55)


def test_the_imbalance_p99_reads_an_overflow_as_the_last_bound() -> None:
    """Replicas are compared with each other: an overflowed interval's p99 is the last bound,
    as Prometheus reads it, so it still compares (and exceeds a fast replica's)."""
    t0, t1 = pd.Timestamp("2026-01-01T00:00:00Z"), pd.Timestamp("2026-01-01T00:00:10Z")
    rows = [(t, le, v) for t, counts in ((t0, (0, 0, 0)), (t1, (0, 5, 100)))
            for le, v in zip(("0.1", "1.0", "+Inf"), counts, strict=True)]
    frame = pd.DataFrame(rows, columns=["time", "le", "value"])
    p99 = p99_per_interval(frame)
    assert list(p99) == [1.0]
