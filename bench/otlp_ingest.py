"""Benchmark: one sidecar ingesting from N concurrent OTLP/HTTP exporters, end to end.

For each N in ``--exporters`` (default 1, 8, 64) and each encoding (protobuf, JSON), a fresh
``seedancectl sidecar`` process on loopback (default settings but for the listen port, store
and ``nvml = "off"``) receives, for ``--seconds`` after ``--warmup-s``, from N exporters
running at once (coroutines of one load process, so the sidecar, not the client, is measured):

- every exporter is one rank (``seedance.rank``) of one job, as a job's ranks export to the
  sidecar beside them, with ``--series`` series (``--metrics`` gauge names x attribute sets;
  64 x 250 stays inside the default ``max_series_per_job``), each export carrying every series
  once at a new timestamp, the time it is sent, as an OpenTelemetry SDK's periodic export
  does: the shape where the store pays per series (runs before the evening of 2026-12-07
  stamped an exporter's n-th export n seconds after a fixed start, so at 64 exporters the
  data's time ran about 35 times faster than the clock, which no live job's does); its
  values change every export too, drawn as measurements are (runs before the evening of
  2026-12-06 sent the same short values every time, which flattered JSON: a 17-digit double
  costs more to read than 0.25);
- closed loop: each exporter sends its next export as soon as the last is answered, so the
  figures are the sidecar's capacity, and the latency includes the queueing at that load; an
  answer with Retry-After (a 429 or 503: the sidecar pushing back) is waited out before the
  next export, as the OTLP spec asks of exporters (runs before 2026-12-06 retried at once, a
  retry storm no exporter makes, whose refused requests took the CPU the store needed);
- each exporter keeps one HTTP/1.1 connection, written by hand: httpx cost the load process a
  whole core at 64 exporters, on a 2-core box where the sidecar needs the other.

Reported per run: accepted points/s (points of 200-answered requests per second), request
latency p50 and p99, answers by status (429 and 503 are the sidecar pushing back), the
sidecar's CPU share and its RSS (max of 0.5 s samples).

With ``--base REV`` every (N, encoding) also runs on the code at REV (a git worktree),
interleaved with this tree's run, each arm first in every other pair (runs before 2026-12-07
ran the base first always, which favoured it: see ``otlp_ingest_aa.json``), and the JSON
gives the ratio of points/s; with ``--rounds R`` the whole sequence runs R times and the JSON
gives each ratio's median over the rounds. Each (N, encoding) changes its first arm from
round to round: an even R puts each arm first equally often.

Target (issue #16): 600,000 points/s end to end at any N. The JSON states it and whether the
best run met it.

Run: python bench/otlp_ingest.py [--exporters 1,8,64 --seconds 20 --warmup-s 10 --base REV]
Results: bench/results/otlp_ingest.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._targets import Target, at_least, judged  # noqa: E402
from bench._worktree import worktree  # noqa: E402
from tests.servers import free_port  # noqa: E402

TARGET_POINTS_PER_S = 600_000
T0 = 1_800_000_000_000_000_000  # a placeholder timestamp each export replaces with its own
# (as many digits as time.time_ns() until 2286, so a JSON body keeps its length)
VALUE_VARIANTS = 4
"""Bodies per exporter, each with other values, sent in turn: values change every export, as
a live job's do (a JSON number's width with them)."""
ENCODINGS = {"protobuf": "application/x-protobuf", "json": "application/json"}


def targets(result: dict[str, Any]) -> list[Target]:
    """Issue #16: one sidecar ingests >= 600k points/s end to end, over protobuf and over JSON.

    Judged on the best run of this tree's code (arm ``new``) per encoding, any exporter count.
    """
    return [at_least(f"best points/s ingested over {encoding}", TARGET_POINTS_PER_S,
                     max((r["points_per_s"] for r in result["runs"]
                          if r["arm"] == "new" and r["encoding"] == encoding), default=None),
                     "issue #16")
            for encoding in ENCODINGS]


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def export_body(exporter: int, metrics: int, series: int, encoding: str,
                variant: int = 0) -> bytes:
    """One export of one exporter: ``series`` gauges, all stamped T0 (replaced per send), with
    measured-looking values (shortest round-trip doubles, 15-17 digits in JSON) drawn anew for
    each ``variant``."""
    rng = random.Random(exporter * 1_000_003 + variant)
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    rm.resource.attributes.extend([_kv("service.name", "ingest-bench-job"),
                                   _kv("host.name", "bench"),
                                   _kv("seedance.rank", str(exporter))])
    out = rm.scope_metrics.add().metrics
    per_metric = max(1, series // metrics)
    for m in range(metrics):
        gauge = out.add(name=f"bench.ingest.m{m}", unit="1").gauge
        for s in range(per_metric):
            gauge.data_points.add(time_unix_nano=T0, as_double=rng.uniform(0.0, 1000.0),
                                  attributes=[_kv("module", f"layer{s}"),
                                              _kv("seedance.config.version", "1")])
    if encoding == "json":
        return json_format.MessageToJson(request, indent=None).encode()
    return request.SerializeToString()


def stamped(body: bytes, encoding: str, t_ns: int) -> bytes:
    """The body with every timestamp set to ``t_ns`` (a byte replace: no re-encoding)."""
    if encoding == "json":
        return body.replace(str(T0).encode(), str(t_ns).encode())
    return body.replace(T0.to_bytes(8, "little"), t_ns.to_bytes(8, "little"))


class _Connection:
    """One keep-alive HTTP/1.1 connection, written and read by hand: at 64 exporters httpx
    took a whole core of this 2-core box, so the load, not the sidecar, set the pace. Sends
    exactly what an OTLP/HTTP exporter sends: a POST with Content-Type and Content-Length."""

    def __init__(self, host: str, port: int, path: str, content_type: str) -> None:
        self._address = (host, port)
        self._head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                      f"Content-Type: {content_type}\r\nContent-Length: ").encode()
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, body: bytes) -> tuple[str, float]:
        """The status code of the answer (a str), or the error's name; and its Retry-After in
        seconds (0 without one)."""
        try:
            if self._streams is None:
                self._streams = await asyncio.open_connection(*self._address)
            reader, writer = self._streams
            writer.write(self._head + b"%d\r\n\r\n" % len(body) + body)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60.0)
            lines = head.split(b"\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in lines[1:]
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if any(line.lower() == b"connection: close" for line in lines[1:]):
                writer.close()
                self._streams = None
            retry_after = next((float(line.split(b":", 1)[1]) for line in lines[1:]
                                if line.lower().startswith(b"retry-after:")), 0.0)
            return lines[0].split()[1].decode(), retry_after
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            if self._streams is not None:
                self._streams[1].close()
                self._streams = None
            return type(e).__name__, 0.0

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()


async def _exporter(url: str, bodies: list[bytes], encoding: str, points: int, t_start: float,
                    t_end: float, out: dict[str, Any]) -> None:
    address = urllib.parse.urlsplit(url)
    connection = _Connection(address.hostname or "127.0.0.1", address.port or 80,
                             address.path, ENCODINGS[encoding])
    n = stamp = 0
    try:
        while True:
            now = time.monotonic()
            if now >= t_end:
                return
            n += 1
            stamp = max(stamp + 1, time.time_ns())  # each export its own time, as sent
            data = stamped(bodies[n % len(bodies)], encoding, stamp)
            sent = time.perf_counter()
            status, retry_after = await connection.post(data)
            elapsed = time.perf_counter() - sent
            if now >= t_start:
                out["status"][status] = out["status"].get(status, 0) + 1
                out["latency_s"].append(elapsed)
                if status == "200":
                    out["points"] += points
            if retry_after:  # as an OTLP exporter does (the spec: SHOULD honour it)
                await asyncio.sleep(min(retry_after, t_end - time.monotonic()))
    finally:
        connection.close()


async def _load(url: str, bodies: list[list[bytes]], encoding: str, points: int, warmup_s: float,
                seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"status": {}, "latency_s": [], "points": 0}
    t_start = time.monotonic() + warmup_s
    await asyncio.gather(*(_exporter(url, variants, encoding, points, t_start, t_start + seconds,
                                     out) for variants in bodies))
    return out


def _load_process(url: str, exporters: int, metrics: int, series: int, encoding: str,
                  warmup_s: float, seconds: float, result_path: Path) -> None:
    bodies = [[export_body(i, metrics, series, encoding, v) for v in range(VALUE_VARIANTS)]
              for i in range(exporters)]
    points = metrics * max(1, series // metrics)
    out = asyncio.run(_load(url, bodies, encoding, points, warmup_s, seconds))
    result_path.write_text(json.dumps(out))


def _proc_stat(pid: int) -> tuple[float, float] | None:
    """(CPU seconds, RSS MiB) of a process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss = next(int(line.split()[1]) for line in
                   Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), rss / 1024


