"""Tail request latency per export interval, which the serving detectors weigh causes against.

Autoscaler thrash (``_autoscaler_thrash.py``) and a low prefix-cache hit rate
(``_low_cache_hit_rate.py``) are only worth a change when they show in p99 latency, read here
from the ``gen_ai.server.request.duration`` histogram buckets.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from collectors.names import GEN_AI_SERVER_REQUEST_DURATION_BUCKET
from policies._quantile import histogram_quantile
from policies.detectors._series import interval_increases

REQUEST_BUCKETS = GEN_AI_SERVER_REQUEST_DURATION_BUCKET


def p99_per_interval(frame: pd.DataFrame) -> pd.Series:
    """p99 per export interval from cumulative histogram bucket series (column ``le``)."""
    if frame.empty or "le" not in frame.columns:
        return pd.Series(dtype=np.float64)
    per_bound = {}
    for le, rows in frame.groupby("le"):
        deltas = interval_increases(rows.groupby("time", as_index=False)["value"].sum())
        per_bound[float(le)] = deltas.set_index("time")["delta"]
    table = pd.DataFrame(per_bound).sort_index(axis=1).dropna()
    bounds = table.columns.to_numpy(dtype=np.float64)
    if len(bounds) < 2:
        return pd.Series(dtype=np.float64)
    # a p99 past the last bound counts as the last bound, as Prometheus reads it: replicas
    # are compared with each other, and an infinite p99 would compare with nothing
    last = float(bounds[-2])
    return pd.Series({t: min(histogram_quantile(0.99, dict(zip(bounds, row.to_numpy(),
                                                                strict=True))), last)
                      for t, row in table.iterrows()}, dtype=np.float64).dropna()
