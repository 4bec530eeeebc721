"""Run as a separate process by test_grafana: stand-in jobs that keep sending, with the stock
OpenTelemetry SDK over OTLP/HTTP, every catalogue metric the dashboards read that a training
job (with DDP) or a serving job emits. Values are SIMULATED (random, varying every tick so
rate() and histogram_quantile() have data); nothing here is measured. What the sidecar emits
itself (findings, tuning, GPUs) is never sent here: the test reads the real sidecar's.

NVLink throughput has no replayable NVML trace (every capture lacks it), so it is sent here too,
for the sidecar's GPU and the job it names (as the sidecar names its one attached job), labelled
``seedance.simulated="true"``.

Usage: python -m tests.dashboards.otel_sender ENDPOINT GPU_INDEX GPU_JOB DURATION_S
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from collectors import BY_NAME, RESOURCE_ATTRS, MetricKind, MetricSpec, histogram_views
from collectors._catalogue import (
    COLLECTIVE_METRICS,
    SERVING_METRICS,
    TRAINING_METRICS,
)

SIMULATED = {"seedance.simulated": "true"}
TICK_S = 0.2
VALUES: dict[str, tuple[str, ...]] = {
    # Values for every non-resource attribute the senders' metrics carry.
    "seedance.config.version": ("3",),
    "seedance.module_group": ("embed", "blocks"),
    "seedance.comm.backend": ("gloo",),
    "seedance.comm.bucket": ("0", "1"),
    "seedance.kv.part": ("key", "value"),
    "network.io.direction": ("transmit", "receive"),
    "seedance.nonfinite.what": ("loss", "grad_norm"),
}
GPU_IDENTITY = ("hw.id", "hw.name", "gpu.pci_address")
"""Left off the simulated NVLink points: no panel filters or groups on them."""

Record = Callable[[], None]


def _attribute_sets(spec: MetricSpec, extra: dict[str, str]) -> list[dict[str, str]]:
    sets: list[dict[str, str]] = [dict(extra)]
    for key in spec.attributes:
        if key in RESOURCE_ATTRS or key in extra or key in GPU_IDENTITY:
            continue
        values = VALUES[key]
        sets = [{**s, key: value} for s in sets for value in values]
    return sets


def _recorder(meter: Meter, spec: MetricSpec, extra: dict[str, str]) -> Record:
    """A function that records one varying value per attribute set of ``spec``."""
    sets = _attribute_sets(spec, extra)
    if spec.kind is MetricKind.GAUGE:
        gauge = meter.create_gauge(spec.name, unit=spec.unit)

        def set_gauge() -> None:
            for attrs in sets:
                gauge.set(random.uniform(0.1, 1.0), attrs)
        return set_gauge
    if spec.kind is MetricKind.SUM:
        counter = meter.create_counter(spec.name, unit=spec.unit)
        # Prefix-cache look-ups outnumber hits, so the hit rate stays a fraction.
        factor = 4 if spec.name.endswith(".queries") else 1

        def add() -> None:
            for attrs in sets:
                counter.add(random.randint(1, 3) * factor, attrs)
        return add
    histogram = meter.create_histogram(spec.name, unit=spec.unit)

    def record() -> None:
        for attrs in sets:
            for _ in range(3):
                histogram.record(random.uniform(0.001, 2.0), attrs)
    return record


def _provider(endpoint: str, resource: dict[str, str | int]) -> MeterProvider:
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, timeout=5),
                                           export_interval_millis=500)
    return MeterProvider(metric_readers=[reader], views=histogram_views(),
                         resource=Resource.create(resource))


def main(endpoint: str, gpu_index: str, gpu_job: str, duration_s: float) -> None:
    train = _provider(endpoint, {"service.name": "llm-train", "seedance.rank": 0})
    serve = _provider(endpoint, {"service.name": "llm-serve", "seedance.rank": 0})
    nvlink = _provider(endpoint, {"service.name": "nvlink-stand-in"})
    recorders: list[Record] = []
    for provider, specs in ((train, TRAINING_METRICS + COLLECTIVE_METRICS),
                            (serve, SERVING_METRICS)):
        meter = provider.get_meter("seedance-dashboard-test")
        recorders += [_recorder(meter, spec, SIMULATED) for spec in specs]
    recorders.append(_recorder(
        nvlink.get_meter("seedance-dashboard-test"), BY_NAME["seedance.gpu.nvlink.throughput"],
        {**SIMULATED, "gpu.index": gpu_index, "seedance.job": gpu_job}))
    deadline = time.monotonic() + duration_s
    try:
        while time.monotonic() < deadline:
            for record in recorders:
                record()
            time.sleep(TICK_S)
    finally:
        for provider in (train, serve, nvlink):
            provider.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
