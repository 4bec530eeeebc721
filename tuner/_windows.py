"""What a measurement is: the measuring config, one version's window, and a comparison of
windows (docs/measurement.md derives them)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from collectors import ConfigError

Arm = Literal["baseline", "candidate"]
JobKind = Literal["train", "serve"]


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    """How windows are measured and compared."""

    warmup_steps: int = 1
    min_steps: int = 3
    min_window_s: float = 2.0
    max_window_s: float = 30.0
    window_cv: float = 0.05
    tokens_per_step: float | None = None
    confidence: float = 0.95
    interval: Literal["sequential", "t", "bootstrap"] = "sequential"
    planned_pairs: int = 8
    noise_floor: float = 0.02
    n_bootstrap: int = 4000
    loss_tolerance: float = 0.05
    latency_tolerance: float = 0.10
    seed: int = 0
    warmup_requests: int = 30
    min_requests: int = 60
    latency_quantile: float = 0.99
    min_token_agreement: float | None = None
    """A serving candidate is kept only with its agreement over all its windows at least this."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"MeasureConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.min_steps < 1:
            raise ConfigError(f"MeasureConfig.min_steps must be >= 1, got {self.min_steps}")
        if not 0 < self.min_window_s <= self.max_window_s:
            raise ConfigError(f"MeasureConfig.min_window_s must be > 0 and <= max_window_s, "
                             f"got {self.min_window_s} and {self.max_window_s}")
        if not self.window_cv > 0:
            raise ConfigError(f"MeasureConfig.window_cv must be > 0, got {self.window_cv}")
        if self.planned_pairs < 1:
            raise ConfigError(f"MeasureConfig.planned_pairs must be >= 1, "
                             f"got {self.planned_pairs}")
        if not self.noise_floor > 0:
            raise ConfigError(f"MeasureConfig.noise_floor must be > 0, got {self.noise_floor}")
        if self.tokens_per_step is not None and not self.tokens_per_step > 0:
            raise ConfigError("MeasureConfig.tokens_per_step must be > 0")
        if not 0.5 < self.confidence < 1:
            raise ConfigError(f"MeasureConfig.confidence must be in (0.5, 1), "
                             f"got {self.confidence}")
        if self.interval not in ("sequential", "t", "bootstrap"):
            raise ConfigError(f"MeasureConfig.interval must be sequential, t or bootstrap, "
                             f"got {self.interval!r}")
        if self.n_bootstrap < 100:
            raise ConfigError("MeasureConfig.n_bootstrap must be >= 100")
        if self.loss_tolerance < 0:
            raise ConfigError("MeasureConfig.loss_tolerance must be >= 0")
        if self.latency_tolerance < 0:
            raise ConfigError("MeasureConfig.latency_tolerance must be >= 0")
        if self.warmup_requests < 0:
            raise ConfigError(f"MeasureConfig.warmup_requests must be >= 0, "
                             f"got {self.warmup_requests}")
        if self.min_requests < 1:
            raise ConfigError(f"MeasureConfig.min_requests must be >= 1, got {self.min_requests}")
        if not 0 < self.latency_quantile < 1:
            raise ConfigError(f"MeasureConfig.latency_quantile must be in (0, 1), "
                             f"got {self.latency_quantile}")
        if self.min_token_agreement is not None and not 0 <= self.min_token_agreement <= 1:
            raise ConfigError(f"MeasureConfig.min_token_agreement must be in [0, 1], "
                             f"got {self.min_token_agreement}")


@dataclass(frozen=True, kw_only=True)
class Window:
    """What one version measured after its warm-up. Training: ``steps`` optimizer steps of
    ``step_s``. Serving: ``steps`` finished requests, ``step_s`` seconds per finished request,
    ``p99_s`` the latency quantile and ``quality`` the token agreement (NaN without points)
    over ``quality_tokens`` checked tokens (0: from the gauge, count unknown);
    ``loss`` is NaN."""

    version: int
    arm: Arm
    steps: int
    step_s: float
    tokens_per_s: float
    loss: float
    nonfinite_loss: bool
    start_ns: int
    end_ns: int
    p99_s: float = math.nan
    quality: float = math.nan
    quality_tokens: int = 0
    step_cv: float = math.nan

    def to_json(self) -> dict[str, Any]:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                for k, v in self.__dict__.items()}


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Candidate against baseline over paired windows; gains are relative (0.1 = +10%)."""

    pairs: int
    gain: float
    ci_low: float
    ci_high: float
    confidence: float
    loss_excess: float
    loss_ok: bool
    latency_excess: float = math.nan
    latency_ok: bool = True
    pair_ratios: tuple[float, ...] = ()
    """Each pair's candidate/baseline tokens/s (what a harm bound reads, not a test)."""
    quality: float = math.nan
    """The candidate's token agreement pooled over its windows (NaN: not measured)."""
    quality_tokens: int = 0
    quality_ok: bool = True
    earlier_pairs: int = 0
    """Pairs of an earlier, undecided trial of the same candidate against the same baseline
    that the gain and its interval pool (``Change.continued_ratios``); ``pairs`` and
    ``pair_ratios`` are this trial's own."""

    @property
    def improves(self) -> bool:
        """The interval excludes zero from above: a measured gain."""
        return self.pairs > 0 and self.ci_low > 0

    @property
    def regresses(self) -> bool:
        """The interval excludes zero from below: a measured loss of throughput."""
        return self.pairs > 0 and self.ci_high < 0

    def to_json(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "gain": self.gain, "ci_low": self.ci_low,
                "ci_high": self.ci_high, "width": self.ci_high - self.ci_low,
                "confidence": self.confidence,
                "loss_excess": self.loss_excess, "loss_ok": self.loss_ok,
                "latency_excess": self.latency_excess, "latency_ok": self.latency_ok,
                "quality": self.quality, "quality_tokens": self.quality_tokens,
                "quality_ok": self.quality_ok, "pair_ratios": list(self.pair_ratios),
                "earlier_pairs": self.earlier_pairs}


def windows_from_json(rows: Sequence[Mapping[str, Any]]) -> list[Window]:
    """Windows as ``Window.to_json`` wrote them (the rollout journal stores them so)."""
    return [Window(version=int(r["version"]), arm=r["arm"], steps=int(r["steps"]),
                   step_s=float(r["step_s"]), tokens_per_s=float(r["tokens_per_s"]),
                   loss=float(r["loss"]), nonfinite_loss=bool(r["nonfinite_loss"]),
                   start_ns=int(r["start_ns"]), end_ns=int(r["end_ns"]),
                   p99_s=float(r.get("p99_s", math.nan)),
                   quality=float(r.get("quality", math.nan)),
                   quality_tokens=int(r.get("quality_tokens", 0)),
                   step_cv=float(r.get("step_cv", math.nan))) for r in rows]
