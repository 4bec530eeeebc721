"""Benchmark: the sidecar under a steady, realistic load for a long time. Does anything grow
that should not, slow down, or get lost?

One sidecar process (default settings but the store, state DB, token and a scrape source under
a temp dir), and around it for ``--minutes``:

- 8 SIMULATED ranks (threads of this process), each POSTing one OTLP protobuf request a second
  to ``/v1/metrics``: 20 gauge series and a cumulative counter per rank, every point with its
  own timestamp; a point counts as sent when its request was answered 200;
- a scrape source: a real dcgm-exporter output (``tests/data``) served on loopback, scraped
  every 5 s as configured;
- a tuning loop on a real job: ``python -m workloads.train_family --family mlp --threads 1``
  attached with ``mode = "auto"`` and ``tune = true``;
- 4 CLI readers (threads): ``GET /v1/status``, ``/v1/changes``, ``/v1/findings`` and
  ``/readyz`` in turn, every 0.5 s, each call's latency recorded.

Every 10 s: the sidecar's RSS and its anonymous, file-mapped and shared parts and its thread
count (``/proc/PID/status``), and the store file's size (with its WAL).
At the end the sidecar stops (SIGTERM) and the store is read back: points lost = points sent
(answered 200) that are not in it.

Reported: RSS slope after the first quarter (MiB/hour, least squares), store growth per hour,
API latency p50/p99 over every reader call, points sent / stored / lost, scrapes up.

With ``--trace-memory`` the sidecar runs with tracemalloc on (``bench/_traced_sidecar.py``):
snapshots at the first quarter and near the end, and the result adds Python's traced heap at
each and the allocation sites that grew most between them, and every 10 s Python's traced heap
and SQLite's own allocations (``memory_parts``). Tracing slows the sidecar and adds
its own memory: compare its RSS only with another traced run.

With ``--native-memory`` (``pip install -e '.[bench]'``) memray tracks every ``malloc`` and
``mmap`` of the sidecar (with ``PYTHONMALLOC=malloc``, so each Python object is one) from the
first quarter to near the end while it keeps running
(``bench/_memray_sidecar.py``); the result adds what was allocated in that window and still held
at its end, by the Python stack that allocated it: the growth, wherever it lives (pymalloc's
arenas, protobuf's, SQLite's). With ``--no-tuning`` the job attaches with ``tune = false``: the
other arm of a tuning on/off A/B.

With ``--allocator jemalloc`` the sidecar (only) runs with jemalloc preloaded (``LD_PRELOAD``,
Debian's ``libjemalloc2``): if RSS then stays flat where glibc's grows, the growth was glibc's
arenas fragmenting, not memory something holds.

Run: python bench/soak.py [--minutes 30] [--trace-memory --out bench/results/soak_traced.json]
     python bench/soak.py --minutes 12 --native-memory --out bench/results/soak_native.json
     python bench/soak.py --minutes 15 --allocator jemalloc --out bench/results/soak_jemalloc.json
Results: bench/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._targets import Target, at_most, judged  # noqa: E402
from collectors._store import TimeSeriesStore  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "soak.json"
DCGM = ROOT / "tests" / "data" / "dcgm-exporter_metrics_datadog-fixture_T4_partial-dummy.prom"
TOKEN = "soak-token"
RANKS = 8
SERIES_PER_RANK = 20
READERS = 4
METRIC = "soak.rank.value"


def targets(result: dict[str, Any]) -> list[Target]:
    """Issue #12: no point answered 200 is lost. RSS slope, store growth and API latency are
    reported without a target: the issue asks for them but states no number."""
    return [at_most("points lost (answered 200, not stored)", 0, result["points"]["lost"],
                    "issue #12")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_request(rank: int, t_ns: int, tokens: int) -> tuple[bytes, int]:
    """One rank's export: SERIES_PER_RANK gauges of METRIC and a token counter; (body, points)."""
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    for key, value in (("service.name", "soak"), ("seedance.rank", str(rank)),
                       ("seedance.simulated", "true")):
        a = rm.resource.attributes.add()
        a.key, a.value.string_value = key, value
    scope = rm.scope_metrics.add()
    gauge = scope.metrics.add()
    gauge.name = METRIC
    for i in range(SERIES_PER_RANK):
        dp = gauge.gauge.data_points.add()
        dp.time_unix_nano, dp.as_double = t_ns, float(i + rank)
        a = dp.attributes.add()
        a.key, a.value.string_value = "series", str(i)
    counter = scope.metrics.add()
    counter.name = "soak.tokens"
    counter.sum.is_monotonic = True
    counter.sum.aggregation_temporality = 2  # cumulative
    dp = counter.sum.data_points.add()
    dp.time_unix_nano, dp.as_int = t_ns, tokens
    return request.SerializeToString(), SERIES_PER_RANK + 1


