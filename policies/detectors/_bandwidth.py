"""Hardware saturation: device-memory bandwidth against the seed's knee, PCIe against its link.

Memory (seed 2.1). The pressure x/B is read, per GPU, from DCGM's ``DRAM_ACTIVE`` (fraction
of cycles the memory interface moved data) when a scrape provides it, else from NVML's memory
utilisation (fraction of the sample period memory was read or written, a coarser proxy of the
same ratio). It is judged against the GPU's critical saturation point from
:func:`policies.critical_saturation` (V100 0.68, A100 0.72). Where the seed gives none (H100,
H200, L40S, ...) the detector does not guess a per-model knee: it uses the seed's generic
"past x/B ~ 0.7" (:data:`GENERIC_KNEE`), says so in the evidence and caps the severity at
``info``. The demand x in bytes/s is x/B times the peak B: NVML's bus width x memory clock
(``seedance.gpu.memory.peak_bandwidth``) when known, else the datasheet figure
(:func:`policies.gpu_spec`); the effective compute fraction is
:func:`policies.bandwidth_saturation` of the two.

PCIe. Mean ``hw.gpu.io`` per direction against ``seedance.gpu.pcie.link.peak_bandwidth`` (the
encoded peak of the current generation x width). Real DMA transfers top out near 80% of that
peak, so ``pcie_fraction`` (0.7) of it is saturation. A link trained below its maximum
generation or width is named in the evidence: it is the usual reason for a low peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import ConfigError
from collectors.names import (
    ATTR_GPU_INDEX,
    ATTR_HW_NAME,
    ATTR_NETWORK_IO_DIRECTION,
    GPU_DRAM_ACTIVE,
    GPU_MEMORY_PEAK_BANDWIDTH,
    GPU_PCIE_LINK_GENERATION,
    GPU_PCIE_LINK_PEAK_BANDWIDTH,
    GPU_PCIE_LINK_WIDTH,
    HW_GPU_IO,
    HW_GPU_MEMORY_UTILIZATION,
)
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, Severity, SuggestedChange, Threshold
from policies._hardware import critical_saturation, gpu_spec
from policies._saturation import ARTICLE_COUPLING_K, bandwidth_saturation
from policies._window import StoreWindow

GENERIC_KNEE = 0.7
"""The seed's model-independent knee ("past x/B ~ 0.7", section 2.1), used when the GPU's own
critical point is unknown."""

DRAM_ACTIVE = GPU_DRAM_ACTIVE
MEMORY_UTILISATION = HW_GPU_MEMORY_UTILIZATION
MEMORY_PEAK = GPU_MEMORY_PEAK_BANDWIDTH
PCIE_IO = HW_GPU_IO
PCIE_PEAK = GPU_PCIE_LINK_PEAK_BANDWIDTH
PCIE_GENERATION = GPU_PCIE_LINK_GENERATION
PCIE_WIDTH = GPU_PCIE_LINK_WIDTH
GPU = ATTR_GPU_INDEX
_MODEL = (f"policies.bandwidth_saturation: f = 1 - exp(-k x/B), k = {ARTICLE_COUPLING_K}; knee "
          "x/B from policies.critical_saturation (seed 2.1)")


@dataclass(frozen=True, slots=True, kw_only=True)
class BandwidthConfig:
    """Thresholds of :class:`BandwidthSaturationDetector`."""

    min_samples: int = 3
    critical_margin: float = 0.1
    pcie_fraction: float = 0.7

    def __post_init__(self) -> None:
        if self.min_samples < 1:
            raise ConfigError(f"min_samples must be >= 1, got {self.min_samples}")
        if not 0 <= self.critical_margin < 1:
            raise ConfigError(f"critical_margin must be in [0, 1), got {self.critical_margin}")
        if not 0 < self.pcie_fraction <= 1:
            raise ConfigError(f"pcie_fraction must be in (0, 1], got {self.pcie_fraction}")


def _by_gpu(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The finite readings per GPU (a NaN reading is a missing one)."""
    if frame.empty or GPU not in frame.columns:
        return {}
    frame = frame[np.isfinite(frame["value"].to_numpy(dtype=float))]
    return {str(gpu): rows for gpu, rows in frame.groupby(GPU)}


def _last(frame: pd.DataFrame | None) -> float | None:
    return None if frame is None or frame.empty else float(frame["value"].iloc[-1])


