"""Hardware figures the cost models need: datasheet specs, peak memory and PCIe bandwidth.

Every figure here is either read from the device (NVML inputs) or copied from a vendor
datasheet named next to it; a figure nobody published is ``None``, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_GB = 1e9  # datasheets quote decimal GB/s


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    """Datasheet figures of one GPU model.

    ``critical_saturation`` is the seed's x/B knee of the bandwidth-saturation model (section
    2.1); it is known only for V100 and A100. The seed's two points do not support a calibration
    for other models: fitting x/B* against the ridge point (peak FLOPS / bandwidth: V100 138.9,
    A100 80GB 153.0 FLOP/B) gives a slope of 0.04 per 14.1 FLOP/B, which puts H100 SXM
    (295 FLOP/B) at x/B* = 1.12, past the physical limit of 1. So every other model is ``None``
    until a measured calibration exists.
    """

    model: str
    memory_bandwidth_gb_s: float
    fp16_tensor_tflops: float | None
    critical_saturation: float | None
    source: str

    @property
    def memory_bandwidth_bytes_per_s(self) -> float:
        """Peak memory bandwidth in bytes per second."""
        return self.memory_bandwidth_gb_s * _GB


_V100_DS = "NVIDIA Tesla V100 datasheet (2020): SXM2 900 GB/s, 125 TFLOPS tensor"
_A100_DS = (
    "NVIDIA A100 Tensor Core GPU datasheet (2021): 40GB 1,555 GB/s; 80GB SXM 2,039 GB/s, "
    "80GB PCIe 1,935 GB/s; FP16 tensor 312 TFLOPS dense"
)
_H100_DS = (
    "NVIDIA H100 Tensor Core GPU datasheet (2023): SXM 3.35 TB/s, FP16 tensor 1,979 TFLOPS "
    "with sparsity (989.5 dense); PCIe 2 TB/s, 1,513 with sparsity (756.5 dense)"
)
_H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (2024): 4.8 TB/s, FP16 tensor 1,979 sparse"
_L40S_DS = "NVIDIA L40S datasheet (2023): 864 GB/s, FP16 tensor 362.05 dense (733 sparse)"
_T4_DS = "NVIDIA T4 datasheet (2019): 320+ GB/s, 65 TFLOPS mixed FP16/FP32"
_ARTICLE_KNEE = "; critical x/B from the seed, section 2.1"

# (pattern on the NVML device name, spec); the first match wins, so variants come first.
_SPECS: tuple[tuple[re.Pattern[str], GpuSpec], ...] = (
    (re.compile(r"V100S"), GpuSpec(model="V100S", memory_bandwidth_gb_s=1134.0,
                                   fp16_tensor_tflops=130.0, critical_saturation=None,
                                   source="NVIDIA V100S datasheet (2019): 1,134 GB/s, 130 TFLOPS")),
    (re.compile(r"V100.*PCI", re.I), GpuSpec(model="V100 PCIe", memory_bandwidth_gb_s=900.0,
                                             fp16_tensor_tflops=112.0, critical_saturation=0.68,
                                             source=_V100_DS + "; PCIe 112 TFLOPS" + _ARTICLE_KNEE)),
    (re.compile(r"V100"), GpuSpec(model="V100 SXM2", memory_bandwidth_gb_s=900.0,
                                  fp16_tensor_tflops=125.0, critical_saturation=0.68,
                                  source=_V100_DS + _ARTICLE_KNEE)),
    (re.compile(r"A100.*80GB.*PCI", re.I), GpuSpec(model="A100 80GB PCIe",
                                                   memory_bandwidth_gb_s=1935.0,
                                                   fp16_tensor_tflops=312.0,
                                                   critical_saturation=0.72,
                                                   source=_A100_DS + _ARTICLE_KNEE)),
    (re.compile(r"A100.*80GB"), GpuSpec(model="A100 80GB SXM", memory_bandwidth_gb_s=2039.0,
                                        fp16_tensor_tflops=312.0, critical_saturation=0.72,
                                        source=_A100_DS + _ARTICLE_KNEE)),
    (re.compile(r"A100"), GpuSpec(model="A100 40GB", memory_bandwidth_gb_s=1555.0,
                                  fp16_tensor_tflops=312.0, critical_saturation=0.72,
                                  source=_A100_DS + _ARTICLE_KNEE)),
    (re.compile(r"H100.*PCI", re.I), GpuSpec(model="H100 PCIe", memory_bandwidth_gb_s=2000.0,
                                             fp16_tensor_tflops=756.5, critical_saturation=None,
                                             source=_H100_DS)),
    (re.compile(r"H100(?!.*NVL)"), GpuSpec(model="H100 SXM", memory_bandwidth_gb_s=3350.0,
                                           fp16_tensor_tflops=989.5, critical_saturation=None,
                                           source=_H100_DS)),
    (re.compile(r"H200(?!.*NVL)"), GpuSpec(model="H200 SXM", memory_bandwidth_gb_s=4800.0,
                                           fp16_tensor_tflops=989.5, critical_saturation=None,
                                           source=_H200_DS)),
    (re.compile(r"L40S"), GpuSpec(model="L40S", memory_bandwidth_gb_s=864.0,
                                  fp16_tensor_tflops=362.05, critical_saturation=None,
                                  source=_L40S_DS)),
    (re.compile(r"\bT4\b"), GpuSpec(model="T4", memory_bandwidth_gb_s=320.0,
                                    fp16_tensor_tflops=65.0, critical_saturation=None,
                                    source=_T4_DS)),
)

GPU_SPECS: tuple[GpuSpec, ...] = tuple(spec for _, spec in _SPECS)
"""Every GPU model the table knows, most specific variant first."""


def gpu_spec(device_name: str) -> GpuSpec | None:
    """The datasheet spec for an NVML device name (``"NVIDIA A100-SXM4-80GB"``), else None."""
    for pattern, spec in _SPECS:
        if pattern.search(device_name):
            return spec
    return None


def critical_saturation(device_name: str) -> float | None:
    """The seed's critical x/B for this GPU, or None when nobody measured it (section 2.1)."""
    spec = gpu_spec(device_name)
    return spec.critical_saturation if spec else None


