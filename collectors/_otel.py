"""Per-process OpenTelemetry set-up: one MeterProvider feeding our store, OTLP and Prometheus.

A job calls :func:`setup_telemetry` once; instrumentation asks the returned :class:`Telemetry`
for meters. Every reader sees the same instruments, so the store, an OTLP backend and a
Prometheus scrape all report the same numbers. The store path encodes the SDK's data to OTLP
protobuf with the exporter's own encoder and decodes it with the receiver's decoder, so a point
written in-process is exactly the point the sidecar would have received over the wire.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, Literal, cast

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter, set_meter_provider
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry

from collectors._changed_points import GAUGE_TEMPORALITY, ChangedPointsExporter
from collectors._errors import SeedanceError
from collectors._export_session import EnvironmentOnceSession
from collectors._otlp_decode import DecodedMetrics, points_from_request
from collectors._prometheus import MetricsServer, NullMetricsServer, serve_metrics
from collectors.names import ATTR_HOST_NAME, ATTR_SEEDANCE_RANK, ATTR_SERVICE_NAME

_log = logging.getLogger(__name__)

OtlpProtocol = Literal["http/protobuf", "grpc"]
_PROTOCOLS: tuple[str, ...] = ("http/protobuf", "grpc")
_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_METRICS_PATH = "/v1/metrics"

RANK_ATTR = ATTR_SEEDANCE_RANK
_RESERVED_ATTRS = (ATTR_SERVICE_NAME, ATTR_HOST_NAME, RANK_ATTR)

STEP_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)
"""Bounds for step and collective times: 5 ms to 60 s (the SDK's 0..10000 assume ms)."""

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
"""Bounds for serving latencies: 0.5 ms to 10 s."""

HISTOGRAM_BUCKETS_S: Mapping[str, tuple[float, ...]] = MappingProxyType({
    "seedance.train.*duration": STEP_BUCKETS_S,
    "seedance.comm.*duration": STEP_BUCKETS_S,
    "gen_ai.server.*": LATENCY_BUCKETS_S,
    "seedance.serve.*duration": LATENCY_BUCKETS_S,
})
"""Instrument-name patterns (fnmatch) and their explicit histogram bounds, in seconds."""


class TelemetryConfigError(SeedanceError, ValueError):
    """A :class:`TelemetryConfig` field holds a value the set-up cannot use."""


def _env_first(names: tuple[str, ...]) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _default_protocol() -> OtlpProtocol:
    return cast(OtlpProtocol, _env_first(_PROTOCOL_ENV) or "http/protobuf")


@dataclass(frozen=True, kw_only=True)
class TelemetryConfig:
    """What one process exports and where.

    ``otlp_endpoint`` is a base URL as in ``OTEL_EXPORTER_OTLP_ENDPOINT``
    (``http://127.0.0.1:4318``; ``/v1/metrics`` is appended for HTTP). None leaves OTLP off
    unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` is set,
    in which case the SDK exporter reads them (and the other ``OTEL_EXPORTER_OTLP_*`` variables)
    itself. ``prometheus_port`` None leaves the scrape endpoint off; 0 picks a free port. It
    binds 127.0.0.1 only.
    """

    job: str
    rank: int = 0
    host: str = field(default_factory=socket.gethostname)
    export_interval_s: float = 10.0
    otlp_endpoint: str | None = None
    otlp_protocol: OtlpProtocol = field(default_factory=_default_protocol)
    prometheus_port: int | None = None
    resource_attributes: Mapping[str, str | bool | int | float] = field(default_factory=dict)
    export_timeout_s: float = 2.0
    """How long one OTLP export may take, retries included: a job's exporter never holds the
    job (at exit above all) for long when the sidecar is gone."""

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not self.job.strip():
            raise TelemetryConfigError(f"job must be a non-empty string, got {self.job!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise TelemetryConfigError(f"rank must be an int >= 0, got {self.rank!r}")
        if not isinstance(self.host, str) or not self.host.strip():
            raise TelemetryConfigError(f"host must be a non-empty string, got {self.host!r}")
        interval = self.export_interval_s
        if (isinstance(interval, bool) or not isinstance(interval, (int, float))
                or not math.isfinite(interval) or interval <= 0):
            raise TelemetryConfigError(
                f"export_interval_s must be a finite number > 0, got {interval!r}")
        if not (isinstance(self.export_timeout_s, (int, float))
                and math.isfinite(self.export_timeout_s) and self.export_timeout_s > 0):
            raise TelemetryConfigError(
                f"export_timeout_s must be a finite number > 0, got {self.export_timeout_s!r}")
        if self.otlp_protocol not in _PROTOCOLS:
            raise TelemetryConfigError(
                f"otlp_protocol must be one of {_PROTOCOLS}, got {self.otlp_protocol!r}")
        if self.otlp_endpoint is not None:
            endpoint = self.otlp_endpoint
            if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
                raise TelemetryConfigError(
                    f"otlp_endpoint must be an http:// or https:// URL, got {endpoint!r}")
        port = self.prometheus_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 <= port <= 65535):
            raise TelemetryConfigError(
                f"prometheus_port must be None or an int in 0..65535, got {port!r}")
        for key, value in self.resource_attributes.items():
            if not isinstance(key, str) or not key:
                raise TelemetryConfigError(
                    f"resource_attributes keys must be non-empty strings, got {key!r}")
            if key in _RESERVED_ATTRS:
                raise TelemetryConfigError(
                    f"resource_attributes must not set {key!r}; use the job, host or rank field")
            if not isinstance(value, (str, bool, int, float)):
                raise TelemetryConfigError(
                    f"resource_attributes[{key!r}] must be str, bool, int or float, "
                    f"got {type(value).__name__}")
        object.__setattr__(
            self, "resource_attributes", MappingProxyType(dict(self.resource_attributes)))

    def resource(self) -> Resource:
        """The OTel resource: service.name = job, host.name, seedance.rank, then the extras."""
        attributes: dict[str, Any] = dict(self.resource_attributes)
        attributes.update({ATTR_SERVICE_NAME: self.job, ATTR_HOST_NAME: self.host,
                           RANK_ATTR: self.rank})
        return Resource.create(attributes)

    def otlp_enabled(self) -> bool:
        """True when OTLP export is on, by this config or by the standard environment."""
        return self.otlp_endpoint is not None or _env_first(_ENDPOINT_ENV) is not None


class StoreMetricExporter(MetricExporter):
    """Hands each collection to ``sink`` decoded, via the same OTLP decoder the receiver uses.

    The sink gets :class:`DecodedMetrics` (points plus kind and unit per metric), exactly what
    the receiver hands on, so the sidecar stores and exports its own metrics like a job's.

    Called from the reader's export thread only; ``sink`` must be thread-safe if it is shared
    (``TimeSeriesStore.write`` is). A failing sink is logged and the export reported failed;
    the reader's loop goes on.
    """

    def __init__(self, sink: Callable[[DecodedMetrics], None]) -> None:
        super().__init__(preferred_temporality=GAUGE_TEMPORALITY)
        self._sink = sink

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        try:
            decoded = points_from_request(encode_metrics(metrics_data))
            if decoded.points:
                self._sink(decoded)
        except Exception:
            _log.exception("writing metrics to the store failed; dropping this collection")
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


def _otlp_exporter(config: TelemetryConfig) -> MetricExporter:
    """The SDK exporter for the configured protocol; unset arguments come from OTEL_* env."""
    endpoint = config.otlp_endpoint
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcExporter,
        )
        return GrpcExporter(endpoint=endpoint, preferred_temporality=GAUGE_TEMPORALITY,
                            timeout=config.export_timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpExporter,
    )
    if endpoint is not None and not endpoint.rstrip("/").endswith(_METRICS_PATH):
        endpoint = endpoint.rstrip("/") + _METRICS_PATH
    return HttpExporter(endpoint=endpoint, preferred_temporality=GAUGE_TEMPORALITY,
                        timeout=config.export_timeout_s, session=EnvironmentOnceSession())


