"""Builds the sidecar's metric sources from its configuration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from collectors._nvml import GpuSampler
from collectors._nvml_backends import DisabledBackend, LiveNvmlBackend, NvmlBackend, ReplayBackend
from collectors._points import Point
from collectors.traces import trace_path
from tuner._config import SidecarConfig


def resolve_trace(name_or_path: str) -> Path:
    """A shipped trace name (h100_gpu_burn) or a trace file path."""
    return trace_path(name_or_path)


def gpu_backend(nvml: str) -> NvmlBackend:
    if nvml == "off":
        return DisabledBackend()
    if nvml.startswith("replay:"):
        return ReplayBackend(resolve_trace(nvml.removeprefix("replay:")))
    return LiveNvmlBackend()


def build_gpu_sampler(config: SidecarConfig) -> GpuSampler:
    from collectors._nvml import GpuSamplerConfig

    return GpuSampler(gpu_backend(config.nvml),
                      config=GpuSamplerConfig(interval_s=config.nvml_interval_s))


def build_scrapers(config: SidecarConfig, *, sink: Callable[[list[Point]], None]) -> list:
    from collectors._scrape import Scraper, ScrapeSource

    return [
        Scraper(ScrapeSource(url=s.url, job=config.job, kind=s.kind, interval_s=s.interval_s,
                             timeout_s=s.timeout_s), sink=sink)
        for s in config.scrape
    ]
