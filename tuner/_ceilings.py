"""Ceilings a job's own telemetry puts on its knobs: a move above one buys nothing the job can
use (pinning or prewarming more prefixes than its traffic holds), so the search never
proposes it. Moves down stay allowed, and a job's own setting above a ceiling is left alone."""

from __future__ import annotations

import time
from collections.abc import Mapping

from collectors import StoreReader
from collectors.names import SERVE_PREFIX_CACHE_DISTINCT_PREFIXES
from tuner._measure import JOB_ATTR

CEILED_BY: Mapping[str, tuple[str, ...]] = {
    SERVE_PREFIX_CACHE_DISTINCT_PREFIXES: ("prefix_cache.pin_top_k",
                                                       "prefix_cache.prewarm_top_k"),
}
"""Metric -> the knobs it bounds from above."""
RECENT_S = 300.0
"""How far back the observation counts (the largest value seen in it is the ceiling)."""


def observed_ceilings(reader: StoreReader, job: str, *, now_s: float | None = None
                      ) -> dict[str, float]:
    """The ceiling of each bounded knob the job's recent points speak for (none: no ceiling)."""
    now_ns = int((time.time() if now_s is None else now_s) * 1e9)
    ceilings: dict[str, float] = {}
    for metric, knobs in CEILED_BY.items():
        points = reader.query(metric, where={JOB_ATTR: job},
                              since_ns=now_ns - int(RECENT_S * 1e9), resolution="raw")
        if len(points):
            ceilings.update(dict.fromkeys(knobs, float(points["value"].max())))
    return ceilings


def above_ceiling(values: Mapping[str, object], ceilings: Mapping[str, float]) -> bool:
    """Whether a move sets any bounded knob above its ceiling."""
    return any(isinstance(v, int | float) and not isinstance(v, bool) and k in ceilings
               and v > ceilings[k] for k, v in values.items())
