"""Truth 2: at small batch, reduced precision can cost more than it saves.

With few samples per step the kernels are small, and the casts autocast inserts add launches
that the cheaper arithmetic does not pay back (the seed measured +23% kernel-launch latency at
batch <= 8). The rule here does not assume that: it compares the step times the job actually
measured under fp32 and under reduced precision at the same small batch, and flags the reduced
precision only where it is not faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from collectors import CONFIG_VERSION_ATTR, ConfigError
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._steps import (
    BATCH_SIZE_ATTR,
    PRECISION_ATTR,
    REDUCED_PRECISIONS,
    STEP_DURATION,
    TOKENS_PER_S,
    histogram_totals,
    per_step,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SmallBatchPrecisionConfig:
    """Which batches count as small, and how much faster reduced precision must be.

    Reduced precision is "not faster" when its mean step time is above ``1 - min_speedup``
    times fp32's at the same batch, i.e. it saves less than ``min_speedup`` of the step.
    Each side needs ``min_steps`` steps in the window.
    """

    max_batch: int = 8
    min_speedup: float = 0.05
    min_steps: int = 5
    baseline: str = "fp32"

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if not 0 <= self.min_speedup < 1:
            raise ConfigError(f"min_speedup must be in [0, 1), got {self.min_speedup}")
        if self.min_steps < 1:
            raise ConfigError(f"min_steps must be >= 1, got {self.min_steps}")


class SmallBatchPrecisionDetector(Detector):
    """Flags reduced precision at batch <= ``max_batch`` that is not faster than fp32.

    Needs points tagged with ``seedance.precision`` and ``seedance.batch_size`` (job-level
    attributes) and both precisions measured at the same batch inside the window, normally
    under two config versions. Mean step time per side = seconds / steps the
    ``seedance.train.step.duration`` histogram gained; tokens per second (median of per-step
    readings) is shown beside it. One finding per job: the worst small batch.
    """

    def __init__(self, config: SmallBatchPrecisionConfig | None = None, *,
                 name: str = "small_batch_precision") -> None:
        self.config = config or SmallBatchPrecisionConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        totals = histogram_totals(window, STEP_DURATION, [BATCH_SIZE_ATTR, PRECISION_ATTR])
        if totals.empty or not {BATCH_SIZE_ATTR, PRECISION_ATTR} <= set(totals.columns):
            return []
        totals = totals[totals["count"] >= cfg.min_steps].copy()
        totals["batch"] = pd.to_numeric(totals[BATCH_SIZE_ATTR], errors="coerce")
        totals["step_s"] = totals["sum"] / totals["count"]
        small = totals[totals["batch"] <= cfg.max_batch]
        tokens = per_step(window, TOKENS_PER_S)
        worst: tuple[float, Finding] | None = None
        for (batch,), rows in small.groupby(["batch"]):
            base = rows[rows[PRECISION_ATTR] == cfg.baseline]
            if base.empty:
                continue
            b = base.iloc[0]
            for _, r in rows[rows[PRECISION_ATTR].isin(REDUCED_PRECISIONS)].iterrows():
                ratio = r["step_s"] / b["step_s"]
                if ratio < 1 - cfg.min_speedup:
                    continue
                finding = self._finding(window, int(batch), b, r, ratio, tokens)
                if worst is None or ratio > worst[0]:
                    worst = (ratio, finding)
        return [] if worst is None else [worst[1]]

    def _finding(self, window: StoreWindow, batch: int, base: pd.Series, reduced: pd.Series,
                 ratio: float, tokens: pd.DataFrame) -> Finding:
        cfg = self.config
        low, high = cfg.baseline, str(reduced[PRECISION_ATTR])
        measurements = [
            Measurement(name="batch_size", value=float(batch), unit="{sample}"),
            Measurement(name=f"{low}_step_time", value=float(base["step_s"]), unit="s"),
            Measurement(name=f"{high}_step_time", value=float(reduced["step_s"]), unit="s"),
            Measurement(name=f"{low}_steps", value=float(base["count"]), unit="{step}"),
            Measurement(name=f"{high}_steps", value=float(reduced["count"]), unit="{step}"),
            Measurement(name="step_time_ratio", value=float(ratio)),
        ]
        for precision in (low, high):
            rate = _median_tokens(tokens, batch, precision)
            if rate is not None:
                measurements.append(Measurement(name=f"{precision}_tokens_per_second",
                                                value=rate, unit="{token}/s"))
            version = _latest_version(tokens, batch, precision)
            if version is not None:
                measurements.append(Measurement(name=f"{precision}_config_version",
                                                value=version))
        return Finding(
            detector=self.name, job=window.job, severity="warning", resource={},
            evidence=Evidence(
                summary=(f"at batch {batch}, {high} took {reduced['step_s'] * 1e3:.1f} ms per "
                         f"step against {base['step_s'] * 1e3:.1f} ms in {low} "
                         f"({ratio - 1:+.0%}): reduced precision is not faster here"),
                model=(f"small-batch precision (seed truth 2): batch <= {cfg.max_batch} and "
                       f"mean step time of {high} / {low} >= 1 - {cfg.min_speedup:g}"),
                measurements=tuple(measurements),
                thresholds=(
                    Threshold(measurement="batch_size", comparison="<=",
                              value=float(cfg.max_batch), unit="{sample}"),
                    Threshold(measurement="step_time_ratio", comparison=">=",
                              value=1 - cfg.min_speedup))),
            suggested_changes=(SuggestedChange(
                knob="precision", value=low,
                expected_effect=(f"step time back to the {base['step_s'] * 1e3:.1f} ms "
                                 f"measured in {low} ({1 / ratio - 1:+.0%} vs now) and no "
                                 "reduced-precision numerics")),),
        )


def _rows(tokens: pd.DataFrame, batch: int, precision: str) -> pd.DataFrame:
    if tokens.empty or not {BATCH_SIZE_ATTR, PRECISION_ATTR} <= set(tokens.columns):
        return tokens.iloc[0:0]
    batches = pd.to_numeric(tokens[BATCH_SIZE_ATTR], errors="coerce")
    return tokens[(batches == batch) & (tokens[PRECISION_ATTR] == precision)]


def _median_tokens(tokens: pd.DataFrame, batch: int, precision: str) -> float | None:
    rows = _rows(tokens, batch, precision)
    return float(rows["value"].median()) if len(rows) else None


def _latest_version(tokens: pd.DataFrame, batch: int, precision: str) -> float | None:
    rows = _rows(tokens, batch, precision)
    if rows.empty or CONFIG_VERSION_ATTR not in rows.columns:
        return None
    versions = pd.to_numeric(rows[CONFIG_VERSION_ATTR], errors="coerce").dropna()
    return float(versions.max()) if len(versions) else None
