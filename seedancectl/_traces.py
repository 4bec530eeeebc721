"""The sidecar's traces: its own TracerProvider (the rollout controller's spans), the span
table that keeps its spans and the jobs' (received on ``POST /v1/traces``), and forwarding.

Kept beside the Sidecar rather than in it so the Sidecar wires traces in a few lines. With an
upstream OTLP endpoint the jobs' span bodies are forwarded as received and the sidecar's own
spans are exported there too (``.../v1/metrics`` -> ``.../v1/traces``); otherwise the standard
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` variables apply to the sidecar's own spans.
"""

from __future__ import annotations

from collectors import (
    Forwarder,
    ForwarderConfig,
    SpanRecord,
    SpanStore,
    TelemetryConfig,
    Tracing,
    null_tracing,
    setup_tracing,
    trace_id_of,
    traces_endpoint_for,
)
from seedancectl._config import SidecarConfig


class SidecarTraces:
    """Owns the span store, the Tracing and the traces forwarder; ``start`` and ``shutdown``
    are idempotent. Before ``start`` the Tracing is a null one and received spans are refused
    (the receiver answers 503, so exporters retry)."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        upstream = config.upstream_otlp_endpoint
        self.upstream = traces_endpoint_for(upstream) if upstream else None
        self.forwarder = Forwarder(ForwarderConfig(url=self.upstream)) if self.upstream else None
        self.store: SpanStore | None = None
        self.tracing: Tracing = null_tracing(config.telemetry_job)

    def start(self) -> None:
        if self.store is not None:
            return
        self.store = SpanStore(self.config.state_db)
        self.tracing = setup_tracing(
            TelemetryConfig(job=self.config.telemetry_job, otlp_endpoint=self.upstream),
            store_sink=self.store.write)
        if self.forwarder is not None:
            self.forwarder.start()

    def sink(self, spans: list[SpanRecord]) -> None:
        """Where received spans go (``otlp_router(span_sink=...)``)."""
        if self.store is None:
            raise RuntimeError("the sidecar is not started; retry")
        self.store.write(spans)

    def spans_for_trace(self, trace_id: str) -> list[SpanRecord]:
        """The stored spans of a trace (the sidecar's pending ones flushed first)."""
        if self.store is None:
            return []
        self.tracing.force_flush()
        return self.store.spans_for_trace(trace_id)

    def spans_for_change(self, traceparent: str) -> list[SpanRecord]:
        """The spans of a change, given its ``Change.traceparent``."""
        return self.spans_for_trace(trace_id_of(traceparent)) if traceparent else []

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export the sidecar's pending spans (to the store too), then close."""
        self.tracing.shutdown(timeout_s)
        if self.forwarder is not None:
            self.forwarder.shutdown(timeout_s)
        if self.store is not None:
            self.store.close()
