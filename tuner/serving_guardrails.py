"""Serving guardrails: a p99 latency SLO and a quality bound; breaching either means roll back.

``check_guardrails(window)`` reads two series from a window of the store (anything with the
store's ``query(name, where=..., resolution=...)``: ``policies.StoreWindow``, the rollout
controller's version-bound query):

- p99 of ``gen_ai.server.request.duration`` from its cumulative histogram buckets
  (``.bucket`` with ``le``), merged over every series (rank, replica) in the window, estimated
  as Prometheus' ``histogram_quantile`` does (linear within the bucket). A p99 in the ``+Inf``
  bucket is reported as infinite: beyond the last bound is a breach of any SLO below it.
  Counts per series are last minus first export in the window, or the last alone when
  ``series_start_in_window`` (a config version's series start with it). Fewer than
  ``min_requests`` requests in the window give no latency verdict.
- ``seedance.serve.quality.token_agreement``: the share of greedy tokens a replica produced
  that a full-precision, cache-free forward of the same sequence also picks (the serving
  workload checks a sample of finished requests). Its mean over the window must stay at or
  above ``min_token_agreement``; a window without points gives no quality verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import pandas as pd

from collectors import CONFIG_VERSION_ATTR, SeedanceError
from policies import histogram_quantile
from tuner._measure import JOB_ATTR, QueryFn
from tuner._rollout import Change, Guardrail, Trip

__all__ = ["QUALITY_METRIC", "ServingGuardrailConfig", "ServingSLOGuardrail",
           "check_guardrails", "window_latency_quantile"]

LATENCY_METRIC = "gen_ai.server.request.duration"
QUALITY_METRIC = "seedance.serve.quality.token_agreement"
_TIME_VALUE = ("time", "value")


class Queryable(Protocol):
    def query(self, name: str, where: Mapping[str, str] | None = None,
              *args: Any, **kwargs: Any) -> pd.DataFrame: ...


@dataclass(frozen=True, kw_only=True)
class ServingGuardrailConfig:
    """The bounds: p99 end-to-end latency SLO (s; None: no absolute SLO, as by default, the
    rollout still refuses a p99 worse than the baseline's) and least token agreement (0..1)."""

    p99_slo_s: float | None = None
    quantile: float = 0.99
    min_token_agreement: float = 0.98
    min_requests: int = 20
    series_start_in_window: bool = False

    def __post_init__(self) -> None:
        if self.p99_slo_s is not None and not self.p99_slo_s > 0:
            raise SeedanceError(f"ServingGuardrailConfig.p99_slo_s must be > 0, "
                                f"got {self.p99_slo_s}")
        if not 0 < self.quantile < 1:
            raise SeedanceError(f"ServingGuardrailConfig.quantile must be in (0, 1), "
                                f"got {self.quantile}")
        if not 0 <= self.min_token_agreement <= 1:
            raise SeedanceError("ServingGuardrailConfig.min_token_agreement must be in [0, 1]")
        if self.min_requests < 1:
            raise SeedanceError("ServingGuardrailConfig.min_requests must be >= 1")


def window_latency_quantile(window: Queryable, config: ServingGuardrailConfig,
                            where: Mapping[str, str] | None = None) -> tuple[float, int]:
    """(latency quantile in s, requests counted) in the window, merged over its series."""
    frame = window.query(LATENCY_METRIC + ".bucket", where=where)
    if frame.empty:
        return math.nan, 0
    keys = [c for c in frame.columns if c not in _TIME_VALUE and c != "le"]
    merged: dict[float, float] = {}
    for le, by_le in frame.groupby("le"):
        total = 0.0
        for _, series in (by_le.groupby(keys, dropna=False) if keys else [((), by_le)]):
            values = series.sort_values("time")["value"].to_numpy()
            first = 0.0 if config.series_start_in_window else float(values[0])
            total += max(0.0, float(values[-1]) - first)
        merged[float(le)] = total
    return histogram_quantile(config.quantile, merged), int(merged.get(math.inf, 0.0))


def check_guardrails(window: Queryable, config: ServingGuardrailConfig | None = None,
                     where: Mapping[str, str] | None = None) -> list[str]:
    """Breached guardrails, one sentence each; empty when the window is within bounds."""
    config = config or ServingGuardrailConfig()
    breaches: list[str] = []
    latency_s, requests = (window_latency_quantile(window, config, where)
                           if config.p99_slo_s is not None else (math.nan, 0))
    if (config.p99_slo_s is not None and requests >= config.min_requests
            and not latency_s <= config.p99_slo_s):
        breaches.append(f"p{config.quantile * 100:g} latency {latency_s:.3f} s over "
                        f"{requests} requests exceeds the SLO {config.p99_slo_s:.3f} s")
    quality = window.query(QUALITY_METRIC, where=where)
    if not quality.empty:
        agreement = float(quality["value"].mean())
        if not agreement >= config.min_token_agreement:
            breaches.append(f"token agreement {agreement:.4f} is below the bound "
                            f"{config.min_token_agreement:.4f}")
    return breaches


class _VersionWindow:
    """The rollout controller's query bound to one job and config version."""

    def __init__(self, query: QueryFn, job: str, version: int) -> None:
        self._query, self._bound = query, {JOB_ATTR: job, CONFIG_VERSION_ATTR: str(version)}

    def query(self, name: str, where: Mapping[str, str] | None = None,
              *args: Any, **kwargs: Any) -> pd.DataFrame:
        return self._query(name, where={**(where or {}), **self._bound}, resolution="raw")


class ServingSLOGuardrail(Guardrail):
    """``check_guardrails`` on the change's current version for the rollout controller: any
    breach is a config rollback. A version's series start with it, so its last cumulative
    counts are the window's."""

    def __init__(self, config: ServingGuardrailConfig | None = None) -> None:
        base = config or ServingGuardrailConfig()
        self.config = ServingGuardrailConfig(**{**base.__dict__, "series_start_in_window": True})

    def check(self, change: Change, version: int, query: QueryFn) -> Trip | None:
        breaches = check_guardrails(_VersionWindow(query, change.job, version), self.config)
        return Trip(kind="config", reason="; ".join(breaches)) if breaches else None
