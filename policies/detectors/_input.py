"""Input-bound training: the step waits on its data loader for a large share of the time."""

from __future__ import annotations

from dataclasses import dataclass

from collectors import ConfigError
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._steps import DATA_WAIT, RANK_ATTR, STEP_DURATION, histogram_totals


@dataclass(frozen=True, slots=True, kw_only=True)
class InputBoundConfig:
    """The wait share above which a rank is input-bound, and what to suggest.

    ``wait_ratio`` = seconds the ``data_wait`` histogram gained / seconds the ``step.duration``
    histogram gained over the window. Where the loop fetches a batch outside ``step()`` (the
    demo does), that is wait / compute; where inside, wait / step wall time. Either way 0.2
    means data loading costs a fifth of the compute it feeds. Needs ``min_steps`` steps.
    """

    max_wait_ratio: float = 0.2
    min_steps: int = 5
    num_workers: int = 4
    prefetch_factor: int = 4

    def __post_init__(self) -> None:
        if not self.max_wait_ratio > 0:
            raise ConfigError(f"max_wait_ratio must be > 0, got {self.max_wait_ratio}")
        if self.min_steps < 1:
            raise ConfigError(f"min_steps must be >= 1, got {self.min_steps}")
        if self.num_workers < 1 or self.prefetch_factor < 1:
            raise ConfigError("num_workers and prefetch_factor must be >= 1, got "
                             f"{self.num_workers} and {self.prefetch_factor}")


class InputBoundDetector(Detector):
    """Flags each rank whose data wait exceeds ``max_wait_ratio`` of its step time."""

    def __init__(self, config: InputBoundConfig | None = None, *,
                 name: str = "input_bound") -> None:
        self.config = config or InputBoundConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        steps = histogram_totals(window, STEP_DURATION, [RANK_ATTR])
        waits = histogram_totals(window, DATA_WAIT, [RANK_ATTR])
        if steps.empty or waits.empty:
            return []
        keys = [c for c in (RANK_ATTR,) if c in steps.columns and c in waits.columns]
        joined = (steps.merge(waits, on=keys, suffixes=("_step", "_wait")) if keys
                  else steps.add_suffix("_step").join(waits.add_suffix("_wait")))
        findings = []
        for _, row in joined.iterrows():
            if row["count_step"] < cfg.min_steps or not row["sum_step"] > 0:
                continue
            ratio = row["sum_wait"] / row["sum_step"]
            if ratio <= cfg.max_wait_ratio:
                continue
            per_step_wait = row["sum_wait"] / max(row["count_wait"], 1.0)
            findings.append(Finding(
                detector=self.name, job=window.job, severity="warning",
                resource={k: str(row[k]) for k in keys},
                evidence=Evidence(
                    summary=(f"the steps waited {row['sum_wait']:.3g} s for data against "
                             f"{row['sum_step']:.3g} s of step time ({ratio:.0%}) over "
                             f"{row['count_step']:.0f} steps"),
                    model="input-bound: sum(data_wait.duration) / sum(step.duration) over "
                          "the window",
                    measurements=(
                        Measurement(name="wait_ratio", value=float(ratio)),
                        Measurement(name="data_wait", value=float(row["sum_wait"]), unit="s"),
                        Measurement(name="step_time", value=float(row["sum_step"]), unit="s"),
                        Measurement(name="steps", value=float(row["count_step"]),
                                    unit="{step}"),
                        Measurement(name="mean_wait_per_batch", value=float(per_step_wait),
                                    unit="s")),
                    thresholds=(Threshold(measurement="wait_ratio", comparison=">",
                                          value=cfg.max_wait_ratio),)),
                suggested_changes=(
                    SuggestedChange(knob="dataloader.num_workers", value=cfg.num_workers,
                                    expected_effect=(
                                        "batches prepared in parallel with the step; up to "
                                        f"{per_step_wait * 1e3:.0f} ms less wait per batch")),
                    SuggestedChange(knob="dataloader.prefetch_factor", value=cfg.prefetch_factor,
                                    expected_effect="batches queued ahead absorb slow ones")),
            ))
        return findings
