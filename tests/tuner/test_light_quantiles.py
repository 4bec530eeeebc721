"""The measurement and the serving guardrail take their quantiles from ``scipy.special``
(``scipy.stats`` costs each sidecar 47 MiB of memory): they must give ``scipy.stats``' values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from tuner._compare import _interval, confidence_sequence
from tuner._windows import MeasureConfig
from tuner.serving_guardrails import clopper_pearson_upper


@pytest.mark.parametrize("n", [1, 2, 5, 17, 40, 300])
@pytest.mark.parametrize("confidence", [0.9, 0.96, 0.98])
def test_clopper_pearson_upper_is_scipy_stats_exact_interval(n: int, confidence: float) -> None:
    for k in range(n + 1):
        expected = stats.binomtest(k, n).proportion_ci(confidence_level=confidence,
                                                       method="exact").high
        assert clopper_pearson_upper(k, n, confidence=confidence) == pytest.approx(
            expected, abs=1e-10)


def test_student_t_interval_is_scipy_stats_t() -> None:
    rng = np.random.default_rng(3)
    config = MeasureConfig(interval="t", confidence=0.95)
    for size in (2, 3, 8, 30):
        gains = rng.normal(0.05, 0.02, size)
        half = stats.t.ppf(0.975, size - 1) * gains.std(ddof=1) / math.sqrt(size)
        assert _interval(gains, config) == pytest.approx(
            (gains.mean() - half, gains.mean() + half), rel=1e-12)


def test_confidence_sequence_bounds_the_sd_with_scipy_stats_chi2() -> None:
    rng = np.random.default_rng(4)
    gains = rng.normal(0.0, 0.05, 12)
    alpha, planned = 0.05, 20
    s = gains.std(ddof=1) * math.sqrt(11 / stats.chi2.ppf(0.2, 11))
    c = -2 * math.log(alpha) + math.log(1 - 2 * math.log(alpha))
    rho2 = c / (planned * s * s)
    v = 12 * s * s * rho2
    half = math.sqrt(2 * (v + 1) / (12 * 12 * rho2) * math.log(math.sqrt(v + 1) / alpha))
    assert confidence_sequence(gains, alpha=alpha, planned=planned, noise_floor=0.0) == \
        pytest.approx((gains.mean() - half, gains.mean() + half), rel=1e-12)