def one_run(tree: Path, exporters: int, encoding: str, args: argparse.Namespace
            ) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="otlp-ingest-"))
    port = free_port()
    (work / "token").write_text("bench-token\n")
    config = work / "sidecar.toml"
    config.write_text("\n".join([
        'job = "ingest-bench"', f'listen = "127.0.0.1:{port}"',
        f'store = "{work / "metrics.db"}"', f'token_file = "{work / "token"}"',
        'nvml = "off"', ""]))
    env = dict(os.environ, PYTHONPATH=str(tree))
    with (work / "sidecar.log").open("wb") as log:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "seedancectl.sidecar", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if sidecar.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"sidecar not ready; see {work / 'sidecar.log'}")
            time.sleep(0.3)
        samples: list[tuple[float, float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                stat = _proc_stat(sidecar.pid)
                if stat is not None:
                    samples.append((time.monotonic(), *stat))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        result_path = work / "load.json"
        t_start = time.monotonic() + args.warmup_s
        loader = subprocess.run(
            [sys.executable, __file__, "--load-only", base + "/v1/metrics", str(exporters),
             str(args.metrics), str(args.series), encoding, str(args.warmup_s),
             str(args.seconds), str(result_path)], cwd=ROOT, timeout=args.seconds * 4 + 300)
        stop.set()
        sampler.join()
        if loader.returncode != 0:
            raise SystemExit(f"load process failed ({loader.returncode})")
        load = json.loads(result_path.read_text())
    finally:
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(60)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            sidecar.wait()
    window = [s for s in samples if t_start <= s[0] <= t_start + args.seconds]
    cpu_share = ((window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
                 if len(window) >= 2 else None)
    latency = np.asarray(load["latency_s"]) * 1000
    shutil.rmtree(work, ignore_errors=True)
    return {
        "exporters": exporters, "encoding": encoding,
        "points_per_s": load["points"] / args.seconds,
        "requests": int(latency.size),
        "latency_ms": {"p50": float(np.percentile(latency, 50)) if latency.size else None,
                       "p99": float(np.percentile(latency, 99)) if latency.size else None},
        "status": load["status"],
        "sidecar_cpu_share": cpu_share,
        "sidecar_rss_mib_max": max((s[2] for s in samples), default=None),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--load-only":
        url, n, metrics, series, encoding, warmup, seconds, out = sys.argv[2:]
        _load_process(url, int(n), int(metrics), int(series), encoding, float(warmup),
                      float(seconds), Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exporters", default="1,8,64")
    parser.add_argument("--encodings", default="protobuf,json")
    parser.add_argument("--metrics", type=int, default=50)
    parser.add_argument("--series", type=int, default=250)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--base", default=None, help="also run the code at this git revision")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole sequence")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "otlp_ingest.json")
    args = parser.parse_args()
    trees = {"new": ROOT}
    if args.base:
        trees = {"base": worktree(args.base, "otlp-ingest-base-"), "new": ROOT}
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(args.rounds):
            pairs = round_  # so each (N, encoding) changes its first arm from round to round
            for n in [int(x) for x in args.exporters.split(",")]:
                for encoding in args.encodings.split(","):
                    # interleaved, so drift hits both alike, and each arm first in every other
                    # pair: in an A/A run (one revision in both arms, 2026-12-07) the second of
                    # a protobuf pair at 64 exporters came out 0.84x and 0.92x of the first
                    order = list(trees.items())[::-1 if pairs % 2 else 1]
                    pairs += 1
                    for position, (arm, tree) in enumerate(order):
                        run = {"arm": arm, "round": round_, "position": position,
                               **one_run(tree, n, encoding, args)}
                        print(json.dumps(run), flush=True)
                        runs.append(run)
    finally:
        if "base" in trees:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees["base"])],
                           cwd=ROOT, capture_output=True)
    new = [r for r in runs if r["arm"] == "new"]
    best = max(r["points_per_s"] for r in new)
    per_round: dict[str, list[float]] = {}
    for r in new:
        for b in runs:
            if (b["arm"] == "base" and b["points_per_s"] > 0 and (b["round"], b["exporters"],
                    b["encoding"]) == (r["round"], r["exporters"], r["encoding"])):
                per_round.setdefault(f'{r["exporters"]}/{r["encoding"]}', []).append(
                    r["points_per_s"] / b["points_per_s"])
    ratios = {key: statistics.median(values) for key, values in per_round.items()}
    result = {
        "bench": "otlp_ingest",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                   capture_output=True, text=True).stdout.strip(),
        "base": args.base,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "protocol": __doc__,
        "settings": {"metrics": args.metrics, "series_per_exporter": args.series,
                     "seconds": args.seconds, "warmup_s": args.warmup_s,
                     "rounds": args.rounds},
        "runs": runs,
        "points_per_s_new_over_base": ratios,
        "target_points_per_s": TARGET_POINTS_PER_S,
        "best_points_per_s": best,
    }
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}: best {best:,.0f} points/s (target {TARGET_POINTS_PER_S:,})")


if __name__ == "__main__":
    main()
