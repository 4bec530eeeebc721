"""All-reduce bus bandwidth far below what the job's link should give, or below its own past.

A slow collective stalls every rank each step, and the usual cause (ranks placed off the NVLink
path, traffic bouncing through the host) is fixed by placement, not by the job.

Degradation is judged against the alpha-beta model :func:`policies.allreduce_time_s`: a message
of S bytes should take alpha + 2(n-1)/n S / B on a link of peak B, alpha being the fixed cost of
one call (estimated as the fastest interval's latency, an upper bound). The ratio
expected / measured time is ~1 on a healthy path at every size (small messages are latency
bound on any link, so they are not mistaken for a slow link), and falls to a few percent when
the fast path is gone. Published nccl-tests figures (README of the real samples) put healthy
fast paths at 74-84% of their NVLink peak and P2P-disabled paths at 1.7-6.9%, so
``degraded_ratio`` = 0.25 separates them with margin. The link peak B is the configured one, or
the GPU's NVLink peak per direction for NVLink models (``_collective_parts.py``). Without
either, only the job's own baseline is judged: the recent intervals' bus bandwidth against the
best of the window's earlier ones at a comparable message size (the seed's case fell to 52%).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import ConfigError
from collectors.names import TRAIN_STEP_DURATION_SUM
from policies._communication_cost import allreduce_time_s
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, Severity, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._collective_parts import (
    collective_intervals,
    device_name,
    nvlink_peak_bytes_per_s,
    per_rank,
    ranks_from_factor,
)
from policies.detectors._series import interval_increases, latest_version

STEP_SUM = TRAIN_STEP_DURATION_SUM


def _fastest_rank(intervals: pd.DataFrame) -> pd.DataFrame:
    """Per interval index, the row of the rank with the shortest latency.

    A rank's all-reduce latency includes waiting for the slowest peer to arrive; the rank that
    arrives last waits least, so its latency is the collective's own time.
    """
    best = intervals.loc[intervals.groupby("interval")["latency_s"].idxmin()]
    return best.sort_values("interval").reset_index(drop=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommunicationConfig:
    """Thresholds of :class:`CommunicationDegradationDetector`.

    ``link_peak_bytes_per_s``: the fabric's per-direction peak (None: the GPU's NVLink peak
    when its model has NVLink, else baseline only).
    """

    link_peak_bytes_per_s: float | None = None
    degraded_ratio: float = 0.25
    baseline_drop: float = 0.6
    min_intervals: int = 3
    recent_intervals: int = 3
    high_comm_share: float = 0.3
    max_alpha_s: float = 5e-4

    def __post_init__(self) -> None:
        if self.link_peak_bytes_per_s is not None and self.link_peak_bytes_per_s <= 0:
            raise ConfigError(f"link_peak_bytes_per_s must be > 0, got "
                             f"{self.link_peak_bytes_per_s}")
        for name in ("degraded_ratio", "baseline_drop", "high_comm_share"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ConfigError(f"{name} must be in (0, 1), got {value}")
        if self.min_intervals < 1 or self.recent_intervals < 1:
            raise ConfigError("min_intervals and recent_intervals must be >= 1")


def _comm_share(window: StoreWindow, intervals: pd.DataFrame) -> float | None:
    """Share of step time in all-reduce, of the rank that waits least (None: no step data)."""
    steps = latest_version(window.query(STEP_SUM))
    if steps.empty:
        return None
    shares = []
    for rank, frame in per_rank(steps):
        step_s = float(interval_increases(frame)["delta"].sum())
        mine = intervals[intervals["rank"] == rank]
        if step_s > 0 and not mine.empty:
            # bucket latencies overlap (a bucket queues behind earlier ones), so their sum is
            # an upper bound of the time in communication: clamp it at the step time
            shares.append(min(1.0, float((mine["calls"] * mine["latency_s"]).sum()) / step_s))
    return min(shares) if shares else None


_DEGRADATION_CHANGES = (
    SuggestedChange(knob="scheduler.policy", value="dynamic-topo",
                    expected_effect="places ranks by NVLink affinity so the ring stays on the "
                    "fast path (seed 2.2: hops 3 -> 1, NVLink traffic back from 52%)"),
    SuggestedChange(knob="scheduler.numa_aware", value=True,
                    expected_effect="keeps each rank on its GPU's NUMA node, no host bounce"),
)


class CommunicationDegradationDetector(Detector):
    """Flags a job whose all-reduce bus bandwidth is far below its link or its own baseline."""

    def __init__(self, config: CommunicationConfig | None = None, *,
                 name: str = "communication_degradation") -> None:
        self.config = config or CommunicationConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        intervals = collective_intervals(window)
        if len(intervals) < cfg.min_intervals:
            return []
        factor = float(intervals.attrs["bus_factor"])
        ranks = ranks_from_factor(factor)
        peak = cfg.link_peak_bytes_per_s or nvlink_peak_bytes_per_s(device_name(window))
        alpha_s = min(float(intervals["latency_s"].min()), cfg.max_alpha_s)
        if peak is not None:  # the part of each latency the bandwidth term does not explain
            residual = intervals["latency_s"] - intervals["message_bytes"] * factor / peak
            alpha_s = min(alpha_s, max(0.0, float(residual.min())))
        paths = _fastest_rank(intervals)
        recent = paths.tail(cfg.recent_intervals)
        busbw = float(recent["busbw"].median())
        message = float(recent["message_bytes"].median())
        measurements = [Measurement(name="busbw", value=busbw, unit="By/s"),
                        Measurement(name="message_bytes", value=message, unit="By"),
                        Measurement(name="ranks", value=float(ranks)),
                        Measurement(name="alpha_s", value=alpha_s, unit="s")]
        thresholds = []
        problems = []
        severity: Severity = "warning"
        model = "bus bandwidth S 2(n-1)/n / t per export interval"
        if peak is not None:
            expected = np.array([allreduce_time_s(s, ranks, bucket_bytes=max(s, 1.0),
                                                  alpha_s=alpha_s, beta_s_per_byte=1 / peak)
                                 for s in recent["message_bytes"]])
            ratio = float(np.median(expected / recent["latency_s"].to_numpy()))
            measurements += [Measurement(name="link_peak", value=peak, unit="By/s"),
                             Measurement(name="expected_over_measured_time", value=ratio)]
            thresholds.append(Threshold(measurement="expected_over_measured_time",
                                        comparison="<", value=cfg.degraded_ratio))
            model = ("policies.allreduce_time_s alpha-beta model: t = alpha + 2(n-1)/n S / B, "
                     "alpha = unexplained latency (<= max_alpha_s), B = link peak")
            if ratio < cfg.degraded_ratio:
                problems.append(f"all-reduce takes {1 / ratio:.1f}x the time the alpha-beta "
                                f"model expects on a {peak / 1e9:.4g} GB/s link "
                                f"(bus bandwidth {busbw / 1e9:.3g} GB/s)")
                severity = "critical"
        baseline = self._baseline(paths)
        if baseline is not None:
            measurements += [Measurement(name="baseline_busbw", value=baseline, unit="By/s"),
                             Measurement(name="busbw_over_baseline", value=busbw / baseline)]
            thresholds.append(Threshold(measurement="busbw_over_baseline", comparison="<",
                                        value=cfg.baseline_drop))
            if busbw / baseline < cfg.baseline_drop:
                problems.append(f"bus bandwidth fell to {busbw / baseline:.0%} of this job's "
                                f"baseline {baseline / 1e9:.3g} GB/s at the same message size")
        if not problems:
            return []
        share = _comm_share(window, intervals)
        if share is not None:
            measurements.append(Measurement(name="comm_share_of_step", value=share))
            if share >= cfg.high_comm_share:
                severity = "critical"
                problems.append(f"communication takes {share:.0%} of step time")
        return [Finding(
            detector=self.name, job=window.job, severity=severity, resource={},
            evidence=Evidence(summary="; ".join(problems), model=model,
                              measurements=tuple(measurements), thresholds=tuple(thresholds)),
            suggested_changes=_DEGRADATION_CHANGES,
        )]

    def _baseline(self, per_time: pd.DataFrame) -> float | None:
        """Median bus bandwidth of the earlier intervals at a message size within 2x of now."""
        if len(per_time) < 2 * self.config.recent_intervals:
            return None
        earlier = per_time.iloc[: -self.config.recent_intervals]
        now = float(per_time["message_bytes"].iloc[-self.config.recent_intervals:].median())
        similar = earlier[(earlier["message_bytes"] >= now / 2)
                          & (earlier["message_bytes"] <= now * 2)]
        if similar.empty:
            return None
        return float(similar["busbw"].median())
