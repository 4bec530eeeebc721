"""The scrape rule tables: how each exporter's families and labels become catalogue names.

One table per exporter (dcgm-exporter, vLLM), each rule naming the unit the exporter's HELP
text states and the factor into ours. ``collectors/_scrape_mapping.py`` applies them and
``collectors/catalogue.py`` prints them into docs/metrics.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import pynvml

from collectors._catalogue import BY_NAME
from collectors._errors import ConfigError
from collectors.names import (
    ATTR_GEN_AI_REQUEST_MODEL,
    ATTR_GPU_INDEX,
    ATTR_GPU_PCI_ADDRESS,
    ATTR_HOST_NAME,
    ATTR_HW_ID,
    ATTR_HW_NAME,
    ATTR_SEEDANCE_SOURCE,
    ATTR_SEEDANCE_VLLM_ENGINE,
    GEN_AI_SERVER_REQUEST_DURATION,
    GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
    GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
    GPU_CLOCK,
    GPU_DRAM_ACTIVE,
    GPU_GRAPHICS_ENGINE_ACTIVE,
    GPU_MEMORY_FREE,
    GPU_MEMORY_RESERVED,
    GPU_MEMORY_TEMPERATURE,
    GPU_NVLINK_RAW_BANDWIDTH,
    GPU_NVLINK_THROUGHPUT,
    GPU_PCIE_REPLAYS,
    GPU_PIPE_ACTIVE,
    GPU_POWER_LIMIT,
    GPU_SM_ACTIVE,
    GPU_SM_OCCUPANCY,
    GPU_THROTTLE_REASONS,
    GPU_XID_LAST,
    HW_ENERGY,
    HW_GPU_IO,
    HW_GPU_MEMORY_LIMIT,
    HW_GPU_MEMORY_USAGE,
    HW_GPU_MEMORY_UTILIZATION,
    HW_GPU_UTILIZATION,
    HW_POWER,
    HW_TEMPERATURE,
    SERVE_BATCH_SIZE,
    SERVE_GENERATION_TOKENS,
    SERVE_KV_CACHE_USAGE,
    SERVE_PREEMPTIONS,
    SERVE_PREFIX_CACHE_HIT_RATIO,
    SERVE_PREFIX_CACHE_HIT_TOKENS,
    SERVE_PREFIX_CACHE_QUERY_TOKENS,
    SERVE_PROMPT_TOKENS,
    SERVE_QUEUE_DEPTH,
    SERVE_TOKENS_PER_SECOND,
)

SOURCE_ATTR = ATTR_SEEDANCE_SOURCE
"""Which exporter a scraped point came from."""

_PERCENT = 0.01
_MIB = float(2**20)
_MILLI = 1e-3

DCGM_LABELS: Mapping[str, str] = {
    "gpu": ATTR_GPU_INDEX,
    "UUID": ATTR_HW_ID,
    "pci_bus_id": ATTR_GPU_PCI_ADDRESS,
    "modelName": ATTR_HW_NAME,
    "Hostname": ATTR_HOST_NAME,
    "container": "k8s.container.name",
    "namespace": "k8s.namespace.name",
    "pod": "k8s.pod.name",
}
"""dcgm-exporter label -> our attribute; labels not listed are kept as they are."""

VLLM_LABELS: Mapping[str, str] = {
    "model_name": ATTR_GEN_AI_REQUEST_MODEL,
    "engine": ATTR_SEEDANCE_VLLM_ENGINE,
}
"""vLLM label -> our attribute; labels not listed are kept as they are."""

THROTTLE_REASONS: Mapping[int, str] = {
    pynvml.nvmlClocksThrottleReasonGpuIdle: "gpu_idle",
    pynvml.nvmlClocksThrottleReasonApplicationsClocksSetting: "applications_clocks_setting",
    pynvml.nvmlClocksThrottleReasonSwPowerCap: "sw_power_cap",
    pynvml.nvmlClocksThrottleReasonHwSlowdown: "hw_slowdown",
    pynvml.nvmlClocksThrottleReasonSyncBoost: "sync_boost",
    pynvml.nvmlClocksThrottleReasonSwThermalSlowdown: "sw_thermal_slowdown",
    pynvml.nvmlClocksThrottleReasonHwThermalSlowdown: "hw_thermal_slowdown",
    pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown: "hw_power_brake_slowdown",
    pynvml.nvmlClocksThrottleReasonDisplayClockSetting: "display_clock_setting",
}
"""NVML clock-throttle bits (DCGM's mask is the same, 1:1) -> ``reason`` attribute values."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SeriesRule:
    """How one exporter family becomes one catalogue name.

    ``series`` is the family name as prometheus_client's parser gives it (counters without
    ``_total``). ``scale`` converts ``source_unit`` (the unit the exporter's HELP text states)
    into the catalogue unit; it applies to gauge and counter values, and histogram rules keep 1
    (every mapped histogram is already in seconds). ``bits`` turns a bitmask into one point
    per set bit, named by the attribute ``bit_attribute``.
    """

    series: str
    name: str
    source_unit: str
    scale: float = 1.0
    attributes: Mapping[str, str] = field(default_factory=dict)
    bits: Mapping[int, str] = field(default_factory=dict)
    bit_attribute: str = ""

    def __post_init__(self) -> None:
        if self.name not in BY_NAME:
            raise ConfigError(f"SeriesRule.name: {self.name!r} is not in the metric catalogue")
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ConfigError(f"SeriesRule.scale: expected a positive number, got {self.scale}")
        if bool(self.bits) != bool(self.bit_attribute):
            raise ConfigError("SeriesRule.bit_attribute: set it exactly when bits are set")

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Rules with the same key fill the same series; the first one present wins."""
        return self.name, tuple(sorted(self.attributes.items()))


def _rule(
    series: str, name: str, source_unit: str, scale: float = 1.0, **attrs: str
) -> SeriesRule:
    """A rule; attribute keywords spell dots as ``__`` (``hw__gpu__task`` = ``hw.gpu.task``)."""
    return SeriesRule(series=series, name=name, source_unit=source_unit, scale=scale,
                      attributes={key.replace("__", "."): v for key, v in attrs.items()})


DCGM_RULES: tuple[SeriesRule, ...] = (
    _rule("DCGM_FI_DEV_GPU_UTIL", HW_GPU_UTILIZATION, "%", _PERCENT, hw__gpu__task="general"),
    _rule("DCGM_FI_DEV_ENC_UTIL", HW_GPU_UTILIZATION, "%", _PERCENT, hw__gpu__task="encoder"),
    _rule("DCGM_FI_DEV_DEC_UTIL", HW_GPU_UTILIZATION, "%", _PERCENT, hw__gpu__task="decoder"),
    _rule("DCGM_FI_DEV_MEM_COPY_UTIL", HW_GPU_MEMORY_UTILIZATION, "%", _PERCENT),
    _rule("DCGM_FI_DEV_FB_USED", HW_GPU_MEMORY_USAGE, "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_TOTAL", HW_GPU_MEMORY_LIMIT, "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_FREE", GPU_MEMORY_FREE, "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_RESERVED", GPU_MEMORY_RESERVED, "MiB", _MIB),
    _rule("DCGM_FI_DEV_POWER_USAGE", HW_POWER, "W"),
    _rule("DCGM_FI_DEV_POWER_MGMT_LIMIT", GPU_POWER_LIMIT, "W"),
    _rule("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", HW_ENERGY, "mJ", _MILLI),
    _rule("DCGM_FI_DEV_GPU_TEMP", HW_TEMPERATURE, "C"),
    _rule("DCGM_FI_DEV_MEMORY_TEMP", GPU_MEMORY_TEMPERATURE, "C"),
    _rule("DCGM_FI_DEV_SM_CLOCK", GPU_CLOCK, "MHz", clock="sm"),
    _rule("DCGM_FI_DEV_MEM_CLOCK", GPU_CLOCK, "MHz", clock="memory"),
    _rule("DCGM_FI_DEV_XID_ERRORS", GPU_XID_LAST, "code"),
    SeriesRule(series="DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", name=GPU_THROTTLE_REASONS,
               source_unit="bitmask", bits=THROTTLE_REASONS, bit_attribute="reason"),
    _rule("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", GPU_PCIE_REPLAYS, "count"),
    _rule("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", GPU_NVLINK_RAW_BANDWIDTH, "raw"),
    _rule("DCGM_FI_PROF_GR_ENGINE_ACTIVE", GPU_GRAPHICS_ENGINE_ACTIVE, "ratio"),
    _rule("DCGM_FI_PROF_SM_ACTIVE", GPU_SM_ACTIVE, "ratio"),
    _rule("DCGM_FI_PROF_SM_OCCUPANCY", GPU_SM_OCCUPANCY, "ratio"),
    _rule("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", GPU_PIPE_ACTIVE, "ratio", pipe="tensor"),
    _rule("DCGM_FI_PROF_PIPE_FP64_ACTIVE", GPU_PIPE_ACTIVE, "ratio", pipe="fp64"),
    _rule("DCGM_FI_PROF_PIPE_FP32_ACTIVE", GPU_PIPE_ACTIVE, "ratio", pipe="fp32"),
    _rule("DCGM_FI_PROF_PIPE_FP16_ACTIVE", GPU_PIPE_ACTIVE, "ratio", pipe="fp16"),
    _rule("DCGM_FI_PROF_DRAM_ACTIVE", GPU_DRAM_ACTIVE, "ratio"),
    _rule("DCGM_FI_PROF_PCIE_TX_BYTES", HW_GPU_IO, "B/s", network__io__direction="transmit"),
    _rule("DCGM_FI_PROF_PCIE_RX_BYTES", HW_GPU_IO, "B/s", network__io__direction="receive"),
    _rule("DCGM_FI_PROF_NVLINK_TX_BYTES", GPU_NVLINK_THROUGHPUT, "B/s",
          network__io__direction="transmit"),
    _rule("DCGM_FI_PROF_NVLINK_RX_BYTES", GPU_NVLINK_THROUGHPUT, "B/s",
          network__io__direction="receive"),
)
"""dcgm-exporter fields. DCGM's profiling (``PROF``) fields are ratios in [0, 1] although some
dcgm-exporter CSVs (and the T4 fixture's DRAM_ACTIVE HELP) say "(in %)"; DCGM's field reference
and the values exporters print are ratios, so they are not scaled. ``PROF_PCIE_*_BYTES`` and
``PROF_NVLINK_*_BYTES`` are rates in bytes per second whatever TYPE the exporter declares."""

VLLM_RULES: tuple[SeriesRule, ...] = (
    # v1 name first: where both are exposed, the newer one fills the series.
    _rule("vllm:kv_cache_usage_perc", SERVE_KV_CACHE_USAGE, "ratio"),
    _rule("vllm:gpu_cache_usage_perc", SERVE_KV_CACHE_USAGE, "ratio"),
    _rule("vllm:inter_token_latency_seconds", GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN, "s"),
    _rule("vllm:time_per_output_token_seconds", GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN, "s"),
    _rule("vllm:time_to_first_token_seconds", GEN_AI_SERVER_TIME_TO_FIRST_TOKEN, "s"),
    _rule("vllm:e2e_request_latency_seconds", GEN_AI_SERVER_REQUEST_DURATION, "s"),
    _rule("vllm:prefix_cache_hits", SERVE_PREFIX_CACHE_HIT_TOKENS, "token"),
    _rule("vllm:prefix_cache_queries", SERVE_PREFIX_CACHE_QUERY_TOKENS, "token"),
    _rule("vllm:gpu_prefix_cache_hit_rate", SERVE_PREFIX_CACHE_HIT_RATIO, "ratio"),
    _rule("vllm:num_preemptions", SERVE_PREEMPTIONS, "request"),
    _rule("vllm:num_requests_running", SERVE_BATCH_SIZE, "request"),
    _rule("vllm:num_requests_waiting", SERVE_QUEUE_DEPTH, "request"),
    _rule("vllm:prompt_tokens", SERVE_PROMPT_TOKENS, "token"),
    _rule("vllm:generation_tokens", SERVE_GENERATION_TOKENS, "token"),
    _rule("vllm:avg_generation_throughput_toks_per_s", SERVE_TOKENS_PER_SECOND,
          "token/s"),
)
"""vLLM (``vllm:*``), v0 and v1 names. ``*_perc`` are fractions ("1 means 100 percent").
Prefix-cache hits and queries count tokens in v1, hence their own ``*_tokens`` names."""


@dataclass(frozen=True, slots=True)
class Exporter:
    """One exporter's vocabulary: how to recognise its families and what they become."""

    kind: str
    source: str
    prefix: str
    labels: Mapping[str, str]
    rules: tuple[SeriesRule, ...]


EXPORTERS: Mapping[str, Exporter] = {
    "dcgm": Exporter("dcgm", "dcgm-exporter", "DCGM_", DCGM_LABELS, DCGM_RULES),
    "vllm": Exporter("vllm", "vllm", "vllm:", VLLM_LABELS, VLLM_RULES),
}
