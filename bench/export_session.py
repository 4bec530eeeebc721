"""Benchmark: the job's export thread CPU per OTLP/HTTP export, plain ``requests.Session`` vs
``EnvironmentOnceSession`` (collectors/_export_session.py), interleaved in one run.

Both arms export the same collected batch (the points one step of the demo training job
records: ``--points`` gauges with a config version and a group attribute) with the SDK's
``OTLPMetricExporter`` to a keep-alive HTTP/1.1 server on loopback that reads and answers 200.
CPU is the exporting thread's own (``time.thread_time``), so the server's work is not counted.
Blocks of ``--per-block`` exports alternate order; the result is the median per export and the
ratio once / plain (issue #16 item 3: the export thread's CPU).

    python bench/export_session.py          # about 20 s
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._targets import Target, at_most, judged  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "export_session.json"


def targets(result: dict[str, Any]) -> list[Target]:
    """The session must take CPU off the export thread, not add any."""
    return [at_most("export-thread CPU per export, once / plain session", 1.0,
                    result["ratio_once_over_plain"],
                    "issue #16 item 3 (the export thread's CPU); no number stated")]


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the API's name
        pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    import requests
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from collectors._export_session import EnvironmentOnceSession

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/metrics"
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("bench.export_session")
    for i in range(args.points):
        meter.create_gauge(f"seedance.bench.g{i}").set(
            float(i), {"seedance.config.version": 3, "seedance.module_group": f"g{i % 6}"})
    data = reader.get_metrics_data()
    arms = {"plain": OTLPMetricExporter(endpoint=url, session=requests.Session()),
            "once": OTLPMetricExporter(endpoint=url, session=EnvironmentOnceSession())}
    per_export_ms: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        for block in range(args.blocks):
            order = list(arms) if block % 2 == 0 else list(reversed(arms))
            for arm in order:
                start = time.thread_time()
                for _ in range(args.per_block):
                    arms[arm].export(data)
                per_export_ms[arm].append((time.thread_time() - start) / args.per_block * 1e3)
    finally:
        server.shutdown()
    medians = {arm: statistics.median(v) for arm, v in per_export_ms.items()}
    return {
        "bench": "export_session",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "load_average_1m": os.getloadavg()[0]},
        "args": vars(args) | {"out": str(args.out)},
        "median_export_thread_cpu_ms": medians,
        "ratio_once_over_plain": medians["once"] / medians["plain"],
        "per_block_ms": per_export_ms,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", type=int, default=26, help="gauges in the exported batch")
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--per-block", type=int, default=25)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    measured = run(args)
    result = judged(measured, targets(measured))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    m = result["median_export_thread_cpu_ms"]
    print(f"export thread CPU per export: plain {m['plain']:.3f} ms, once {m['once']:.3f} ms; "
          f"ratio {result['ratio_once_over_plain']:.3f} -> {args.out}")


if __name__ == "__main__":
    main()
