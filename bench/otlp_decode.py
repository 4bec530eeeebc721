"""Benchmark: an OTLP request body to Points, and on into the store, per point, A/B in one run.

Two request shapes, both with gauges (``--attrs`` string attributes each, values drawn as
measurements are: 15-17 digits in JSON; before 2026-12-06 they were short multiples of 0.5) and
histograms (15 bounds):
- ``batch``: 8 series, many points each (an exporter that batches, or a replay);
- ``export``: every series once, as an OpenTelemetry SDK's periodic export sends them.

Cases, interleaved (drift on a shared box hits every case alike), medians in ns per output Point:
- ``baseline``: building the same Points from values and attribute dicts prepared in advance
  (the floor every Point-producing decoder pays);
- ``protobuf``: parse and ``points_from_request``; ``json``: the orjson fast path
  (``points_from_json``); ``json_reference``: ``json_format`` then ``points_from_request``;
  ``protobuf_template`` and ``json_template``: the receiver's paths for a repeat export
  (``ExportTemplates``: columns over a shared shape, no Point built);
- ``protobuf_to_store``, ``json_to_store`` and the two ``*_template_to_store``: the body
  decoded, written to a real store file and flushed, end to end (timestamps move on every
  repeat, as a live exporter's do).

Target (issue #16): 600,000 points/s end to end, protobuf and JSON; the JSON states it per
shape and encoding, and whether it was met.

    python bench/otlp_decode.py --gauges 2000 --histograms 200 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._targets import Target, at_least, judged  # noqa: E402
from collectors._otlp_decode import (  # noqa: E402
    DecodedMetrics,
    decode_json,
    decode_protobuf,
    points_from_request,
)
from collectors._otlp_json import points_from_json  # noqa: E402
from collectors._otlp_json_shapes import JsonShapes  # noqa: E402
from collectors._otlp_json_templates import json_templates  # noqa: E402
from collectors._otlp_templates import protobuf_templates  # noqa: E402
from collectors._points import Point  # noqa: E402
from collectors._store import TimeSeriesStore  # noqa: E402

BOUNDS = [0.001 * 2**i for i in range(15)]
TARGET_POINTS_PER_S = 600_000
"""Issue #16: OTLP decode and store ingest, end to end, protobuf and JSON."""
T0 = 1_700_000_000_000_000_000


def targets(result: dict[str, Any]) -> list[Target]:
    """Issue #16: decode and store end to end at >= 600k points/s, protobuf and JSON, per shape
    (and for a repeat protobuf export, which the receiver decodes from a template)."""
    return [at_least(f"{encoding} decode + store points/s, {shape} shape", TARGET_POINTS_PER_S,
                     figures["points_per_s"][f"{encoding}_to_store"], "issue #16")
            for shape, figures in result["shapes"].items()
            for encoding in ("protobuf", "json", "protobuf_template", "json_template")]


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def make_request(gauges: int, histograms: int, attrs: int, shape: str
                 ) -> ExportMetricsServiceRequest:
    """One resource, gauges with ``attrs`` attributes each, histograms with 15 bounds; in the
    ``batch`` shape data points cycle over 8 attribute sets, in ``export`` each is its own."""
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    rm.resource.attributes.extend([_kv("service.name", "bench"), _kv("host.name", "h")])
    metrics = rm.scope_metrics.add().metrics
    sets = 8 if shape == "batch" else gauges + histograms

    def labels(i: int) -> list[KeyValue]:
        return [_kv(f"k{j}", f"v{i % sets}-{j}") for j in range(attrs)]

    g = metrics.add(name="bench.gauge").gauge
    rng = random.Random(gauges)
    for i in range(gauges):
        g.data_points.add(time_unix_nano=T0 + i * (shape == "batch"),
                          as_double=rng.uniform(0.0, 1000.0),
                          attributes=labels(i))
    h = metrics.add(name="bench.hist").histogram
    for i in range(histograms):
        h.data_points.add(time_unix_nano=T0 + i * (shape == "batch"), count=160, sum=1.5,
                          explicit_bounds=BOUNDS, bucket_counts=[10] * 16,
                          attributes=labels(gauges + i))
    return request


