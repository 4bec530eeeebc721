"""The one example detector the engine tests use: mean of a gauge per GPU below a floor."""

from __future__ import annotations

from policies import Detector, Evidence, Finding, Measurement, StoreWindow, SuggestedChange
from policies import Threshold as Bound

UTILISATION = "hw.gpu.utilization"


class LowUtilisationDetector(Detector):
    """Flags each GPU whose mean ``hw.gpu.utilization`` in the window is below ``floor``."""

    def __init__(self, name: str = "low_utilisation", *, floor: float = 0.5) -> None:
        self._name = name
        self.floor = floor

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        frame = window.query(UTILISATION)
        if frame.empty or "gpu.index" not in frame.columns:
            return []
        findings = []
        for gpu, rows in frame.groupby("gpu.index"):
            mean = float(rows["value"].mean())
            if mean >= self.floor:
                continue
            findings.append(Finding(
                detector=self.name, job=window.job, resource={"gpu": str(gpu)},
                severity="critical" if mean < self.floor / 2 else "warning",
                evidence=Evidence(
                    summary=f"GPU {gpu} was busy {mean:.0%} of the window",
                    model="mean utilisation below a floor",
                    measurements=(Measurement(name="utilisation", value=mean),
                                  Measurement(name="samples", value=float(len(rows)))),
                    thresholds=(Bound(measurement="utilisation", comparison="<",
                                      value=self.floor),)),
                suggested_changes=(SuggestedChange(knob="dataloader.num_workers", value=8,
                                                   expected_effect="less time waiting for data"),),
            ))
        return findings