def histogram_views() -> list[View]:
    """Explicit-bucket views for our seconds-valued histograms (see HISTOGRAM_BUCKETS_S)."""
    return [
        View(instrument_type=Histogram, instrument_name=pattern,
             aggregation=ExplicitBucketHistogramAggregation(boundaries=bounds))
        for pattern, bounds in HISTOGRAM_BUCKETS_S.items()
    ]


class Telemetry:
    """The process's MeterProvider and what it exports to; shut it down once at exit.

    Thread-safe as the SDK is: meters and instruments may be used from any thread.
    ``shutdown`` is idempotent; the object is a context manager.
    """

    def __init__(self, config: TelemetryConfig, provider: MeterProvider,
                 server: MetricsServer | NullMetricsServer) -> None:
        self.config = config
        self.provider = provider
        self._server = server
        self._closed = False

    @property
    def prometheus_port(self) -> int | None:
        """The port /metrics is served on (the bound one when the config asked for 0)."""
        return self._server.port

    def meter(self, name: str, version: str | None = None) -> Meter:
        """A meter of this provider (``name`` is the instrumentation scope)."""
        return self.provider.get_meter(name, version)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Collect and export now; False if a reader did not finish within ``timeout_s``."""
        return self.provider.force_flush(timeout_millis=timeout_s * 1000)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Export what is pending, stop the readers and the /metrics server. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self.provider.shutdown(timeout_millis=timeout_s * 1000)
        finally:
            self._server.stop()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def setup_telemetry(config: TelemetryConfig, *,
                    store_sink: Callable[[DecodedMetrics], None] | None = None,
                    set_global: bool = False) -> Telemetry:
    """Build the process's one MeterProvider from ``config``.

    Readers: ``store_sink`` (decoded metrics, e.g. for the sidecar's store) every ``export_interval_s``; OTLP
    when enabled; a Prometheus reader served on 127.0.0.1:``prometheus_port`` when set. With
    none of them the provider still works and records nothing. ``set_global`` also installs it
    as OpenTelemetry's global provider, which the API allows once per process.
    """
    readers: list[MetricReader] = []
    server: MetricsServer | NullMetricsServer = NullMetricsServer()
    if config.prometheus_port is not None:  # first: binding the port is what fails most
        registry = CollectorRegistry()
        readers.append(PrometheusMetricReader(registry=registry))
        server = serve_metrics(registry, config.prometheus_port)
    interval_ms = config.export_interval_s * 1000
    try:
        exporters: list[MetricExporter] = []
        if store_sink is not None:
            exporters.append(StoreMetricExporter(store_sink))
        if config.otlp_enabled():
            exporters.append(_otlp_exporter(config))
        readers += [PeriodicExportingMetricReader(ChangedPointsExporter(e),
                                                  export_interval_millis=interval_ms)
                    for e in exporters]
        provider = MeterProvider(metric_readers=readers, resource=config.resource(),
                                 views=histogram_views(), shutdown_on_exit=False)
    except BaseException:
        server.stop()
        raise
    if set_global:
        set_meter_provider(provider)
    telemetry = Telemetry(config, provider, server)
    atexit.register(telemetry.shutdown)
    return telemetry
