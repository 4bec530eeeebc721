"""Bench: build a week's tuning report from a store holding N series at 1-second resolution.

Writes a week of SYNTHETIC 1 s points (seeded noise, realistic shapes: per-rank tokens/s, loss,
grad norm, cumulative step-duration count/sum/buckets, per-GPU utilisation) for ``--series``
series into a real store with ``write_series`` batches, then times ``build_report`` for the week
(median of ``--repeats``), interleaved with its baseline, the data gathering alone (store reads,
no plots or rendering), so the ratio says what plotting and rendering cost. Issue target: a
week, 100 series, 1 s resolution (60M points), report in <= 10 s.

    python bench/report.py                      # 100 series x 7 days at 1 s
    python bench/report.py --days 1 --repeats 1 # quick check while developing
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench._targets import Target, at_most, judged
from collectors._store import TimeSeriesStore
from dashboards.report import build_report
from dashboards.report._data import gather
from policies import sqlite_url

NS = 1_000_000_000
JOB = "bench-train"
LE = ("0.05", "0.1", "0.2", "0.3", "0.4", "0.5", "0.75", "1", "2", "5", "+Inf")


TARGET_S = 10.0
"""Issue #6: building a week's report for 100 series at 1 s resolution takes <= 10 s."""


def targets(result: dict) -> list[Target]:
    """Issue #6's one target: the median time to build the week's report."""
    return [at_most("median seconds to build a week's report, 100 series at 1 s", TARGET_S,
                    result["build_report_median_s"], "issue #6")]


def series_plan(n: int) -> list[tuple[str, dict[str, str], str]]:
    """(name, attributes, shape) for ``n`` series: per rank 5 job series, per GPU 2, buckets."""
    plan: list[tuple[str, dict[str, str], str]] = []
    rank = 0
    while len(plan) < n:
        job = {"service.name": JOB, "host.name": "h0", "seedance.rank": str(rank),
               "seedance.config.version": "1"}
        gpu = {"host.name": "h0", "gpu.index": str(rank)}
        plan += [("seedance.train.tokens_per_second", job, "throughput"),
                 ("seedance.train.step.duration.count", job, "count"),
                 ("seedance.train.step.duration.sum", job, "sum"),
                 ("seedance.train.loss", job, "loss"),
                 ("seedance.train.grad.norm", job, "norm"),
                 ("hw.gpu.utilization", gpu, "fraction"),
                 ("hw.gpu.memory.utilization", gpu, "fraction")]
        plan += [("seedance.train.step.duration.bucket", {**job, "le": le}, f"bucket{i}")
                 for i, le in enumerate(LE)]
        rank += 1
    return plan[:n]


def values(shape: str, t_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    n = t_s.shape[0]
    elapsed = t_s - t_s[0] + 1
    if shape == "throughput":
        return 2000 + 100 * rng.standard_normal(n)
    if shape == "count":
        return elapsed * 2.0
    if shape == "sum":
        return elapsed * 1.0
    if shape.startswith("bucket"):
        return elapsed * 2.0 * min(1.0, (int(shape[6:]) + 1) / 8)
    if shape == "loss":
        return 2 + np.exp(-elapsed / 86_400) + 0.05 * rng.standard_normal(n)
    if shape == "norm":
        return 1 + 0.1 * rng.standard_normal(n)
    return np.clip(0.8 + 0.1 * rng.standard_normal(n), 0, 1)


def write_week(path: Path, n_series: int, days: float, start_ns: int, batch_s: int) -> int:
    plan = series_plan(n_series)
    rng = np.random.default_rng(0)
    total_s = int(days * 86_400)
    with TimeSeriesStore(path, raw_retention_s=None, rollup_1m_retention_s=None,
                         rollup_1h_retention_s=None, max_buffered_points=10**9,
                         flush_interval_s=3600) as store:
        for lo in range(0, total_s, batch_s):
            t_s = np.arange(lo, min(total_s, lo + batch_s), dtype=np.int64)
            t_ns = start_ns + t_s * NS
            for name, attrs, shape in plan:
                v = values(shape, t_s.astype(np.float64), rng)
                store.write_series(name, attrs, t_ns, v)
            store.flush()
    return len(plan) * total_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--series", type=int, default=100)
    p.add_argument("--days", type=float, default=7.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-s", type=int, default=7200, help="seconds of points per flush")
    p.add_argument("--store", type=Path, default=None, help="reuse this store if it exists")
    p.add_argument("--out", type=Path, default=Path("bench/results/report.json"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="seedance-bench-report-"))
    store_path = args.store or work / "metrics.db"
    week = datetime.fromisocalendar(2026, 47, 1).replace(tzinfo=UTC)
    since_ns = int(week.timestamp()) * NS
    until_ns = since_ns + int(args.days * 86_400) * NS
    t0 = time.perf_counter()
    points = None
    if not store_path.exists():
        points = write_week(store_path, args.series, args.days, since_ns, args.batch_s)
    write_s = time.perf_counter() - t0
    state_url = sqlite_url(work / "state.db")
    full, gather_only = [], []
    for _ in range(args.repeats):  # A/B interleaved: gathering alone, then the whole report
        with TimeSeriesStore(store_path, readonly=True) as store:
            t = time.perf_counter()
            gather(source=store, source_name="bench", state_db_url=state_url,
                   since_ns=since_ns, until_ns=until_ns, price_per_gpu_hour=2.5)
            gather_only.append(time.perf_counter() - t)
        t = time.perf_counter()
        build_report(store_path=store_path, state_db_url=state_url, since_ns=since_ns,
                     until_ns=until_ns, out_dir=work / "report", price_per_gpu_hour=2.5)
        full.append(time.perf_counter() - t)
    result = {
        "bench": "report", "series": args.series, "days": args.days, "resolution_s": 1,
        "points_written": points, "store_bytes": store_path.stat().st_size,
        "write_s": round(write_s, 1) if points else None, "repeats": args.repeats,
        "build_report_s": [round(x, 3) for x in full],
        "build_report_median_s": round(statistics.median(full), 3),
        "gather_only_s": [round(x, 3) for x in gather_only],
        "gather_only_median_s": round(statistics.median(gather_only), 3),
        "render_share": round(1 - statistics.median(gather_only) / statistics.median(full), 3),
        "target_s": TARGET_S, "meets_target": statistics.median(full) <= TARGET_S,
        "machine": f"{platform.machine()} {platform.python_version()}, shared 2-core box",
        "data": "SYNTHETIC seeded points; the report reads 1-minute rollups for a week",
    }
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
