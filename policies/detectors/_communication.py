"""Communication detectors: all-reduce bandwidth degradation, and buckets too small to pay.

Both read the DDP comm hook's metrics (``collectors.torch_collective``) as the store holds them:
cumulative ``seedance.comm.allreduce.calls``/``bytes`` and the ``duration`` histogram's
``.count``/``.sum``. Per export interval that gives the mean message size S and mean latency t;
the ranks n come from the ``busbw``/``algbw`` gauges (their ratio is 2(n-1)/n), so the bus
bandwidth is S x 2(n-1)/n / t, as nccl-tests defines it.

Degradation is judged against the alpha-beta model :func:`policies.allreduce_time_s`: a message
of S bytes should take alpha + 2(n-1)/n S / B on a link of peak B, alpha being the fixed cost of
one call (estimated as the fastest interval's latency, an upper bound). The ratio
expected / measured time is ~1 on a healthy path at every size (small messages are latency
bound on any link, so they are not mistaken for a slow link), and falls to a few percent when
the fast path is gone. Published nccl-tests figures (README of the real samples) put healthy
fast paths at 74-84% of their NVLink peak and P2P-disabled paths at 1.7-6.9%, so
``degraded_ratio`` = 0.25 separates them with margin. The link peak B is the configured one, or
the GPU's NVLink peak per direction (:data:`NVLINK_PEAK_BYTES_PER_S`) for NVLink models. Without
either, only the job's own baseline is judged: the recent intervals' bus bandwidth against the
best of the window's earlier ones at a comparable message size (the seed's case fell to 52%).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import ConfigError
from policies._communication_cost import allreduce_calls, allreduce_time_s
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, Severity, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._series import interval_increases, latest_version

CALLS = "seedance.comm.allreduce.calls"
BYTES = "seedance.comm.allreduce.bytes"
DURATION_COUNT = "seedance.comm.allreduce.duration.count"
DURATION_SUM = "seedance.comm.allreduce.duration.sum"
ALGBW = "seedance.comm.allreduce.algbw"
BUSBW = "seedance.comm.allreduce.busbw"
STEP_BYTES = "seedance.comm.step_bytes"
STEP_COUNT = "seedance.train.step.duration.count"
STEP_SUM = "seedance.train.step.duration.sum"
RANK = "seedance.rank"
DDP_DEFAULT_BUCKET_BYTES = 25 * 2**20
"""``DistributedDataParallel(bucket_cap_mb=25)``, PyTorch's default bucket."""

# Per-direction NVLink bandwidth per GPU (half the datasheets' bidirectional totals):
# A100 SXM NVLink3 600 GB/s, H100/H200 SXM NVLink4 900 GB/s (A100 and H100 datasheets),
# A40 NVLink bridge 112.5 GB/s (A40 datasheet, 2 GPUs).
NVLINK_PEAK_BYTES_PER_S: tuple[tuple[re.Pattern[str], float], ...] = (
    (re.compile(r"A100(?!.*PCI)", re.I), 300e9),
    (re.compile(r"H[12]00(?!.*PCI)(?!.*NVL)", re.I), 450e9),
    (re.compile(r"A40\b", re.I), 56.25e9),
)


def nvlink_peak_bytes_per_s(device_name: str) -> float | None:
    """Per-direction NVLink peak of an NVLink GPU model (NVML name), else None."""
    for pattern, peak in NVLINK_PEAK_BYTES_PER_S:
        if pattern.search(device_name):
            return peak
    return None


def _bus_factor(window: StoreWindow, ranks_seen: int) -> float:
    """2(n-1)/n from the busbw/algbw gauges; from the ranks seen when the gauges are absent."""
    bus, alg = window.query(BUSBW), window.query(ALGBW)
    if not bus.empty and not alg.empty:
        alg_v = alg["value"].to_numpy(dtype=np.float64)
        bus_v = bus["value"].to_numpy(dtype=np.float64)[: alg_v.size]
        ok = alg_v[: bus_v.size] > 0
        if ok.any():
            return float(np.median(bus_v[ok] / alg_v[: bus_v.size][ok]))
    n = max(ranks_seen, 1)
    return 2 * (n - 1) / n if n > 1 else 1.0


def collective_intervals(window: StoreWindow) -> pd.DataFrame:
    """Per rank and export interval: time, calls, bytes, latency_s (mean per call), busbw.

    Uses the newest config version only. Empty when the hook's counters are missing.
    """
    frames = {name: latest_version(window.query(name))
              for name in (CALLS, BYTES, DURATION_COUNT, DURATION_SUM)}
    if any(f.empty for f in frames.values()):
        return pd.DataFrame()
    rows = []
    for (rank, calls), (_, sent), (_, count), (_, total) in zip(
            *(_per_rank(frames[n]) for n in (CALLS, BYTES, DURATION_COUNT, DURATION_SUM)),
            strict=False):
        parts = [interval_increases(f) for f in (calls, sent, count, total)]
        n = min(len(p) for p in parts)
        for k in range(n):
            d_calls, d_bytes, d_count, d_sum = (float(p["delta"].iloc[k]) for p in parts)
            if not (d_calls > 0 and d_count > 0 and d_sum > 0 and math.isfinite(d_bytes)):
                continue  # nothing counted, or missing (NaN) values: no interval
            rows.append({"rank": rank, "interval": k, "time": parts[0]["time"].iloc[k],
                         "calls": d_calls,
                         "bytes": d_bytes, "message_bytes": d_bytes / d_calls,
                         "latency_s": d_sum / d_count})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    factor = _bus_factor(window, out["rank"].nunique())
    out["busbw"] = out["message_bytes"] * factor / out["latency_s"]
    out.attrs["bus_factor"] = factor
    return out.sort_values(["time", "rank"], kind="stable").reset_index(drop=True)


def _fastest_rank(intervals: pd.DataFrame) -> pd.DataFrame:
    """Per interval index, the row of the rank with the shortest latency.

    A rank's all-reduce latency includes waiting for the slowest peer to arrive; the rank that
    arrives last waits least, so its latency is the collective's own time.
    """
    best = intervals.loc[intervals.groupby("interval")["latency_s"].idxmin()]
    return best.sort_values("interval").reset_index(drop=True)


def _per_rank(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    if RANK not in frame.columns:
        return [("0", frame)]
    return [(str(r), rows.reset_index(drop=True)) for r, rows in frame.groupby(RANK)]


def _device_name(window: StoreWindow) -> str:
    frame = window.query("hw.gpu.up")
    if frame.empty or "hw.name" not in frame.columns:
        return ""
    return str(frame["hw.name"].iloc[-1])


def _ranks_from_factor(factor: float) -> int:
    return max(1, round(2 / (2 - factor))) if factor < 2 else 1


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
    for rank, frame in _per_rank(steps):
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
        ranks = _ranks_from_factor(factor)
        peak = cfg.link_peak_bytes_per_s or nvlink_peak_bytes_per_s(_device_name(window))
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
        ranks = _ranks_from_factor(float(intervals.attrs["bus_factor"]))
        factor = float(intervals.attrs["bus_factor"])
        peak = cfg.link_peak_bytes_per_s or nvlink_peak_bytes_per_s(_device_name(window))
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
