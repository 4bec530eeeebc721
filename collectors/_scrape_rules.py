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

SOURCE_ATTR = "seedance.source"
"""Which exporter a scraped point came from."""

_PERCENT = 0.01
_MIB = float(2**20)
_MILLI = 1e-3

DCGM_LABELS: Mapping[str, str] = {
    "gpu": "gpu.index",
    "UUID": "hw.id",
    "pci_bus_id": "gpu.pci_address",
    "modelName": "hw.name",
    "Hostname": "host.name",
    "container": "k8s.container.name",
    "namespace": "k8s.namespace.name",
    "pod": "k8s.pod.name",
}
"""dcgm-exporter label -> our attribute; labels not listed are kept as they are."""

VLLM_LABELS: Mapping[str, str] = {
    "model_name": "gen_ai.request.model",
    "engine": "seedance.vllm.engine",
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
    _rule("DCGM_FI_DEV_GPU_UTIL", "hw.gpu.utilization", "%", _PERCENT, hw__gpu__task="general"),
    _rule("DCGM_FI_DEV_ENC_UTIL", "hw.gpu.utilization", "%", _PERCENT, hw__gpu__task="encoder"),
    _rule("DCGM_FI_DEV_DEC_UTIL", "hw.gpu.utilization", "%", _PERCENT, hw__gpu__task="decoder"),
    _rule("DCGM_FI_DEV_MEM_COPY_UTIL", "hw.gpu.memory.utilization", "%", _PERCENT),
    _rule("DCGM_FI_DEV_FB_USED", "hw.gpu.memory.usage", "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_TOTAL", "hw.gpu.memory.limit", "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_FREE", "seedance.gpu.memory.free", "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_RESERVED", "seedance.gpu.memory.reserved", "MiB", _MIB),
    _rule("DCGM_FI_DEV_POWER_USAGE", "hw.power", "W"),
    _rule("DCGM_FI_DEV_POWER_MGMT_LIMIT", "seedance.gpu.power.limit", "W"),
    _rule("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "hw.energy", "mJ", _MILLI),
    _rule("DCGM_FI_DEV_GPU_TEMP", "hw.temperature", "C"),
    _rule("DCGM_FI_DEV_MEMORY_TEMP", "seedance.gpu.memory.temperature", "C"),
    _rule("DCGM_FI_DEV_SM_CLOCK", "seedance.gpu.clock", "MHz", clock="sm"),
    _rule("DCGM_FI_DEV_MEM_CLOCK", "seedance.gpu.clock", "MHz", clock="memory"),
    _rule("DCGM_FI_DEV_XID_ERRORS", "seedance.gpu.xid.last", "code"),
    SeriesRule(series="DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", name="seedance.gpu.throttle_reasons",
               source_unit="bitmask", bits=THROTTLE_REASONS, bit_attribute="reason"),
    _rule("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "seedance.gpu.pcie.replays", "count"),
    _rule("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "seedance.gpu.nvlink.raw_bandwidth", "raw"),
    _rule("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "seedance.gpu.graphics_engine.active", "ratio"),
    _rule("DCGM_FI_PROF_SM_ACTIVE", "seedance.gpu.sm.active", "ratio"),
    _rule("DCGM_FI_PROF_SM_OCCUPANCY", "seedance.gpu.sm.occupancy", "ratio"),
    _rule("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "seedance.gpu.pipe.active", "ratio", pipe="tensor"),
    _rule("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "seedance.gpu.pipe.active", "ratio", pipe="fp64"),
    _rule("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "seedance.gpu.pipe.active", "ratio", pipe="fp32"),
    _rule("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "seedance.gpu.pipe.active", "ratio", pipe="fp16"),
    _rule("DCGM_FI_PROF_DRAM_ACTIVE", "seedance.gpu.dram.active", "ratio"),
    _rule("DCGM_FI_PROF_PCIE_TX_BYTES", "hw.gpu.io", "B/s", network__io__direction="transmit"),
    _rule("DCGM_FI_PROF_PCIE_RX_BYTES", "hw.gpu.io", "B/s", network__io__direction="receive"),
    _rule("DCGM_FI_PROF_NVLINK_TX_BYTES", "seedance.gpu.nvlink.throughput", "B/s",
          network__io__direction="transmit"),
    _rule("DCGM_FI_PROF_NVLINK_RX_BYTES", "seedance.gpu.nvlink.throughput", "B/s",
          network__io__direction="receive"),
)
"""dcgm-exporter fields. DCGM's profiling (``PROF``) fields are ratios in [0, 1] although some
dcgm-exporter CSVs (and the T4 fixture's DRAM_ACTIVE HELP) say "(in %)"; DCGM's field reference
and the values exporters print are ratios, so they are not scaled. ``PROF_PCIE_*_BYTES`` and
``PROF_NVLINK_*_BYTES`` are rates in bytes per second whatever TYPE the exporter declares."""

VLLM_RULES: tuple[SeriesRule, ...] = (
    # v1 name first: where both are exposed, the newer one fills the series.
    _rule("vllm:kv_cache_usage_perc", "seedance.serve.kv_cache.usage", "ratio"),
    _rule("vllm:gpu_cache_usage_perc", "seedance.serve.kv_cache.usage", "ratio"),
    _rule("vllm:inter_token_latency_seconds", "gen_ai.server.time_per_output_token", "s"),
    _rule("vllm:time_per_output_token_seconds", "gen_ai.server.time_per_output_token", "s"),
    _rule("vllm:time_to_first_token_seconds", "gen_ai.server.time_to_first_token", "s"),
    _rule("vllm:e2e_request_latency_seconds", "gen_ai.server.request.duration", "s"),
    _rule("vllm:prefix_cache_hits", "seedance.serve.prefix_cache.hit_tokens", "token"),
    _rule("vllm:prefix_cache_queries", "seedance.serve.prefix_cache.query_tokens", "token"),
    _rule("vllm:gpu_prefix_cache_hit_rate", "seedance.serve.prefix_cache.hit_ratio", "ratio"),
    _rule("vllm:num_preemptions", "seedance.serve.preemptions", "request"),
    _rule("vllm:num_requests_running", "seedance.serve.batch_size", "request"),
    _rule("vllm:num_requests_waiting", "seedance.serve.queue_depth", "request"),
    _rule("vllm:prompt_tokens", "seedance.serve.prompt_tokens", "token"),
    _rule("vllm:generation_tokens", "seedance.serve.generation_tokens", "token"),
    _rule("vllm:avg_generation_throughput_toks_per_s", "seedance.serve.tokens_per_second",
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
