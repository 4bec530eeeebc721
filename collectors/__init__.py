"""Getting numbers in: OpenTelemetry set-up, NVML, torch instrumentation, receiver, store.

Importing this package is cheap and never imports torch: the public names below load their
module on first use, so a job that only needs the torch instrumentation
(``collectors.torch_training``) does not pay for the receiver, the store or pandas. Each name
is listed once, as a typed import under ``TYPE_CHECKING`` that ``lazy_exports`` reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collectors._lazy import lazy_exports as lazy_exports

if TYPE_CHECKING:
    from collectors._cardinality import CardinalityLimit as CardinalityLimit
    from collectors._cardinality import SeriesLimiter as SeriesLimiter
    from collectors._catalogue import BY_NAME as BY_NAME
    from collectors._catalogue import CATALOGUE as CATALOGUE
    from collectors._catalogue import MetricSpec as MetricSpec
    from collectors._errors import ConfigError as ConfigError
    from collectors._errors import SeedanceError as SeedanceError
    from collectors._fingerprint import FingerprintError as FingerprintError
    from collectors._fingerprint import JobFingerprint as JobFingerprint
    from collectors._native import NATIVE_FLAGS as NATIVE_FLAGS
    from collectors._native import load_native as load_native
    from collectors._nvml import GpuSampler as GpuSampler
    from collectors._nvml import GpuSamplerConfig as GpuSamplerConfig
    from collectors._nvml_backends import DisabledBackend as DisabledBackend
    from collectors._nvml_backends import NvmlBackend as NvmlBackend
    from collectors._nvml_backends import NvmlError as NvmlError
    from collectors._nvml_backends import NvmlGpuLost as NvmlGpuLost
    from collectors._nvml_backends import NvmlNotSupported as NvmlNotSupported
    from collectors._nvml_backends import NvmlTraceError as NvmlTraceError
    from collectors._nvml_backends import NvmlUnavailable as NvmlUnavailable
    from collectors._nvml_live import LiveNvmlBackend as LiveNvmlBackend
    from collectors._nvml_trace import RecordingBackend as RecordingBackend
    from collectors._nvml_trace import ReplayBackend as ReplayBackend
    from collectors._otel import LATENCY_BUCKETS_S as LATENCY_BUCKETS_S
    from collectors._otel import STEP_BUCKETS_S as STEP_BUCKETS_S
    from collectors._otel import StoreMetricExporter as StoreMetricExporter
    from collectors._otel import Telemetry as Telemetry
    from collectors._otel import TelemetryConfig as TelemetryConfig
    from collectors._otel import TelemetryConfigError as TelemetryConfigError
    from collectors._otel import histogram_views as histogram_views
    from collectors._otel import setup_telemetry as setup_telemetry
    from collectors._otlp_decode import RESOURCE_ATTRS as RESOURCE_ATTRS
    from collectors._otlp_decode import DecodedMetrics as DecodedMetrics
    from collectors._otlp_decode import MetricInfo as MetricInfo
    from collectors._otlp_decode import OtlpDecodeError as OtlpDecodeError
    from collectors._otlp_decode import Temporality as Temporality
    from collectors._otlp_decode import decode_json as decode_json
    from collectors._otlp_decode import decode_protobuf as decode_protobuf
    from collectors._otlp_decode import points_from_request as points_from_request
    from collectors._otlp_receiver import BodyTooLarge as BodyTooLarge
    from collectors._otlp_receiver import Forwarder as Forwarder
    from collectors._otlp_receiver import ForwarderConfig as ForwarderConfig
    from collectors._otlp_receiver import ReceiverStats as ReceiverStats
    from collectors._otlp_receiver import otlp_router as otlp_router
    from collectors._otlp_traces import SpanRecord as SpanRecord
    from collectors._points import CONFIG_VERSION_ATTR as CONFIG_VERSION_ATTR
    from collectors._points import REPLAYED_ATTR as REPLAYED_ATTR
    from collectors._points import MetricKind as MetricKind
    from collectors._points import Point as Point
    from collectors._priority import background_thread as background_thread
    from collectors._priority import yield_cpu as yield_cpu
    from collectors._prometheus import LatestValueCollector as LatestValueCollector
    from collectors._prometheus import MetricsServer as MetricsServer
    from collectors._prometheus import MetricsServerError as MetricsServerError
    from collectors._prometheus import serve_metrics as serve_metrics
    from collectors._prometheus_names import PrometheusNameError as PrometheusNameError
    from collectors._prometheus_names import PromMetric as PromMetric
    from collectors._prometheus_names import prom_metric as prom_metric
    from collectors._prometheus_source import PrometheusError as PrometheusError
    from collectors._prometheus_source import PrometheusSource as PrometheusSource
    from collectors._scrape import Scraper as Scraper
    from collectors._scrape import ScrapeResult as ScrapeResult
    from collectors._scrape import ScrapeSource as ScrapeSource
    from collectors._scrape import ScrapeStats as ScrapeStats
    from collectors._scrape_mapping import ScrapeError as ScrapeError
    from collectors._scrape_mapping import map_exposition as map_exposition
    from collectors._scrape_rules import SOURCE_ATTR as SOURCE_ATTR
    from collectors._span_store import SpanStore as SpanStore
    from collectors._span_store import spans_table as spans_table
    from collectors._state_engine import StateDbError as StateDbError
    from collectors._state_engine import autocommit_reads as autocommit_reads
    from collectors._state_engine import ping_state_db as ping_state_db
    from collectors._state_engine import release_state_engine as release_state_engine
    from collectors._state_engine import shared_state_engine as shared_state_engine
    from collectors._state_engine import sqlite_url as sqlite_url
    from collectors._state_engine import state_db_error as state_db_error
    from collectors._state_engine import state_engine as state_engine
    from collectors._state_engine import state_engine_options as state_engine_options
    from collectors._state_engine import state_url as state_url
    from collectors._state_locks import StateLocks as StateLocks
    from collectors._state_locks import lock_transaction as lock_transaction
    from collectors._store import TimeSeriesStore as TimeSeriesStore
    from collectors._store_file import StoreConfig as StoreConfig
    from collectors._store_file import StoreError as StoreError
    from collectors._store_query import AUTO_MIN_POINTS as AUTO_MIN_POINTS
    from collectors._store_reader import BoundsReader as BoundsReader
    from collectors._store_reader import Resolution as Resolution
    from collectors._store_reader import StoreReader as StoreReader
    from collectors._store_reader import ValueBounds as ValueBounds
    from collectors._tracing import Tracing as Tracing
    from collectors._tracing import new_traceparent as new_traceparent
    from collectors._tracing import null_tracing as null_tracing
    from collectors._tracing import setup_tracing as setup_tracing
    from collectors._tracing import trace_id_of as trace_id_of
    from collectors._tracing import traceparent_context as traceparent_context
    from collectors._tracing import traces_endpoint_for as traces_endpoint_for

if not TYPE_CHECKING:  # a __getattr__ that mypy saw would type every misspelt name as Any
    __all__, __getattr__, __dir__ = lazy_exports(globals())
