"""Run as a separate process by test_otlp_receiver: the stock OpenTelemetry SDK and OTLP/HTTP
exporter send the gauge, counter and histogram values given as JSON in argv[3].

Usage: python otlp_sdk_sender.py ENDPOINT none|gzip '{"gauge": ..., "counter": [...], ...}'
"""

from __future__ import annotations

import json
import sys

from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource


def main(endpoint: str, compression: str, spec: dict) -> None:
    exporter = OTLPMetricExporter(
        endpoint=endpoint, timeout=10,
        compression=Compression.Gzip if compression == "gzip" else Compression.NoCompression,
    )
    # A long interval: the one export happens at shutdown, so the test sees one request.
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(resource=Resource.create(spec["resource"]), metric_readers=[reader])
    meter = provider.get_meter("otlp-sdk-sender")
    gauge = meter.create_gauge("test.gauge", unit="By")
    for value, attrs in spec["gauge"]:
        gauge.set(value, attrs)
    counter = meter.create_counter("test.counter", unit="1")
    for value in spec["counter"]:
        counter.add(value, spec["attrs"])
    histogram = meter.create_histogram(
        "test.latency", unit="s", explicit_bucket_boundaries_advisory=spec["bounds"])
    for value in spec["histogram"]:
        histogram.record(value, spec["attrs"])
    provider.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