class Exporter(ThreadingHTTPServer):
    """A dcgm-exporter stand-in serving a real capture on loopback."""

    def __init__(self) -> None:
        body = DCGM.read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/metrics"
        threading.Thread(target=self.serve_forever, daemon=True).start()


STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads")
"""From /proc/PID/status: RSS and its anonymous / file-mapped / shared parts (MiB), threads."""


def proc_status(pid: int) -> dict[str, float]:
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            number = int(value.split()[0])
            found[key] = number if key == "Threads" else number / 1024
    return found


def store_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def slope_per_hour(times_s: list[float], values: list[float]) -> float:
    if len(times_s) < 3:
        return float("nan")
    return float(np.polyfit(np.asarray(times_s), np.asarray(values), 1)[0] * 3600)


def heap_growth(snapshots: list[Path], top: int = 15) -> dict[str, Any]:
    """Python's traced heap at each snapshot and the allocation sites (their innermost
    frames, repository code first) that grew most from the first to the last."""
    missing = [str(p) for p in snapshots if not p.exists()]
    if missing:
        return {"error": f"snapshots not written: {missing}"}
    first, last = (tracemalloc.Snapshot.load(str(p)) for p in (snapshots[0], snapshots[-1]))
    grew = [d for d in last.compare_to(first, "traceback") if d.size_diff > 0][:top]
    return {
        "traced_mib": [round(sum(s.size for s in snap.statistics("filename")) / 2**20, 2)
                       for snap in (first, last)],
        "top_growth": [{"kib": round(d.size_diff / 1024, 1), "blocks": d.count_diff,
                        "frames": [f"{f.filename.removeprefix(str(ROOT) + '/')}:{f.lineno}"
                                   for f in d.traceback][-8:]}
                       for d in grew],
    }


def native_growth(path: Path, window_s: tuple[float, float], top: int = 20) -> dict[str, Any]:
    """What memray saw allocated inside the window and still held at its end, by the Python
    stack that allocated it (repository frames kept, the innermost last)."""
    if not path.exists():
        return {"error": f"memray's file was not written: {path}"}
    from memray import FileReader

    by_stack: dict[tuple[str, ...], list[int]] = {}
    for record in FileReader(str(path)).get_leaked_allocation_records(merge_threads=True):
        frames = tuple(f"{file.removeprefix(str(ROOT) + '/')}:{line} {function}"
                       for function, file, line in reversed(record.stack_trace()))[-6:]
        held = by_stack.setdefault(frames, [0, 0])
        held[0] += record.size
        held[1] += record.n_allocations
    ranked = sorted(by_stack.items(), key=lambda item: -item[1][0])
    return {"window_s": list(window_s),
            "held_mib": round(sum(v[0] for v in by_stack.values()) / 2**20, 2),
            "top": [{"kib": round(size / 1024, 1), "allocations": count, "stack": list(stack)}
                    for stack, (size, count) in ranked[:top]]}


