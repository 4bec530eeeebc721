"""The one confidence interval the benches report: a percentile bootstrap of the median.

Rounds of a bench on this shared box are few (5-150) and their noise is neither normal nor
symmetric (a neighbour's burst slows one round a lot), so the interval makes no assumption
about the shape and is taken on the median, the figure every bench reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def median_ci(values: Sequence[float], *, boots: int = 2000, seed: int = 0
              ) -> tuple[float, float, float]:
    """Median and its 95% percentile-bootstrap interval; NaNs when there is no value."""
    if not len(values):
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    arr = np.asarray(values, dtype=float)
    samples = np.median(rng.choice(arr, (boots, len(arr)), replace=True), axis=1)
    low, high = np.percentile(samples, [2.5, 97.5])
    return float(np.median(arr)), float(low), float(high)
