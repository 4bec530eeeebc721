"""Compute-aware priors: which group's precision to lower first, and what it should earn.

The job's profiler (``collectors.torch_profile``) reports each module group's share of the
forward time, the dtypes each group computes in, and each dtype's square-matmul speed relative
to fp32, measured on the job's own device. Amdahl's law turns them into the step speed-up that
moving one group to a faster dtype can buy, so the tuner tries the group that holds the time
first instead of walking the knobs in a fixed order. A device where a dtype is not faster than
fp32 (bf16 and fp16 on most CPUs are 20-100x slower) gets no suggestion for it.

These findings are priors, not faults: severity info, one per group, each suggesting
``precision.<group>`` (the profiler names groups as those knobs are named) and stating
``expected_gain`` in its evidence, which the tuner ranks trials by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from collectors import CONFIG_VERSION_ATTR, ConfigError
from collectors.names import ATTR_HW_MODEL, DEVICE_MATMUL_SPEEDUP, TRAIN_GROUP_TIME_SHARE
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._model_view import DTYPE_ATTR, PRECISION_OF_DTYPE, computes_in
from policies.detectors._series import latest_version
from policies.detectors._steps import MODULE_GROUP_ATTR, STEP

GROUP_SHARE = TRAIN_GROUP_TIME_SHARE
MATMUL_SPEEDUP = DEVICE_MATMUL_SPEEDUP
DEVICE_MODEL_ATTR = ATTR_HW_MODEL
EXPECTED_GAIN = "expected_gain"
"""The evidence measurement with the suggestion's expected gain in step speed (0.45 = +45%)."""

LOW_RISK_PRECISIONS: tuple[str, ...] = ("bf16",)
"""What a prior may suggest: bf16 keeps fp32's exponent range. fp16 (needs loss scaling) and
fp8 (needs scaling factors) are only mentioned; a person decides on them."""


def amdahl_speedup(share: float, speedup: float) -> float:
    """Step speed-up when a part taking ``share`` of the step runs ``speedup`` times faster."""
    return 1.0 / (1.0 - share * (1.0 - 1.0 / speedup))


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputePriorsConfig:
    """Below ``min_gain`` expected step speed-up (0.02 = +2%) a move is not worth a trial."""

    min_gain: float = 0.02

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_gain) and self.min_gain >= 0):
            raise ConfigError(f"min_gain must be a finite number >= 0, got {self.min_gain}")


class ComputePriorsDetector(Detector):
    """One finding per module group computing in fp32 whose move to bf16 is expected to pay.

    Reads, for the newest config version in the window (nothing when the job has stepped
    under a newer version the profiler has not sampled yet): the median of each group's
    ``seedance.train.group.time_share`` over sampled steps and ranks, the dtypes of
    ``seedance.train.group.param_dtype`` (parameters or autocast; a group is judged only when
    it computes in fp32 alone), and the median ``seedance.device.matmul_speedup`` per dtype.
    The forward share stands in for the group's share of forward and backward, and the matmul
    speedup for the group's: both make the expected gain an upper bound.
    """

    def __init__(self, config: ComputePriorsConfig | None = None, *,
                 name: str = "compute_priors") -> None:
        self.config = config or ComputePriorsConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        shares = window.query(GROUP_SHARE)
        if shares.empty or MODULE_GROUP_ATTR not in shares.columns:
            return []
        shares = latest_version(shares)
        version = _version(shares)
        if version is not None:
            stepped = _version(window.query(STEP))
            if stepped is not None and stepped > version:
                return []  # the config in force now has no profile yet
        speedups, device = _speedups(window)
        faster = {p: s for p, s in speedups.items() if p in LOW_RISK_PRECISIONS and s > 1.0}
        if not faster:
            return []
        best = max(faster, key=faster.__getitem__)
        computes = computes_in(window, version)
        findings: list[tuple[float, Finding]] = []
        for group, rows in shares.groupby(MODULE_GROUP_ATTR, sort=True):
            if computes.get(str(group)) != {"fp32"}:
                continue
            share = float(rows["value"].median())
            factor = amdahl_speedup(share, faster[best])
            if factor - 1.0 < self.config.min_gain:
                continue
            findings.append((factor, self._finding(
                window, str(group), share, len(rows), best, factor, speedups, device)))
        return [f for _, f in sorted(findings, key=lambda pair: -pair[0])]

    def _finding(self, window: StoreWindow, group: str, share: float, samples: int,
                 best: str, factor: float, speedups: dict[str, float], device: str) -> Finding:
        speedup = speedups[best]
        others = {p: s for p, s in speedups.items()
                  if p not in LOW_RISK_PRECISIONS and p != "fp32" and s > 1.0}
        summary = (f"{share:.0%} of forward time is in group {group}, computed in fp32; {best} "
                   f"matmul measured {speedup:.3g}x faster here{f' ({device})' if device else ''}"
                   f"; expected x{factor:.3g} step speed")
        if others:
            summary += ("; " + ", ".join(f"{p} {s:.3g}x" for p, s in sorted(others.items()))
                        + " also faster, not suggested (needs scaling, a person decides)")
        measurements = [
            Measurement(name="group_time_share", value=share),
            Measurement(name=f"{best}_matmul_speedup", value=speedup),
            *(Measurement(name=f"{p}_matmul_speedup", value=s) for p, s in sorted(others.items())),
            Measurement(name="expected_step_speedup", value=factor),
            Measurement(name=EXPECTED_GAIN, value=factor - 1.0),
            Measurement(name="samples", value=float(samples), unit="{sample}"),
        ]
        return Finding(
            detector=self.name, job=window.job, severity="info",
            resource={"module_group": group},
            evidence=Evidence(
                summary=summary,
                model=("Amdahl: step speed-up = 1 / (1 - share x (1 - 1/speedup)), share = the "
                       "group's median share of forward time (a proxy for its share of forward "
                       "+ backward), speedup = square-matmul speed of "
                       f"{best} over fp32 on this device (an upper bound for the group)"),
                measurements=tuple(measurements),
                thresholds=(
                    Threshold(measurement=f"{best}_matmul_speedup", comparison=">", value=1.0),
                    Threshold(measurement=EXPECTED_GAIN, comparison=">=",
                              value=self.config.min_gain))),
            suggested_changes=(SuggestedChange(
                knob=f"precision.{group}", value=best,
                expected_effect=(f"step time x{1 / factor:.2f}, {1 / factor - 1:+.0%}, if the "
                                 f"group's time scales with the {best} matmul speedup")),),
        )


def _version(frame: pd.DataFrame) -> float | None:
    if frame.empty or CONFIG_VERSION_ATTR not in frame.columns:
        return None
    versions = pd.to_numeric(frame[CONFIG_VERSION_ATTR], errors="coerce").dropna()
    return float(versions.max()) if len(versions) else None


def _speedups(window: StoreWindow) -> tuple[dict[str, float], str]:
    """Median matmul speedup per precision over the window, and the device model named."""
    frame = window.query(MATMUL_SPEEDUP)
    if frame.empty or DTYPE_ATTR not in frame.columns:
        return {}, ""
    speedups = {PRECISION_OF_DTYPE.get(str(dtype), str(dtype)): float(rows["value"].median())
                for dtype, rows in frame.groupby(DTYPE_ATTR)}
    models = (frame[DEVICE_MODEL_ATTR].dropna() if DEVICE_MODEL_ATTR in frame.columns
              else pd.Series(dtype=object))
    return speedups, str(models.iloc[-1]) if len(models) else ""