def _shifted(body: bytes, encoding: str, shift_ns: int) -> bytes:
    """The body with its timestamps ``shift_ns`` later (export-shape bodies share one)."""
    if encoding == "json":
        return body.replace(str(T0).encode(), str(T0 + shift_ns).encode())
    return body.replace(T0.to_bytes(8, "little"), (T0 + shift_ns).to_bytes(8, "little"))


def run_shape(shape: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    request = make_request(args.gauges, args.histograms, args.attrs, shape)
    bodies = {"protobuf": request.SerializeToString(),
              "json": json_format.MessageToJson(request, indent=None).encode()}
    points = points_from_request(request).points
    n_points = len(points)
    inputs = [(p.name, p.value, p.time_ns, dict(p.attributes)) for p in points]
    decoders: dict[str, Callable[[bytes], DecodedMetrics]] = {
        "protobuf": lambda b: points_from_request(decode_protobuf(b)),
        "json": points_from_json,
        "json_reference": lambda b: points_from_request(decode_json(b)),
        "protobuf_template": protobuf_templates(decode_protobuf).decode,
        "json_template": json_templates(JsonShapes().decode, points_from_json).decode,
    }
    stores = {e: TimeSeriesStore(folder / f"{shape}-{e}.db", flush_interval_s=3600)
              for e in ("protobuf", "json", "protobuf_template", "json_template")}
    repeat = [0]

    def to_store(decoder: str) -> None:
        encoding = decoder.split("_")[0]
        body = _shifted(bodies[encoding], encoding, repeat[0] * 1_000_000_000)
        stores[decoder].write_decoded(decoders[decoder](body))
        stores[decoder].flush()

    def baseline() -> None:
        [Point(name, value, t, dict(attrs)) for name, value, t, attrs in inputs]

    def decode(name: str) -> Callable[[], object]:
        return lambda: decoders[name](bodies[name.split("_")[0]])

    cases: dict[str, Callable[[], object]] = {
        "baseline": baseline, **{name: decode(name) for name in decoders},
        **{f"{name}_to_store": partial(to_store, name) for name in stores},
    }
    for name in stores:  # the first writes create every series and the template: not measured
        to_store(name)
        to_store(name)
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(args.repeats):
        repeat[0] = i + 1
        for name, fn in cases.items():
            t0 = time.perf_counter_ns()
            fn()
            samples[name].append((time.perf_counter_ns() - t0) / n_points)
    for store in stores.values():
        store.close()
    median = {k: statistics.median(v) for k, v in samples.items()}
    per_s = {k: 1e9 / v for k, v in median.items()}
    return {
        "points": n_points, "body_bytes": {e: len(b) for e, b in bodies.items()},
        "median_ns_per_point": median,
        "points_per_s": per_s,
        "ratio_to_baseline": {k: v / median["baseline"] for k, v in median.items()},
        "targets": {f"{e}_to_store": {"target_points_per_s": TARGET_POINTS_PER_S,
                                      "measured": per_s[f"{e}_to_store"],
                                      "met": per_s[f"{e}_to_store"] >= TARGET_POINTS_PER_S}
                    for e in stores},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gauges", type=int, default=2000)
    parser.add_argument("--histograms", type=int, default=200)
    parser.add_argument("--attrs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "otlp_decode.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        shapes = {shape: run_shape(shape, args, Path(folder)) for shape in ("batch", "export")}
    result = {
        "bench": "otlp_decode",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "protocol": __doc__,
        "repeats": args.repeats,
        "shapes": shapes,
        "target_points_per_s": TARGET_POINTS_PER_S,
    }
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {c: round(v) for c, v in s["points_per_s"].items()}
                      for k, s in shapes.items()}, indent=2))


if __name__ == "__main__":
    main()