def jemalloc_library() -> Path:
    """Debian's libjemalloc2, wherever the architecture put it."""
    found = sorted(Path("/usr/lib").glob("*/libjemalloc.so.2")) + sorted(
        Path("/usr/lib").glob("libjemalloc.so.2"))
    if not found:
        raise SystemExit("--allocator jemalloc: libjemalloc.so.2 not found; "
                         "apt-get install libjemalloc2")
    return found[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--allocator", choices=("glibc", "jemalloc"), default="glibc",
                   help="the sidecar's malloc (jemalloc: preloaded from libjemalloc2)")
    p.add_argument("--trace-memory", action="store_true",
                   help="run the sidecar under tracemalloc and report the sites that grew")
    p.add_argument("--native-memory", action="store_true",
                   help="track the sidecar's every malloc and mmap with memray from the first "
                        "quarter to near the end, and report what was allocated and kept")
    p.add_argument("--no-tuning", action="store_true",
                   help="attach the job with tune = false: the A arm of a tuning on/off A/B")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="seedance-soak-"))
    exporter = Exporter()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    (work / "token").write_text(TOKEN + "\n")
    store = work / "metrics.db"
    (work / "sidecar.toml").write_text("\n".join([
        f'listen = "127.0.0.1:{port}"', f'store = "{store}"',
        f'state_db = "sqlite:///{work / "state.db"}"', f'token_file = "{work / "token"}"',
        'nvml = "off"', "", "[approval]", 'mode = "auto"', "",
        '[jobs.train]', f"tune = {'false' if args.no_tuning else 'true'}", "", "[[scrape]]", f'url = "{exporter.url}"',
        'kind = "dcgm"', ""]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SEEDANCE_TOKEN": TOKEN}
    sidecar_env = dict(env)
    if args.allocator == "jemalloc":
        sidecar_env["LD_PRELOAD"] = str(jemalloc_library())
    snapshot_at = (0.25 * args.minutes * 60, max(0.25, args.minutes * 60 - 15))
    launcher = ["-m", "seedancectl.sidecar"]
    if args.trace_memory:
        launcher = [str(ROOT / "bench" / "_traced_sidecar.py")]
        sidecar_env.update(SOAK_SNAPSHOT_AT=",".join(f"{t:.0f}" for t in snapshot_at),
                           SOAK_SNAPSHOT_DIR=str(work))
    elif args.native_memory:
        launcher = [str(ROOT / "bench" / "_memray_sidecar.py")]
        # every Python object its own malloc: memray then names what holds pymalloc's arenas
        sidecar_env.update(SOAK_MEMRAY_WINDOW=",".join(f"{t:.0f}" for t in snapshot_at),
                           SOAK_MEMRAY_FILE=str(work / "memray.bin"), PYTHONMALLOC="malloc")
    logs = {n: (work / f"{n}.log").open("wb") for n in ("sidecar", "train")}
    sidecar = subprocess.Popen([sys.executable, *launcher, "--config",
                                str(work / "sidecar.toml")], stdout=logs["sidecar"],
                               stderr=subprocess.STDOUT, env=sidecar_env, cwd=work)
    http = httpx.Client(base_url=url, timeout=30.0)
    deadline = time.monotonic() + (240 if args.trace_memory else 60)  # tracing slows imports
    while True:
        try:
            if http.get("/readyz").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or sidecar.poll() is not None:
            raise SystemExit(f"the sidecar did not start; see {work / 'sidecar.log'}")
        time.sleep(0.2)
    train = subprocess.Popen([sys.executable, "-m", "workloads.train_family", "--family", "mlp",
                              "--job", "train", "--threads", "1", "--sidecar", url,
                              "--seconds", str(args.minutes * 60 + 60)],
                             stdout=logs["train"], stderr=subprocess.STDOUT, env=env, cwd=work)
    stop = threading.Event()
    sent = [0] * RANKS
    refused = [0] * RANKS
    latencies: list[float] = []
    lock = threading.Lock()

    def rank_loop(rank: int) -> None:
        client = httpx.Client(base_url=url, timeout=30.0)
        tokens = 0
        while not stop.wait(1.0):
            tokens += 4096
            body, points = rank_request(rank, time.time_ns(), tokens)
            try:
                r = client.post("/v1/metrics", content=body,
                                headers={"Content-Type": "application/x-protobuf"})
                if r.status_code == 200:
                    sent[rank] += SERIES_PER_RANK  # the gauge points are what is counted
                else:
                    refused[rank] += points
            except httpx.HTTPError:
                refused[rank] += points

    def reader_loop(i: int) -> None:
        client = httpx.Client(base_url=url, timeout=30.0)
        paths = ["/v1/status", "/v1/changes", "/v1/findings", "/readyz"]
        k = i
        while not stop.wait(0.5):
            t0 = time.perf_counter()
            try:
                client.get(paths[k % len(paths)])
            except httpx.HTTPError:
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)
            k += 1

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(RANKS)]
    threads += [threading.Thread(target=reader_loop, args=(i,), daemon=True)
                for i in range(READERS)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    samples: list[tuple[float, float, int]] = []
    parts: list[dict[str, float]] = []
    print(f"soak: {args.minutes:g} minutes, sidecar pid {sidecar.pid}, logs in {work}",
          flush=True)
    while time.monotonic() - started < args.minutes * 60:
        if sidecar.poll() is not None:
            raise SystemExit(f"the sidecar died; see {work / 'sidecar.log'}")
        status = proc_status(sidecar.pid)
        samples.append((time.monotonic() - started, status.pop("VmRSS"), store_bytes(store)))
        parts.append(status)
        time.sleep(10)
    metrics_text = http.get("/metrics").text
    stop.set()
    for thread in threads:
        thread.join(35)
    changes = http.get("/v1/changes").json()
    train.send_signal(signal.SIGTERM)
    sidecar.send_signal(signal.SIGTERM)
    train.wait(60)
    sidecar_code = sidecar.wait(60)
    with TimeSeriesStore(store, readonly=True, raw_retention_s=None) as reader:
        stored = int(len(reader.query(METRIC, resolution="raw")))
    scrape_up = [line for line in metrics_text.splitlines()
                 if line.startswith("seedance_scrape_up")]
    skip = max(1, len(samples) // 4)
    t, rss, size = zip(*samples[skip:], strict=True) if len(samples) > skip else ((), (), ())
    lat = np.asarray(latencies)
    result = {
        "bench": "soak",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "protocol": {"minutes": args.minutes, "ranks": RANKS, "series_per_rank":
                     SERIES_PER_RANK, "export_every_s": 1.0, "readers": READERS,
                     "reader_every_s": 0.5, "scrape": "dcgm capture every 5 s",
                     "tuning": ("off: the job attached with tune = false" if args.no_tuning
                                else "workloads.train_family mlp, 1 thread, mode auto, "
                                     "tune true"),
                     "sidecar_allocator": args.allocator,
                     "simulated": "the 8 ranks are SIMULATED (threads posting OTLP); the "
                                  "training job, scrapes and readers are real"},
        "rss_mib": {"start": samples[0][1] if samples else None,
                    "end": samples[-1][1] if samples else None,
                    "slope_mib_per_hour_after_first_quarter": round(
                        slope_per_hour(list(t), list(rss)), 2)},
        "store": {"end_bytes": samples[-1][2] if samples else None,
                  "growth_mib_per_hour": round(slope_per_hour(
                      list(t), [b / 2**20 for b in size]), 2)},
        "api_latency_s": {"calls": int(lat.size),
                          "p50": round(float(np.percentile(lat, 50)), 4) if lat.size else None,
                          "p99": round(float(np.percentile(lat, 99)), 4) if lat.size else None},
        "points": {"sent_answered_200": sum(sent), "stored": stored,
                   "lost": sum(sent) - stored, "refused_or_failed": sum(refused)},
        "scrape_up": scrape_up, "changes": len(changes),
        "sidecar_exit_code": sidecar_code,
        "samples": [{"t_s": round(a, 1), "rss_mib": round(b, 1), "store_bytes": c,
                     **{k.lower(): round(v, 1) for k, v in part.items()}}
                    for (a, b, c), part in zip(samples, parts, strict=True)],
    }
    if args.trace_memory:
        result["tracemalloc"] = heap_growth([work / f"tracemalloc-{t:.0f}.snap"
                                             for t in snapshot_at])
        memory = work / "memory.jsonl"
        result["memory_parts"] = ([json.loads(line) for line in memory.read_text().splitlines()]
                                  if memory.exists() else [])
    if args.native_memory:
        result["native_growth"] = native_growth(work / "memray.bin", snapshot_at)
    for log in logs.values():
        log.close()
    exporter.shutdown()
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