def peak_memory_bandwidth_bytes_per_s(
    bus_width_bits: int, memory_clock_mhz: float, *, transfers_per_clock: int = 2
) -> float:
    """Peak memory bandwidth from NVML readings, in bytes per second.

    ``bus_width_bits`` from ``nvmlDeviceGetMemoryBusWidth``, ``memory_clock_mhz`` from
    ``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)``; HBM and GDDR move data on both clock edges
    as NVML reports the clock, hence 2 transfers per clock (A100 80GB: 5120 bit x 1593 MHz x 2
    / 8 = 2039 GB/s; L40S: 384 bit x 9001 MHz x 2 / 8 = 864 GB/s).
    """
    if bus_width_bits <= 0 or memory_clock_mhz <= 0 or transfers_per_clock <= 0:
        raise ValueError(
            f"bus_width_bits, memory_clock_mhz and transfers_per_clock must be > 0, got "
            f"{bus_width_bits}, {memory_clock_mhz}, {transfers_per_clock}"
        )
    return bus_width_bits / 8 * memory_clock_mhz * 1e6 * transfers_per_clock


# PCIe: (transfer rate in GT/s per lane, payload fraction after line encoding).
# Gen 1-2 use 8b/10b, gen 3-5 128b/130b (PCI-SIG base specifications 1.0a-5.0);
# gen 6 uses 1b/1b PAM4 FLIT mode, 242 of every 256 flit bytes carry TLP/DLLP data (PCIe 6.0).
_PCIE_LANE: dict[int, tuple[float, float]] = {
    1: (2.5, 8 / 10),
    2: (5.0, 8 / 10),
    3: (8.0, 128 / 130),
    4: (16.0, 128 / 130),
    5: (32.0, 128 / 130),
    6: (64.0, 242 / 256),
}


def pcie_lane_bandwidth_bytes_per_s(generation: int) -> float:
    """Peak one-direction bandwidth of one PCIe lane after line encoding, in bytes per second.

    Gen 1 250 MB/s, gen 2 500, gen 3 984.6, gen 4 1969.2, gen 5 3938.5, gen 6 7562.5.
    """
    if generation not in _PCIE_LANE:
        raise ValueError(f"generation must be one of {sorted(_PCIE_LANE)}, got {generation}")
    gt_per_s, efficiency = _PCIE_LANE[generation]
    return gt_per_s * 1e9 * efficiency / 8


def peak_pcie_bandwidth_bytes_per_s(generation: int, width_lanes: int) -> float:
    """Peak one-direction PCIe bandwidth of a link (generation x width), in bytes per second.

    Inputs as NVML reports them (``nvmlDeviceGetCurrPcieLinkGeneration`` / ``...Width``).
    Protocol overhead (TLP headers, flow control) is not subtracted: the seed's measured
    28.3 GB/s on PCIe 5.0 x16 is 45% of the 63.0 GB/s this returns.
    """
    if width_lanes <= 0:
        raise ValueError(f"width_lanes must be > 0, got {width_lanes}")
    return pcie_lane_bandwidth_bytes_per_s(generation) * width_lanes
