"""One histogram quantile for the whole project: the serving guardrail's p99, the measured
serving windows and the load-imbalance detector all read latency histograms through it."""

from __future__ import annotations

import math
from collections.abc import Mapping


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Quantile ``q`` of cumulative bucket counts {upper bound: count} (``inf`` for +Inf),
    linear within the bucket as Prometheus' ``histogram_quantile`` is; NaN when empty.

    A rank in the +Inf bucket is ``inf``: all we know is that it lies past the last bound, and
    a guardrail must not read that as the last bound (Prometheus returns the last finite bound;
    a caller that wants that clamps).
    """
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return math.inf
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count
                                                                                 - lower_count)
        lower_bound, lower_count = bound, count
    return math.inf
