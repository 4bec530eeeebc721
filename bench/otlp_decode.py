"""Benchmark: OTLP request -> Points, against the floor of building the same Points directly.

A/B interleaved in one run: ``baseline`` builds the Points the request describes from values and
attribute dicts prepared in advance (the cost every decoder pays); ``decode`` is
``points_from_request`` on the parsed request; ``parse`` is the protobuf parse alone. Reports
medians (ns per output Point) and ratios, writes bench/results/otlp_decode.json.

    python bench/otlp_decode.py --gauges 2000 --histograms 200 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from collectors._otlp_decode import decode_protobuf, points_from_request
from collectors._points import Point

BOUNDS = [0.001 * 2**i for i in range(15)]
TARGET_POINTS_PER_S = 600_000
"""Issue #16: OTLP decode and parse at the store's own ingest rate, end to end."""


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def make_request(gauges: int, histograms: int, attrs: int) -> ExportMetricsServiceRequest:
    """One resource, gauges with ``attrs`` attributes each, histograms with 15 bounds."""
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    rm.resource.attributes.extend([_kv("service.name", "bench"), _kv("host.name", "h")])
    metrics = rm.scope_metrics.add().metrics
    labels = [[_kv(f"k{j}", f"v{i % 7}-{j}") for j in range(attrs)] for i in range(8)]
    g = metrics.add(name="bench.gauge").gauge
    for i in range(gauges):
        g.data_points.add(time_unix_nano=1_700_000_000_000_000_000 + i, as_double=i * 0.5,
                          attributes=labels[i % 8])
    h = metrics.add(name="bench.hist").histogram
    for i in range(histograms):
        h.data_points.add(time_unix_nano=1_700_000_000_000_000_000 + i, count=160, sum=1.5,
                          explicit_bounds=BOUNDS, bucket_counts=[10] * 16,
                          attributes=labels[i % 8])
    return request


def _baseline_inputs(points: list[Point]) -> list[tuple[str, float, int, dict[str, str]]]:
    return [(p.name, p.value, p.time_ns, dict(p.attributes)) for p in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gauges", type=int, default=2000)
    parser.add_argument("--histograms", type=int, default=200)
    parser.add_argument("--attrs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "otlp_decode.json")
    args = parser.parse_args()

    body = make_request(args.gauges, args.histograms, args.attrs).SerializeToString()
    request = decode_protobuf(body)
    n_points = len(points_from_request(request).points)
    inputs = _baseline_inputs(points_from_request(request).points)

    def baseline() -> None:
        [Point(name, value, t, dict(attrs)) for name, value, t, attrs in inputs]

    cases = {"baseline": baseline, "decode": lambda: points_from_request(request),
             "parse": lambda: decode_protobuf(body)}
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so drift on a shared box hits every case
        for name, fn in cases.items():
            t0 = time.perf_counter_ns()
            fn()
            samples[name].append((time.perf_counter_ns() - t0) / n_points)
    median = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "points": n_points, "body_bytes": len(body), "repeats": args.repeats,
        "median_ns_per_point": median,
        "ratio_decode_to_baseline": median["decode"] / median["baseline"],
        "ratio_parse_to_baseline": median["parse"] / median["baseline"],
        "points_per_s_decode_and_parse": 1e9 / (median["decode"] + median["parse"]),
        "target_points_per_s": TARGET_POINTS_PER_S,
        "met": 1e9 / (median["decode"] + median["parse"]) >= TARGET_POINTS_PER_S,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
