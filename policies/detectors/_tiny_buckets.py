"""Gradients all-reduced in many small calls per step, each paying a call's fixed latency.

DDP sends a step's gradients in buckets; buckets far below PyTorch's default make the step's
communication a sum of per-call latencies rather than bytes over the link, which a larger
``ddp.bucket_cap_mb`` removes without touching the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from collectors import ConfigError
from collectors.names import COMM_STEP_BYTES
from policies._communication_cost import allreduce_calls, allreduce_time_s
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._collective_parts import (
    collective_intervals,
    device_name,
    nvlink_peak_bytes_per_s,
    ranks_from_factor,
)
from policies.detectors._series import latest_version

STEP_BYTES = COMM_STEP_BYTES
DDP_DEFAULT_BUCKET_BYTES = 25 * 2**20
"""``DistributedDataParallel(bucket_cap_mb=25)``, PyTorch's default bucket."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyBucketConfig:
    """Thresholds of :class:`TinyBucketDetector` (defaults: PyTorch DDP's bucket sizes)."""

    min_calls_per_step: float = 8.0
    max_bytes_per_call: float = 2**20
    target_bucket_bytes: int = DDP_DEFAULT_BUCKET_BYTES
    min_fixed_share: float = 0.5
    link_peak_bytes_per_s: float | None = None
    min_intervals: int = 2

    def __post_init__(self) -> None:
        if self.min_calls_per_step <= 1:
            raise ConfigError(f"min_calls_per_step must be > 1, got {self.min_calls_per_step}")
        if self.max_bytes_per_call <= 0 or self.target_bucket_bytes <= 0:
            raise ConfigError("max_bytes_per_call and target_bucket_bytes must be > 0")
        if not 0 < self.min_fixed_share < 1:
            raise ConfigError(f"min_fixed_share must be in (0, 1), got {self.min_fixed_share}")
        if self.min_intervals < 1:
            raise ConfigError(f"min_intervals must be >= 1, got {self.min_intervals}")


class TinyBucketDetector(Detector):
    """Flags a job that all-reduces its gradients in many small, latency-bound calls per step.

    Calls per step = bytes per step (``seedance.comm.step_bytes``) / mean bytes per call. When
    the link peak is known (config or NVLink model) the call must also be latency-dominated:
    the share of its time the bandwidth term 2(n-1)/n S / B does not explain is at least
    ``min_fixed_share``; without a known peak that share is not judged and the evidence says so.
    The expected effect is the alpha-beta model's (:func:`policies.allreduce_time_s`) time at
    the current and at the target bucket size, alpha being the measured time per call.
    """

    def __init__(self, config: TinyBucketConfig | None = None, *,
                 name: str = "tiny_buckets") -> None:
        self.config = config or TinyBucketConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        intervals = collective_intervals(window)
        step_bytes_frame = latest_version(window.query(STEP_BYTES))
        if len(intervals) < cfg.min_intervals or step_bytes_frame.empty:
            return []
        step_bytes = float(step_bytes_frame["value"].median())  # NaN when all are missing
        if not step_bytes > 0:
            return []
        message = float((intervals["bytes"].sum()) / intervals["calls"].sum())
        latency = float((intervals["latency_s"] * intervals["calls"]).sum()
                        / intervals["calls"].sum())
        calls = step_bytes / message
        if calls < cfg.min_calls_per_step or message > cfg.max_bytes_per_call:
            return []
        ranks = ranks_from_factor(float(intervals.attrs["bus_factor"]))
        factor = float(intervals.attrs["bus_factor"])
        peak = cfg.link_peak_bytes_per_s or nvlink_peak_bytes_per_s(device_name(window))
        measurements = [Measurement(name="calls_per_step", value=calls),
                        Measurement(name="bytes_per_call", value=message, unit="By"),
                        Measurement(name="latency_per_call", value=latency, unit="s"),
                        Measurement(name="step_bytes", value=step_bytes, unit="By")]
        thresholds = [Threshold(measurement="calls_per_step", comparison=">=",
                                value=cfg.min_calls_per_step),
                      Threshold(measurement="bytes_per_call", comparison="<=",
                                value=cfg.max_bytes_per_call)]
        beta = 0.0
        if peak is not None:
            beta = 1 / peak
            fixed_share = max(0.0, 1 - message * factor * beta / latency)
            measurements.append(Measurement(name="fixed_cost_share", value=fixed_share))
            thresholds.append(Threshold(measurement="fixed_cost_share", comparison=">=",
                                        value=cfg.min_fixed_share))
            if fixed_share < cfg.min_fixed_share:
                return []
            alpha = latency * fixed_share
            judged = "latency-dominated per the alpha-beta model"
        else:
            alpha = latency
            judged = "link peak unknown, so the latency share was not judged"
        now_s = allreduce_time_s(step_bytes, ranks, bucket_bytes=message, alpha_s=alpha,
                                 beta_s_per_byte=beta)
        merged_calls = allreduce_calls(step_bytes, cfg.target_bucket_bytes)
        merged_s = allreduce_time_s(step_bytes, ranks, bucket_bytes=cfg.target_bucket_bytes,
                                    alpha_s=alpha, beta_s_per_byte=beta)
        measurements += [Measurement(name="comm_time_per_step_model", value=now_s, unit="s"),
                         Measurement(name="comm_time_per_step_merged", value=merged_s,
                                     unit="s")]
        return [Finding(
            detector=self.name, job=window.job,
            severity="warning" if now_s < 2 * merged_s or math.isclose(now_s, 0) else "critical",
            resource={},
            evidence=Evidence(
                summary=(f"{calls:.0f} all-reduce calls per step of {message / 1024:.3g} KiB "
                         f"each ({judged})"),
                model="policies.allreduce_time_s: calls x alpha + 2(n-1)/n S beta, alpha = "
                      "measured time per call",
                measurements=tuple(measurements), thresholds=tuple(thresholds)),
            suggested_changes=(SuggestedChange(
                knob="ddp.bucket_cap_mb", value=cfg.target_bucket_bytes / 2**20,
                expected_effect=(f"{calls:.0f} -> {merged_calls} calls per step; modelled "
                                 f"communication {now_s * 1e3:.3g} -> {merged_s * 1e3:.3g} ms "
                                 "per step")),),
        )]
