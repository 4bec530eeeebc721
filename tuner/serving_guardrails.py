"""Serving guardrails: a p99 latency SLO and a quality bound; breaching either means roll back.

``check_guardrails(window)`` reads a window of the store (``policies.StoreWindow``, the rollout
controller's reader bound to one config version): the p99 of ``gen_ai.server.request.duration``
from its histogram buckets, and the share of greedy tokens that a full-precision forward also
picks, a breach only once it is *measured* below the bound (a one-sided Wilson bound). A window
too thin for either gives no verdict on it.

docs/measurement.md, 'Serving guardrails' explains the estimates.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd
from scipy.special import betaincinv  # scipy.stats costs a sidecar 47 MiB more

from collectors import SeedanceError, StoreReader
from collectors.names import (
    GEN_AI_SERVER_REQUEST_DURATION,
    SERVE_QUALITY_AGREEING_TOKENS,
    SERVE_QUALITY_CHECKED_TOKENS,
    SERVE_QUALITY_TOKEN_AGREEMENT,
)
from policies import histogram_quantile
from tuner._change import Change, Trip
from tuner._guardrails import Guardrail
from tuner._version_reader import VersionReader

__all__ = ["AGREEING_TOKENS_METRIC", "CHECKED_TOKENS_METRIC", "QUALITY_METRIC",
           "ServingGuardrailConfig", "ServingSLOGuardrail", "TokenAgreement",
           "check_guardrails", "window_agreement", "window_latency_quantile"]

LATENCY_METRIC = GEN_AI_SERVER_REQUEST_DURATION
QUALITY_METRIC = SERVE_QUALITY_TOKEN_AGREEMENT
CHECKED_TOKENS_METRIC = SERVE_QUALITY_CHECKED_TOKENS
AGREEING_TOKENS_METRIC = SERVE_QUALITY_AGREEING_TOKENS
_TIME_VALUE = ("time", "value")


@dataclass(frozen=True, kw_only=True)
class ServingGuardrailConfig:
    """The bounds: p99 end-to-end latency SLO (s; None: no absolute SLO, as by default, the
    rollout still refuses a p99 worse than the baseline's) and least token agreement (0..1)."""

    p99_slo_s: float | None = None
    quantile: float = 0.99
    min_token_agreement: float = 0.98
    breach_confidence: float = 0.95
    """How sure (one-sided) the counted tokens must make it that agreement is below the bound."""
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
        if not 0.5 <= self.breach_confidence < 1:
            raise SeedanceError("ServingGuardrailConfig.breach_confidence must be in [0.5, 1)")
        if self.min_requests < 1:
            raise SeedanceError("ServingGuardrailConfig.min_requests must be >= 1")


@dataclass(frozen=True)
class TokenAgreement:
    """A window's token agreement: the estimate, its one-sided upper confidence bound and the
    checked tokens behind it (0 when only the gauge was there: the bound is the estimate)."""

    agreement: float
    upper: float
    tokens: int


def _increase(series: pd.DataFrame, starts_in_window: bool) -> float:
    """A cumulative series' increase over the window: last minus first export (the last alone
    when the series starts in the window)."""
    values = series.sort_values("time")["value"].to_numpy()
    first = 0.0 if starts_in_window else float(values[0])
    return max(0.0, float(values[-1]) - first)


def _window_total(frame: pd.DataFrame, starts_in_window: bool,
                  ignore: tuple[str, ...] = ()) -> float:
    """A cumulative metric's increase over the window, summed over its series."""
    keys = [c for c in frame.columns if c not in _TIME_VALUE and c not in ignore]
    groups = frame.groupby(keys, dropna=False) if keys else [((), frame)]
    return sum(_increase(series, starts_in_window) for _, series in groups)


def window_latency_quantile(window: StoreReader, config: ServingGuardrailConfig,
                            where: Mapping[str, str] | None = None) -> tuple[float, int]:
    """(latency quantile in s, requests counted) in the window, merged over its series."""
    frame = window.query(LATENCY_METRIC + ".bucket", where=where)
    if frame.empty:
        return math.nan, 0
    merged = {float(le): _window_total(by_le, config.series_start_in_window, ("le",))
              for le, by_le in frame.groupby("le")}
    return histogram_quantile(config.quantile, merged), int(merged.get(math.inf, 0.0))


def check_guardrails(window: StoreReader, config: ServingGuardrailConfig | None = None,
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
    quality = window_agreement(window, config, where)
    if quality is not None and quality.upper < config.min_token_agreement:
        counted = f" over {quality.tokens} checked tokens" if quality.tokens else ""
        breaches.append(f"token agreement {quality.agreement:.4f}{counted} is below the bound "
                        f"{config.min_token_agreement:.4f}")
    return breaches


def clopper_pearson_upper(k: int, n: int, *, confidence: float) -> float:
    """The upper end of the two-sided exact (Clopper-Pearson) interval of a proportion, ``k``
    successes in ``n``: the Beta(k + 1, n - k) quantile at 1 - (1 - confidence) / 2."""
    if k >= n:
        return 1.0
    return float(betaincinv(k + 1, n - k, 1 - (1 - confidence) / 2))


def window_agreement(window: StoreReader, config: ServingGuardrailConfig,
                     where: Mapping[str, str] | None = None) -> TokenAgreement | None:
    """The window's token agreement from the token counters, else the gauge's mean; None
    without either."""
    checked = window.query(CHECKED_TOKENS_METRIC, where=where)
    if not checked.empty:
        agreeing = window.query(AGREEING_TOKENS_METRIC, where=where)
        n = round(_window_total(checked, config.series_start_in_window))
        k = round(_window_total(agreeing, config.series_start_in_window)) if len(agreeing) else 0
        if n > 0:
            k = min(k, n)
            # Clopper-Pearson: a bound that holds at every count. Wilson's, at a handful of
            # tokens (a slow window checks few), made one miss in six a breach of 0.98.
            upper = clopper_pearson_upper(k, n, confidence=2 * config.breach_confidence - 1)
            return TokenAgreement(agreement=k / n, upper=upper, tokens=n)
    gauge = window.query(QUALITY_METRIC, where=where)
    if gauge.empty:
        return None
    mean = float(gauge["value"].mean())
    return TokenAgreement(agreement=mean, upper=mean, tokens=0)


class ServingSLOGuardrail(Guardrail):
    """``check_guardrails`` on the change's current version for the rollout controller: any
    breach is a config rollback. A version's series start with it, so its last cumulative
    counts are the window's.

    Only candidate windows are judged. A baseline window runs the config the job ran before
    the change; a serving job carries no state from one config to the next, so a breach there
    (a neighbour's burst, a slow launch config) says nothing against the candidate, and
    rolling back to that same baseline would not end it."""

    def __init__(self, config: ServingGuardrailConfig | None = None) -> None:
        base = config or ServingGuardrailConfig()
        self.config = ServingGuardrailConfig(**{**base.__dict__, "series_start_in_window": True})

    def check(self, change: Change, version: int, reader: StoreReader) -> Trip | None:
        """A config trip naming every guardrail the candidate breaches; None for a baseline."""
        if change.arm_of(version) != "candidate":
            return None
        breaches = check_guardrails(VersionReader(reader, change.job, version), self.config)
        return Trip(kind="config", reason="; ".join(breaches)) if breaches else None
