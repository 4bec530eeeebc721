"""Builds the sidecar's metric sources from its configuration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from collectors import (
    BY_NAME,
    DecodedMetrics,
    DisabledBackend,
    GpuSampler,
    GpuSamplerConfig,
    LiveNvmlBackend,
    MetricInfo,
    MetricKind,
    NvmlBackend,
    Point,
    ReplayBackend,
    Scraper,
    ScrapeSource,
    Temporality,
)
from collectors.traces import trace_path
from seedancectl._config import SidecarConfig


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
    return GpuSampler(gpu_backend(config.nvml),
                      config=GpuSamplerConfig(interval_s=config.nvml_interval_s))


def as_decoded(points: list[Point]) -> DecodedMetrics:
    """Scraped points with catalogue metadata where the name is known (gauge otherwise)."""
    metrics: dict[str, MetricInfo] = {}
    for point in points:
        if point.name in metrics:
            continue
        spec = BY_NAME.get(point.name)
        kind = spec.kind if spec is not None and spec.kind is not MetricKind.HISTOGRAM \
            else MetricKind.GAUGE
        metrics[point.name] = MetricInfo(
            name=point.name, kind=kind, otlp_type=kind.value, unit=spec.unit if spec else "",
            description=spec.description if spec else "", monotonic=kind is MetricKind.SUM,
            temporality=Temporality.CUMULATIVE,
        )
    return DecodedMetrics(points=points, metrics=metrics)


def build_scrapers(config: SidecarConfig, *, sink: Callable[[DecodedMetrics], None]
                   ) -> list[Scraper]:
    return [
        Scraper(ScrapeSource(url=s.url, job=config.job, kind=s.kind, interval_s=s.interval_s,
                             timeout_s=s.timeout_s), lambda points: sink(as_decoded(points)))
        for s in config.scrape
    ]
