"""Getting numbers in: OpenTelemetry set-up, NVML, torch instrumentation, receiver, store.

Importing this package is cheap and never imports torch: the public names below load their
module on first use, so a job that only needs the torch instrumentation
(``collectors.torch_training``) does not pay for the receiver, the store or pandas.
"""

from __future__ import annotations

from collectors._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # names, points, errors
    "BY_NAME": "_catalogue", "CATALOGUE": "_catalogue", "MetricSpec": "_catalogue",
    "CONFIG_VERSION_ATTR": "_points", "REPLAYED_ATTR": "_points", "MetricKind": "_points",
    "Point": "_points", "SeedanceError": "_errors",
    # OpenTelemetry set-up and Prometheus exposition
    "TelemetryConfig": "_otel", "TelemetryConfigError": "_otel", "Telemetry": "_otel",
    "setup_telemetry": "_otel", "StoreMetricExporter": "_otel", "histogram_views": "_otel",
    "STEP_BUCKETS_S": "_otel", "LATENCY_BUCKETS_S": "_otel",
    "LatestValueCollector": "_prometheus", "serve_metrics": "_prometheus",
    "MetricsServer": "_prometheus", "MetricsServerError": "_prometheus",
    # OTLP receiver
    "DecodedMetrics": "_otlp_decode", "MetricInfo": "_otlp_decode",
    "Temporality": "_otlp_decode", "OtlpDecodeError": "_otlp_decode",
    "RESOURCE_ATTRS": "_otlp_decode", "decode_protobuf": "_otlp_decode",
    "decode_json": "_otlp_decode", "points_from_request": "_otlp_decode",
    "otlp_router": "_otlp_receiver", "ReceiverStats": "_otlp_receiver",
    "Forwarder": "_otlp_receiver", "ForwarderConfig": "_otlp_receiver",
    "BodyTooLarge": "_otlp_receiver",
    # time-series store
    "TimeSeriesStore": "_store", "StoreConfig": "_store", "StoreError": "_store",
    "AUTO_MIN_POINTS": "_store",
    # NVML
    "GpuSampler": "_nvml", "GpuSamplerConfig": "_nvml",
    "NvmlBackend": "_nvml_backends", "LiveNvmlBackend": "_nvml_backends",
    "RecordingBackend": "_nvml_backends", "ReplayBackend": "_nvml_backends",
    "DisabledBackend": "_nvml_backends", "NvmlError": "_nvml_backends",
    "NvmlUnavailable": "_nvml_backends", "NvmlNotSupported": "_nvml_backends",
    "NvmlGpuLost": "_nvml_backends", "NvmlTraceError": "_nvml_backends",
    # scrape sources
    "Scraper": "_scrape", "ScrapeSource": "_scrape", "ScrapeResult": "_scrape",
    "ScrapeStats": "_scrape", "ScrapeError": "_scrape", "map_exposition": "_scrape",
    "SOURCE_ATTR": "_scrape",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
