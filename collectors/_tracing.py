"""Per-process tracing set-up: one TracerProvider, exported over OTLP like the metrics.

The seed's chapter 5: always-on sampling, a batch span processor to an OTLP exporter, W3C trace
context carried across process boundaries. Beside the SDK's usual spans (``tracer()``) a
:class:`Tracing` records *journaled* spans (``record``): spans whose ids were handed out earlier
and written to a database, and that end later, possibly in another process after a restart.
The rollout controller uses them so one change is one trace however many ticks and restarts it
spans: it stores the ids as W3C ``traceparent`` strings in the change record and records each
span when it ends.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from collectors._errors import SeedanceError
from collectors._otel import TelemetryConfig
from collectors._otlp_traces import SpanRecord, spans_from_request

_log = logging.getLogger(__name__)

_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACES_PATH = "/v1/traces"
_IDS = RandomIdGenerator()
_PROPAGATOR = TraceContextTextMapPropagator()


class TraceContextError(SeedanceError, ValueError):
    """A string is not a valid W3C traceparent."""


# ---- W3C trace context ---------------------------------------------------------------------


def new_traceparent(parent: str | None = None) -> str:
    """A fresh span's W3C traceparent: in ``parent``'s trace, or a new trace when None."""
    trace_id = span_context(parent).trace_id if parent else _IDS.generate_trace_id()
    return f"00-{trace_id:032x}-{_IDS.generate_span_id():016x}-01"


def span_context(traceparent: str) -> SpanContext:
    """The span context a traceparent names (parsed by the SDK's W3C propagator)."""
    context = _PROPAGATOR.extract({"traceparent": traceparent})
    found = trace.get_current_span(context).get_span_context()
    if not found.is_valid:
        raise TraceContextError(f"not a valid W3C traceparent: {traceparent!r}")
    return found


def traceparent_context(traceparent: str) -> Context:
    """An OpenTelemetry Context whose current span is ``traceparent``: pass it as
    ``context=`` to start a child span of it."""
    span_context(traceparent)  # validate
    return _PROPAGATOR.extract({"traceparent": traceparent})


def trace_id_of(traceparent: str) -> str:
    """The trace id (32 hex digits) of a traceparent."""
    return f"{span_context(traceparent).trace_id:032x}"


def traces_endpoint_for(metrics_url: str) -> str:
    """The OTLP/HTTP traces URL beside a metrics URL (``.../v1/metrics`` -> ``.../v1/traces``)
    or under a base URL."""
    base = metrics_url.rstrip("/")
    base = base.removesuffix("/v1/metrics")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


# ---- exporters -------------------------------------------------------------------------------


class StoreSpanExporter(SpanExporter):
    """Hands each batch to ``sink`` as SpanRecords, through the OTLP encoder and the receiver's
    decoder, so the sidecar stores its own spans exactly as it stores a job's."""

    def __init__(self, sink: Callable[[list[SpanRecord]], Any]) -> None:
        self._sink = sink

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            records = spans_from_request(encode_spans(spans))
            if records:
                self._sink(records)
        except Exception:
            _log.exception("writing %d spans to the store failed; dropping them", len(spans))
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def traces_otlp_enabled(config: TelemetryConfig) -> bool:
    """True when spans go out over OTLP, by this config or by the standard environment."""
    return config.otlp_endpoint is not None or any(os.environ.get(n) for n in _ENDPOINT_ENV)


def _otlp_span_exporter(config: TelemetryConfig) -> SpanExporter:
    """The SDK exporter for the configured protocol; unset arguments come from OTEL_* env."""
    endpoint = config.otlp_endpoint
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
        return GrpcExporter(endpoint=endpoint, timeout=config.export_timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    return HttpExporter(endpoint=None if endpoint is None else traces_endpoint_for(endpoint),
                        timeout=config.export_timeout_s)


# ---- the provider ----------------------------------------------------------------------------


class Tracing:
    """The process's TracerProvider and the processors it exports through.

    ``enabled`` is False when nothing was configured: spans still get valid ids (so trace
    context still propagates) but go nowhere. Thread-safe as the SDK is; ``shutdown`` is
    idempotent and exports what is pending.
    """

    def __init__(self, config: TelemetryConfig, provider: TracerProvider,
                 processors: Sequence[SpanProcessor]) -> None:
        self.config = config
        self.provider = provider
        self.enabled = bool(processors)
        self._processors = tuple(processors)
        self._closed = False

    def tracer(self, name: str, version: str | None = None) -> trace.Tracer:
        """A tracer of this provider (``name`` is the instrumentation scope)."""
        return self.provider.get_tracer(name, version)

    def record(self, name: str, *, traceparent: str, parent: str | None, start_ns: int,
               end_ns: int, attributes: Mapping[str, Any] | None = None,
               error: str | None = None, scope: str = "seedance") -> None:
        """Record a finished span whose ids ``traceparent`` names, child of ``parent`` (None:
        a root). ``error`` sets the status to ERROR with that message. Never raises for a bad
        attribute: the SDK drops it with a warning."""
        if self._closed or not self._processors:
            return
        span = ReadableSpan(
            name, context=span_context(traceparent),
            parent=None if parent is None else span_context(parent),
            resource=self.provider.resource,
            attributes={k: v for k, v in (attributes or {}).items() if v is not None},
            status=Status(StatusCode.ERROR, error) if error is not None else Status(
                StatusCode.UNSET),
            start_time=start_ns, end_time=max(end_ns, start_ns),
            instrumentation_scope=InstrumentationScope(scope))
        for processor in self._processors:
            try:
                processor.on_end(span)
            except Exception:
                _log.exception("span processor %r failed on span %s", processor, name)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export every ended span now; False if a processor did not finish in ``timeout_s``."""
        return self.provider.force_flush(timeout_millis=int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Export what is pending and stop the processors. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self.provider.force_flush(timeout_millis=int(timeout_s * 1000))
        self.provider.shutdown()

    def __enter__(self) -> Tracing:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def setup_tracing(config: TelemetryConfig, *, exporters: Sequence[SpanExporter] = (),
                  store_sink: Callable[[list[SpanRecord]], Any] | None = None,
                  set_global: bool = False) -> Tracing:
    """Build the process's one TracerProvider from ``config`` (resource: service.name = job,
    host.name, seedance.rank; always-on sampling).

    Span processors: a batch processor to OTLP when ``config.otlp_endpoint`` or
    ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` is set (protocol ``config.otlp_protocol``; HTTP
    appends ``/v1/traces``); a batch processor to ``store_sink`` (SpanRecords); a synchronous
    processor per exporter in ``exporters`` (tests pass an InMemorySpanExporter). With none of
    them, a null Tracing (``enabled`` False). ``set_global`` also installs the provider as
    OpenTelemetry's global one, which the API allows once per process.
    """
    processors: list[SpanProcessor] = []
    if traces_otlp_enabled(config):
        processors.append(BatchSpanProcessor(_otlp_span_exporter(config)))
    if store_sink is not None:
        processors.append(BatchSpanProcessor(StoreSpanExporter(store_sink)))
    processors += [SimpleSpanProcessor(e) for e in exporters]
    provider = TracerProvider(resource=config.resource(), sampler=ALWAYS_ON,
                              shutdown_on_exit=False)
    for processor in processors:
        provider.add_span_processor(processor)
    if set_global:
        trace.set_tracer_provider(provider)
    tracing = Tracing(config, provider, processors)
    atexit.register(tracing.shutdown)
    return tracing


def null_tracing(job: str = "seedance") -> Tracing:
    """A Tracing that exports nothing (ids still valid): the default of whoever takes one."""
    config = TelemetryConfig(job=job)
    return Tracing(config, TracerProvider(resource=config.resource(), sampler=ALWAYS_ON,
                                          shutdown_on_exit=False), ())


__all__ = [
    "StoreSpanExporter", "TRACES_PATH", "TraceContextError", "Tracing", "new_traceparent",
    "null_tracing", "setup_tracing", "span_context", "trace_id_of", "traceparent_context",
    "traces_endpoint_for", "traces_otlp_enabled",
]
