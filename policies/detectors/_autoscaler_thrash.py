"""Autoscaler thrash (seed 2.4): replicas added and removed so often the tail pays for it.

The replica count (``seedance.serve.replicas``, a gauge the serving job or its autoscaler
reports; not yet in the catalogue) changing often while the p99 request latency (from the
``gen_ai.server.request.duration`` histogram buckets) spikes right after each change: cold
starts and rebalance jitter. Seed 2.4's fix was static sharding, one shard per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import ConfigError
from collectors.names import SERVE_REPLICAS
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._request_latency import REQUEST_BUCKETS, p99_per_interval

REPLICAS = SERVE_REPLICAS


@dataclass(frozen=True, slots=True, kw_only=True)
class ThrashConfig:
    """Thresholds of :class:`AutoscalerThrashDetector`."""

    min_changes: int = 3
    settle_s: float = 60.0
    spike_ratio: float = 1.5

    def __post_init__(self) -> None:
        if self.min_changes < 1:
            raise ConfigError(f"min_changes must be >= 1, got {self.min_changes}")
        if self.settle_s <= 0:
            raise ConfigError(f"settle_s must be > 0, got {self.settle_s}")
        if self.spike_ratio <= 1:
            raise ConfigError(f"spike_ratio must be > 1, got {self.spike_ratio}")


class AutoscalerThrashDetector(Detector):
    """Flags a serving job whose replica count keeps changing with a p99 spike after changes."""

    def __init__(self, config: ThrashConfig | None = None, *,
                 name: str = "autoscaler_thrash") -> None:
        self.config = config or ThrashConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        replicas = window.query(REPLICAS)
        if len(replicas) < 2:
            return []
        series = replicas.groupby("time", sort=True)["value"].sum()
        changed = series.index[1:][np.diff(series.to_numpy()) != 0]
        if len(changed) < cfg.min_changes:
            return []
        p99 = p99_per_interval(window.query(REQUEST_BUCKETS))
        if p99.empty:
            return []
        settle = pd.Timedelta(seconds=cfg.settle_s)
        after = np.zeros(len(p99), dtype=bool)
        for t in changed:
            after |= (p99.index >= t) & (p99.index <= t + settle)
        if after.all() or not after.any():
            return []  # nothing to compare against
        spiked = float(p99[after].median())
        steady = float(p99[~after].median())
        ratio = spiked / steady if steady > 0 else math.inf
        if ratio < cfg.spike_ratio:
            return []
        span_min = max((series.index[-1] - series.index[0]).total_seconds() / 60, 1e-9)
        peak = int(series.max())
        return [Finding(
            detector=self.name, job=window.job,
            severity="critical" if ratio >= 2 * cfg.spike_ratio else "warning", resource={},
            evidence=Evidence(
                summary=(f"replica count changed {len(changed)} times "
                         f"({series.min():g}..{peak}) and p99 latency within "
                         f"{cfg.settle_s:g} s of a change was {ratio:.1f}x the steady p99"),
                model="replica changes per window with p99 (histogram_quantile over request "
                      "duration buckets) after a change vs steady; seed 2.4",
                measurements=(Measurement(name="replica_changes", value=float(len(changed))),
                              Measurement(name="changes_per_minute",
                                          value=len(changed) / span_min),
                              Measurement(name="p99_after_change", value=spiked, unit="s"),
                              Measurement(name="p99_steady", value=steady, unit="s"),
                              Measurement(name="p99_ratio", value=ratio)),
                thresholds=(Threshold(measurement="replica_changes", comparison=">=",
                                      value=cfg.min_changes),
                            Threshold(measurement="p99_ratio", comparison=">=",
                                      value=cfg.spike_ratio))),
            suggested_changes=(
                SuggestedChange(knob="serve.autoscaling.enabled", value=False,
                                expected_effect="no cold starts or rebalance jitter (seed 2.4: "
                                "p99 1842 -> 621 ms, QPS 12.3 -> 38.7 on Llama-3-70B)"),
                SuggestedChange(knob="serve.static_replicas", value=peak,
                                expected_effect="one pre-allocated shard per GPU at the peak "
                                "count the autoscaler reached"),
            ),
        )]
