"""The seed's bandwidth saturation model (section 2.1): what a bandwidth demand leaves of compute.

Section numbers are the seed article's (its digest is kept outside this repository); where the
seed's printed number does not follow from its own formula, the formula wins and the
docstring says so.
"""

from __future__ import annotations

import math

ARTICLE_COUPLING_K = 0.8
"""The seed's "hardware coupling" coefficient k of the saturation model (section 2.1)."""


def bandwidth_saturation(demand: float, available: float, *, k: float = ARTICLE_COUPLING_K) -> float:
    """Effective compute fraction f(x) = 1 - exp(-k x / B) (seed section 2.1).

    ``demand`` (x) and ``available`` (B) in the same unit (GB/s in the seed); the result is a
    fraction in [0, 1). The seed prints 52.7% for x = 1500, B = 2048, k = 0.8; the formula gives
    44.3% (1 - exp(-0.586)); 52.7% would need k = 1.02.
    """
    if available <= 0:
        raise ValueError(f"available must be > 0, got {available}")
    if demand < 0:
        raise ValueError(f"demand must be >= 0, got {demand}")
    return 1.0 - math.exp(-k * demand / available)


def saturation_marginal_cost_ratio(
    pressure_from: float, pressure_to: float, *, k: float = ARTICLE_COUPLING_K
) -> float:
    """How many times more bandwidth pressure one unit of effective compute costs at
    ``pressure_to`` than at ``pressure_from`` (pressures are x/B, dimensionless).

    The cost is the inverse slope dx/df = exp(k x/B) / k, so the ratio is
    exp(k (to - from)). The seed says "past x/B ~ 0.7 each further 5% of pressure costs 2.3x
    more"; the formula says one 5% step multiplies the cost by exp(0.05 k) = 1.041 at k = 0.8,
    at any pressure (the curve has no knee), and the cost reaches 2.3x its zero-pressure value
    only at x/B = ln(2.3) / k = 1.04. A 2.3x jump per 5% step would need k = 16.7.
    """
    return math.exp(k * (pressure_to - pressure_from))


def pressure_for_marginal_cost_ratio(ratio: float, *, k: float = ARTICLE_COUPLING_K) -> float:
    """The pressure x/B at which compute costs ``ratio`` times its zero-pressure cost: ln(r)/k."""
    if ratio <= 0 or k <= 0:
        raise ValueError(f"ratio and k must be > 0, got {ratio}, {k}")
    return math.log(ratio) / k
