"""A prefix cache that misses often, when the misses show up in tail latency.

A miss recomputes the prompt's prefix, so a low hit rate is worth a change only when p99 latency
moves with it (or breaks its SLO); pinning and pre-warming hot prefixes then cut the tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import ConfigError
from collectors.names import SERVE_PREFIX_CACHE_HITS, SERVE_PREFIX_CACHE_QUERIES
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._request_latency import REQUEST_BUCKETS, p99_per_interval
from policies.detectors._series import increase, interval_increases
from policies.detectors._steps import attribute_columns, by

HITS = SERVE_PREFIX_CACHE_HITS
QUERIES = SERVE_PREFIX_CACHE_QUERIES


@dataclass(frozen=True, slots=True, kw_only=True)
class LowCacheHitConfig:
    """Hit-rate floor, and when low hits count as hurting the tail.

    The hit rate is hits / queries (counter increases) over the window. It hurts the tail when,
    across export intervals, per-interval hit rate and per-interval p99 of
    ``gen_ai.server.request.duration`` correlate at or below ``max_correlation`` (Pearson; at
    least ``min_intervals`` intervals), or when ``p99_slo_s`` is set and the window's median
    interval p99 exceeds it.
    """

    min_hit_rate: float = 0.7
    min_queries: float = 20.0
    max_correlation: float = -0.5
    min_intervals: int = 4
    p99_slo_s: float | None = None
    prewarm_top_k: int = 8
    capacity_entries: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.min_hit_rate <= 1:
            raise ConfigError(f"min_hit_rate must be in (0, 1], got {self.min_hit_rate}")
        if not -1 <= self.max_correlation < 0:
            raise ConfigError(f"max_correlation must be in [-1, 0), got {self.max_correlation}")
        if self.min_intervals < 3:
            raise ConfigError(f"min_intervals must be >= 3, got {self.min_intervals}")
        if self.p99_slo_s is not None and not self.p99_slo_s > 0:
            raise ConfigError(f"p99_slo_s must be > 0, got {self.p99_slo_s}")
        if self.prewarm_top_k < 1 or self.capacity_entries < 1:
            raise ConfigError("prewarm_top_k and capacity_entries must be >= 1, got "
                             f"{self.prewarm_top_k} and {self.capacity_entries}")


def _total_increase(frame: pd.DataFrame) -> float:
    """Summed counter increase over every series of ``frame``."""
    return sum(increase(rows) for _, rows in by(frame, attribute_columns(frame)))


def _per_interval(window: StoreWindow, name: str) -> pd.Series:
    frame = window.query(name)
    if frame.empty:
        return pd.Series(dtype=np.float64)
    deltas = interval_increases(frame.groupby("time", as_index=False)["value"].sum())
    return deltas.set_index("time")["delta"]


class LowCacheHitRateDetector(Detector):
    """Flags a prefix cache that misses often while the misses show in p99 latency."""

    def __init__(self, config: LowCacheHitConfig | None = None, *,
                 name: str = "low_cache_hit_rate") -> None:
        self.config = config or LowCacheHitConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        hits_frame, queries_frame = window.query(HITS), window.query(QUERIES)
        if hits_frame.empty or queries_frame.empty:
            return []
        queries, hits = _total_increase(queries_frame), _total_increase(hits_frame)
        if queries < cfg.min_queries:
            return []
        rate = hits / queries
        if rate >= cfg.min_hit_rate:
            return []
        per = pd.DataFrame({"hits": _per_interval(window, HITS),
                            "queries": _per_interval(window, QUERIES),
                            "p99": p99_per_interval(window.query(REQUEST_BUCKETS))}).dropna()
        per = per[per["queries"] > 0]
        if per.empty:
            return []
        per["rate"] = per["hits"] / per["queries"]
        corr = (float(np.corrcoef(per["rate"], per["p99"])[0, 1])
                if len(per) >= cfg.min_intervals and per["rate"].std() > 0
                and per["p99"].std() > 0 else math.nan)
        p99 = float(per["p99"].median())
        tracks = corr <= cfg.max_correlation
        over_slo = cfg.p99_slo_s is not None and p99 > cfg.p99_slo_s
        if not (tracks or over_slo):
            return []
        thresholds = [Threshold(measurement="hit_rate", comparison="<", value=cfg.min_hit_rate),
                      Threshold(measurement="rate_p99_correlation", comparison="<=",
                                value=cfg.max_correlation)]
        if cfg.p99_slo_s is not None:
            thresholds.append(Threshold(measurement="p99", comparison=">", value=cfg.p99_slo_s,
                                        unit="s"))
        why = (f"p99 rises as hit rate falls (r = {corr:.2f} over {len(per)} intervals)"
               if tracks else f"median p99 {p99:.3g} s exceeds the {cfg.p99_slo_s:g} s SLO")
        return [Finding(
            detector=self.name, job=window.job, severity="warning", resource={},
            evidence=Evidence(
                summary=(f"prefix-cache hit rate {rate:.0%} ({hits:.0f}/{queries:.0f}) is "
                         f"below {cfg.min_hit_rate:.0%}; {why}"),
                model=("hit rate = increase(hits) / increase(queries) over the window; per "
                       "interval: Pearson r of hit rate vs p99 (histogram_quantile over "
                       "gen_ai.server.request.duration buckets)"),
                measurements=(Measurement(name="hit_rate", value=rate),
                              Measurement(name="queries", value=float(queries),
                                          unit="{request}"),
                              Measurement(name="rate_p99_correlation", value=corr),
                              Measurement(name="p99", value=p99, unit="s"),
                              Measurement(name="intervals", value=float(len(per)))),
                thresholds=tuple(thresholds)),
            suggested_changes=(
                SuggestedChange(knob="prefix_cache.policy", value="pinned",
                                expected_effect="the hottest prefixes stay cached under churn"),
                SuggestedChange(knob="prefix_cache.prewarm_top_k", value=cfg.prewarm_top_k,
                                expected_effect="frequent prefixes computed before requests "
                                "need them: fewer cold misses in the tail"),
                SuggestedChange(knob="prefix_cache.capacity_entries",
                                value=cfg.capacity_entries,
                                expected_effect="more distinct prefixes held: fewer evictions")),
        )]
