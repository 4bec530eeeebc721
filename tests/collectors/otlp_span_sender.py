"""Run as a separate process by test_otlp_traces: the stock OpenTelemetry SDK and its OTLP/HTTP
span exporter send a parent span and a child, then print their ids as JSON.

Usage: python otlp_span_sender.py ENDPOINT none|gzip
"""

from __future__ import annotations

import json
import sys

from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode


def main(endpoint: str, compression: str) -> None:
    exporter = OTLPSpanExporter(
        endpoint=endpoint, timeout=10,
        compression=Compression.Gzip if compression == "gzip" else Compression.NoCompression)
    provider = TracerProvider(resource=Resource.create({"service.name": "sender",
                                                        "seedance.rank": 3}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("otlp-span-sender")
    with tracer.start_as_current_span("parent", attributes={"n": 7, "ok": True}) as parent:
        with tracer.start_as_current_span("child") as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
    provider.shutdown()
    ids = {name: {"trace_id": f"{s.get_span_context().trace_id:032x}",
                  "span_id": f"{s.get_span_context().span_id:016x}"}
           for name, s in (("parent", parent), ("child", child))}
    print(json.dumps(ids))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