class BandwidthSaturationDetector(Detector):
    """Flags GPUs whose memory bandwidth is past the seed's knee or whose PCIe link is full."""

    def __init__(self, config: BandwidthConfig | None = None, *,
                 name: str = "bandwidth_saturation") -> None:
        self.config = config or BandwidthConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        findings = self._memory(window)
        findings += self._pcie(window)
        return findings

    # -- device memory ------------------------------------------------------------------------

    def _memory(self, window: StoreWindow) -> list[Finding]:
        dram = _by_gpu(window.query(DRAM_ACTIVE))
        nvml = _by_gpu(window.query(MEMORY_UTILISATION))
        peaks = _by_gpu(window.query(MEMORY_PEAK))
        findings = []
        for gpu in sorted(set(dram) | set(nvml)):
            source, rows = ((DRAM_ACTIVE, dram[gpu]) if len(dram.get(gpu, ())) >=
                            self.config.min_samples else (MEMORY_UTILISATION, nvml.get(gpu)))
            if rows is None or len(rows) < self.config.min_samples:
                continue
            pressure = float(rows["value"].mean())
            device = str(rows[ATTR_HW_NAME].iloc[-1]) if ATTR_HW_NAME in rows.columns else ""
            knee = critical_saturation(device)
            known = knee is not None
            knee_used = knee if knee is not None else GENERIC_KNEE
            if pressure < knee_used:
                continue
            spec = gpu_spec(device)
            peak = _last(peaks.get(gpu)) or (spec.memory_bandwidth_bytes_per_s if spec else None)
            measurements = [Measurement(name="pressure_x_over_b", value=pressure),
                            Measurement(name="critical_x_over_b", value=knee_used),
                            Measurement(name="samples", value=float(len(rows)))]
            summary = (f"GPU {gpu} ({device or 'unknown model'}) kept its memory interface busy "
                       f"{pressure:.0%} of the time ({source})")
            if peak is not None:
                demand = pressure * peak
                measurements += [
                    Measurement(name="demand", value=demand, unit="By/s"),
                    Measurement(name="peak_bandwidth", value=peak, unit="By/s"),
                    Measurement(name="effective_compute_fraction",
                                value=bandwidth_saturation(demand, peak)),
                ]
            if known:
                summary += f", past the seed's critical point {knee_used:.2f} for this model"
                severity: Severity = ("critical" if pressure >= knee_used
                                      + self.config.critical_margin else "warning")
            else:
                summary += (f"; the seed gives no critical point for this model, so the generic "
                            f"knee {GENERIC_KNEE} was used and the severity is info")
                severity = "info"
            findings.append(Finding(
                detector=self.name, job=window.job, severity=severity,
                resource={"gpu": gpu, "link": "memory"},
                evidence=Evidence(
                    summary=summary, model=_MODEL, measurements=tuple(measurements),
                    thresholds=(Threshold(measurement="pressure_x_over_b", comparison=">=",
                                          value=knee_used),)),
                suggested_changes=(
                    SuggestedChange(knob="compiler.fuse_level", value="layer",
                                    expected_effect="fused layers keep intermediates on chip, "
                                    "fewer HBM round trips lower x/B below the knee"),
                    SuggestedChange(knob="precision.default", value="bf16",
                                    expected_effect="half the bytes per element moved, x/B "
                                    "roughly halves for memory-bound kernels"),
                ),
            ))
        return findings

    # -- PCIe -----------------------------------------------------------------------------------

    def _pcie(self, window: StoreWindow) -> list[Finding]:
        io = _by_gpu(window.query(PCIE_IO))
        peaks = _by_gpu(window.query(PCIE_PEAK))
        generation = _by_gpu(window.query(PCIE_GENERATION))
        width = _by_gpu(window.query(PCIE_WIDTH))
        findings = []
        for gpu, rows in sorted(io.items()):
            peak = _last(peaks.get(gpu))
            if peak is None or peak <= 0 or ATTR_NETWORK_IO_DIRECTION not in rows.columns:
                continue
            for direction, part in rows.groupby(ATTR_NETWORK_IO_DIRECTION):
                if len(part) < self.config.min_samples:
                    continue
                mean = float(part["value"].mean())
                fraction = mean / peak
                if fraction < self.config.pcie_fraction:
                    continue
                measurements = [Measurement(name="throughput", value=mean, unit="By/s"),
                                Measurement(name="link_peak", value=peak, unit="By/s"),
                                Measurement(name="fraction_of_peak", value=fraction)]
                summary = f"GPU {gpu} PCIe {direction} ran at {fraction:.0%} of its link's peak"
                downtrained = self._downtrained(generation.get(gpu), width.get(gpu))
                if downtrained:
                    summary += f"; the link is trained below its maximum ({downtrained})"
                changes = [SuggestedChange(
                    knob="dataloader.pin_memory", value=True,
                    expected_effect="page-locked buffers let copies overlap compute; "
                    "if the link stays full, keep the offloaded tensors on the device")]
                if downtrained:
                    changes.append(SuggestedChange(
                        knob="host.pcie_slot", value="reseat or move to a full-width slot",
                        expected_effect=f"restores the maximum link ({downtrained})"))
                findings.append(Finding(
                    detector=self.name, job=window.job,
                    severity="critical" if fraction >= 0.9 else "warning",
                    resource={"gpu": gpu, "link": f"pcie.{direction}"},
                    evidence=Evidence(
                        summary=summary,
                        model="PCIe throughput over the encoded link peak "
                        "(policies.peak_pcie_bandwidth_bytes_per_s: generation x width)",
                        measurements=tuple(measurements),
                        thresholds=(Threshold(measurement="fraction_of_peak", comparison=">=",
                                              value=self.config.pcie_fraction),)),
                    suggested_changes=tuple(changes),
                ))
        return findings

    @staticmethod
    def _downtrained(generation: pd.DataFrame | None, width: pd.DataFrame | None) -> str:
        words = []
        for label, frame in (("gen", generation), ("x", width)):
            if frame is None or "state" not in frame.columns:
                continue
            current = _last(frame[frame["state"] == "current"])
            top = _last(frame[frame["state"] == "max"])
            if current is not None and top is not None and current < top:
                words.append(f"{label}{current:g} of {label}{top:g}")
        return ", ".join(words)
