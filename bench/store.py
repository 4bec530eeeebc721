"""Benchmark: the chunked time-series store against a plain SQLite row table, same run.

Measures, with medians over ``--repeats`` interleaved A/B runs:
- ingest: points/s through ``write_series`` (batches of ``--batch-s`` seconds per series,
  buffer-size flushes, final flush included) and, smaller, through ``write(Point...)``;
- bytes per stored point: file size after close / points, for a realistic mix and per kind;
- week read: a week of 1-minute rollups for ``--series`` series into pandas.

The data are SIMULATED (seeded numpy), shaped like what the sidecar stores, 1 s interval:
  util     30%  GPU utilisation, integers 0-100 held for 1-60 s then stepping
  counter  20%  energy counter in mJ, monotonic, +300,000 +- 20,000 per second
  slow     20%  temperatures (integer C, slow walk) and SM clocks (MHz, rare steps)
  loss     15%  training loss, float32-derived (as torch ``.item()`` returns it), noisy
  gauge64  15%  a float64 gauge (tokens/s computed in Python), full-precision noise
Timestamps: each group of ``--group`` series shares one sampler clock (one NVML tick or one
OpenTelemetry collection stamps all its points alike), 1 s apart with +-0.5 ms jitter in ns.
The "per series clock" row gives every series its own jitter: the worst case for the store.

The baseline is one row per point (series_id, ts, value) with an index on (series_id, ts),
WAL, one transaction per batch; its week read is a GROUP BY minute in SQL into pandas.

Run: python bench/store.py  [--series 100 --hours 6 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._targets import Target, at_least, at_most, judged  # noqa: E402
from collectors._points import Point  # noqa: E402
from collectors._store import TimeSeriesStore  # noqa: E402

NS = 1_000_000_000
MIX = (("util", 0.30), ("counter", 0.20), ("slow", 0.20), ("loss", 0.15), ("gauge64", 0.15))
Series = tuple[str, dict[str, str], np.ndarray, np.ndarray]


def targets(result: dict) -> list[Target]:
    """Issue #2's store targets: batched ingest rate, bytes per point, a week's read time."""
    return [at_least("ingest points/s, batched (write_series)", 500_000,
                     result["ingest_points_per_s"]["store_write_series"], "issue #2"),
            at_most("bytes per stored point, simulated mix", 4,
                    result["bytes_per_point"]["store_mix"],
                    "issue #2 (Prometheus's TSDB stores about 1.3)"),
            at_most("seconds to read a week of 1-minute rollups, 100 series", 0.5,
                    result["week_1m_read_s"]["store"], "issue #2")]


def simulate_values(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """One SIMULATED series of ``kind`` (see the module docstring)."""
    if kind == "util":
        holds = rng.integers(1, 61, n // 10 + 2)
        levels = rng.integers(0, 101, holds.shape[0])
        return np.repeat(levels, holds)[:n].astype(np.float64)
    if kind == "counter":
        return np.cumsum(np.rint(rng.normal(300_000, 20_000, n))).astype(np.float64)
    if kind == "slow":
        if rng.random() < 0.5:
            return np.rint(65 + np.cumsum(rng.normal(0, 0.03, n)))
        steps = rng.random(n) < 0.002
        return 1410.0 - 15.0 * (np.cumsum(steps) % 4)
    if kind == "loss":
        i = np.arange(n)
        loss = 2.5 * np.exp(-i / (n + 1)) + 0.5 + rng.normal(0, 0.05, n)
        return loss.astype(np.float32).astype(np.float64)
    if kind == "gauge64":
        return 12_000 + rng.normal(0, 300, n)
    raise ValueError(kind)


def simulate(n_series: int, seconds: int, start_ns: int, *, group: int, interval_s: int = 1,
             kinds: tuple[str, ...] | None = None, seed: int = 0) -> list[Series]:
    """A SIMULATED fleet of series in the MIX proportions (or all of ``kinds``)."""
    rng = np.random.default_rng(seed)
    n = seconds // interval_s
    grid = start_ns + np.arange(n, dtype=np.int64) * interval_s * NS
    names = [k for k, share in MIX for _ in range(round(share * n_series))] if kinds is None \
        else [kinds[i % len(kinds)] for i in range(n_series)]
    out: list[Series] = []
    clock = grid
    for i, kind in enumerate(names[:n_series]):
        if i % group == 0:
            clock = grid + np.rint(rng.normal(0, 0.5e6, n)).astype(np.int64)
        out.append((f"sim.{kind}", {"hw.id": f"gpu-{i}", "host.name": f"node-{i // 8}"},
                    clock, simulate_values(kind, n, rng)))
    return out


# -- the two contenders ------------------------------------------------------------------

def _batches(data: list[Series], batch_s: int) -> list[tuple[int, Series]]:
    n = data[0][2].shape[0]
    return [(s, d) for s in range(0, n, batch_s) for d in data]


def ingest_store(path: Path, data: list[Series], batch_s: int) -> float:
    with TimeSeriesStore(path, raw_retention_s=None, rollup_1m_retention_s=None,
                         rollup_1h_retention_s=None, flush_interval_s=3600) as store:
        start = time.perf_counter()
        for s, (name, attrs, t, v) in _batches(data, batch_s):
            store.write_series(name, attrs, t[s:s + batch_s], v[s:s + batch_s])
        store.flush()
        return time.perf_counter() - start


def ingest_store_points(path: Path, data: list[Series]) -> float:
    points = [Point(name, float(v[i]), int(t[i]), attrs)
              for name, attrs, t, v in data for i in range(t.shape[0])]
    with TimeSeriesStore(path, raw_retention_s=None, flush_interval_s=3600) as store:
        start = time.perf_counter()
        for i in range(0, len(points), 10_000):
            store.write(points[i:i + 10_000])
        store.flush()
        return time.perf_counter() - start


def ingest_rows(path: Path, data: list[Series], batch_s: int) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE series(id INTEGER PRIMARY KEY, name TEXT, attrs TEXT)")
    conn.execute("CREATE TABLE points(series_id INTEGER, ts INTEGER, value REAL)")
    conn.execute("CREATE INDEX points_by_series ON points(series_id, ts)")
    start = time.perf_counter()
    ids: dict[tuple[str, str], int] = {}
    pending = 0
    conn.execute("BEGIN")
    for s, (name, attrs, t, v) in _batches(data, batch_s):
        key = (name, json.dumps(attrs, sort_keys=True))
        if key not in ids:
            ids[key] = conn.execute("INSERT INTO series(name, attrs) VALUES(?, ?)",
                                    key).lastrowid or 0
        tt, vv = t[s:s + batch_s], v[s:s + batch_s]
        conn.executemany("INSERT INTO points VALUES(?, ?, ?)",
                         zip([ids[key]] * tt.shape[0], tt.tolist(), vv.tolist(), strict=True))
        pending += tt.shape[0]
        if pending >= 200_000:  # the store's default buffer size: same commit cadence
            conn.execute("COMMIT")
            conn.execute("BEGIN")
            pending = 0
    conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return elapsed


def read_week_store(path: Path, since_ns: int, until_ns: int) -> tuple[float, float, int]:
    """(wall s, CPU s of this process, rows) for the week query."""
    with TimeSeriesStore(path, readonly=True) as store:
        start, cpu = time.perf_counter(), time.process_time()
        df = store.query("sim.util", since_ns=since_ns, until_ns=until_ns, resolution="1m")
        return time.perf_counter() - start, time.process_time() - cpu, len(df)


def read_week_rows(path: Path, since_ns: int, until_ns: int) -> tuple[float, float, int]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    start, cpu = time.perf_counter(), time.process_time()
    df = pd.read_sql_query(
        "SELECT series_id, ts / 60000000000 * 60000000000 AS minute, avg(value) AS value, "
        "min(value) AS min, max(value) AS max, count(*) AS count FROM points "
        "WHERE ts BETWEEN ? AND ? GROUP BY series_id, minute ORDER BY minute",
        conn, params=(since_ns, until_ns))
    df["time"] = pd.to_datetime(df["minute"], unit="ns", utc=True)
    elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    conn.close()
    return elapsed, cpu_s, len(df)


def file_bytes(path: Path) -> int:
    return sum(os.path.getsize(p) for p in (path, Path(f"{path}-wal")) if p.exists())


# -- driver ------------------------------------------------------------------------------

def interleaved(repeats: int, a: Callable[[int], float], b: Callable[[int], float]
                ) -> tuple[list[float], list[float]]:
    """Run a and b ``repeats`` times each, alternating which goes first."""
    ra: list[float] = []
    rb: list[float] = []
    for r in range(repeats):
        for fn, out in ((a, ra), (b, rb)) if r % 2 == 0 else ((b, rb), (a, ra)):
            out.append(fn(r))
    return ra, rb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", type=int, default=100)
    ap.add_argument("--hours", type=float, default=6.0, help="ingest data length per series")
    ap.add_argument("--batch-s", type=int, default=600, help="seconds per write_series call")
    ap.add_argument("--group", type=int, default=10, help="series sharing a sampler clock")
    ap.add_argument("--week-interval-s", type=int, default=30,
                    help="raw interval of the week data that feeds the rollups")
    ap.add_argument("--point-objects", type=int, default=300_000,
                    help="points for the write(Point) measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results/store.json")
    args = ap.parse_args()

    seconds = int(args.hours * 3600)
    start_ns = (time.time_ns() // NS - seconds) * NS
    data = simulate(args.series, seconds, start_ns, group=args.group)
    points = sum(t.shape[0] for _, _, t, _ in data)
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    sizes: dict[str, int] = {}

    def run_store(r: int) -> float:
        path = tmp / f"store{r}.db"
        elapsed = ingest_store(path, data, args.batch_s)
        sizes["store"] = file_bytes(path)
        path.unlink()
        return elapsed

    def run_rows(r: int) -> float:
        path = tmp / f"rows{r}.db"
        elapsed = ingest_rows(path, data, args.batch_s)
        sizes["rows"] = file_bytes(path)
        path.unlink()
        return elapsed

    print(f"ingest: {args.series} series x {seconds} s = {points:,} SIMULATED points, "
          f"{args.repeats} interleaved repeats", flush=True)
    store_s, rows_s = interleaved(args.repeats, run_store, run_rows)

    few = max(1, args.point_objects // (seconds or 1))
    point_data = data[::max(1, len(data) // few)][:few]  # spread over the kinds
    point_count = sum(t.shape[0] for _, _, t, _ in point_data)
    write_s = [ingest_store_points(tmp / f"points{r}.db", point_data)
               for r in range(args.repeats)]

    per_kind: dict[str, float] = {}
    for kind, _ in MIX:
        path = tmp / f"kind-{kind}.db"
        kind_data = simulate(args.group, seconds, start_ns, group=args.group, kinds=(kind,))
        ingest_store(path, kind_data, args.batch_s)
        per_kind[kind] = file_bytes(path) / sum(t.shape[0] for _, _, t, _ in kind_data)
    own_clock = tmp / "own-clock.db"
    ingest_store(own_clock, simulate(args.series, seconds, start_ns, group=1), args.batch_s)
    own_clock_bpp = file_bytes(own_clock) / points

    print("week: writing rollup source data ...", flush=True)
    week_s = 7 * 86400
    week_start = (time.time_ns() // NS - week_s) * NS
    week = simulate(args.series, week_s, week_start, group=args.group,
                    interval_s=args.week_interval_s, kinds=("util",), seed=1)
    week_store, week_rows = tmp / "week-store.db", tmp / "week-rows.db"
    ingest_store(week_store, week, 86400 // args.week_interval_s)
    ingest_rows(week_rows, week, 86400 // args.week_interval_s)
    until = week_start + week_s * NS
    cpu: dict[str, list[float]] = {"store": [], "rows": []}

    def timed(kind: str, fn: Callable[[Path, int, int], tuple[float, float, int]],
              path: Path) -> float:
        wall, cpu_s, _ = fn(path, week_start, until)
        cpu[kind].append(cpu_s)
        return wall

    read_store, read_rows = interleaved(
        args.repeats, lambda r: timed("store", read_week_store, week_store),
        lambda r: timed("rows", read_week_rows, week_rows))
    week_rows_store = read_week_store(week_store, week_start, until)[2]
    week_rows_rows = read_week_rows(week_rows, week_start, until)[2]

    med = statistics.median
    result = {
        "data": "SIMULATED (seeded numpy); mix " + ", ".join(f"{k} {s:.0%}" for k, s in MIX),
        "machine": f"{platform.node()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "load_average_1m_at_end": os.getloadavg()[0],
        "points": points, "series": args.series, "seconds": seconds, "repeats": args.repeats,
        "ingest_points_per_s": {"store_write_series": points / med(store_s),
                                "store_write_points": point_count / med(write_s),
                                "baseline_rows": points / med(rows_s)},
        "bytes_per_point": {"store_mix": sizes["store"] / points,
                            "store_mix_per_series_clock": own_clock_bpp,
                            "baseline_rows": sizes["rows"] / points,
                            "store_per_kind": per_kind},
        "week_1m_read_s": {"store": med(read_store), "baseline_rows": med(read_rows),
                           "store_cpu": med(cpu["store"]), "baseline_rows_cpu": med(cpu["rows"]),
                           "rows_returned": {"store": week_rows_store,
                                             "baseline": week_rows_rows}},
        "raw_samples": {"ingest_store_s": store_s, "ingest_rows_s": rows_s,
                        "write_points_s": write_s, "read_store_s": read_store,
                        "read_rows_s": read_rows},
    }
    ing, bpp, wk = (result["ingest_points_per_s"], result["bytes_per_point"],
                    result["week_1m_read_s"])
    result["ratios_vs_baseline"] = {
        "ingest": ing["store_write_series"] / ing["baseline_rows"],
        "bytes_per_point": bpp["store_mix"] / bpp["baseline_rows"],
        "week_read": wk["store"] / wk["baseline_rows"]}
    rat = result["ratios_vs_baseline"]
    print(f"\n{'measure':38} {'store':>12} {'baseline':>12} {'ratio':>7} target")
    print(f"{'ingest points/s (write_series)':38} {ing['store_write_series']:12,.0f} "
          f"{ing['baseline_rows']:12,.0f} {rat['ingest']:7.2f} >= 500,000")
    print(f"{'ingest points/s (write Point objects)':38} {ing['store_write_points']:12,.0f}")
    print(f"{'bytes/point, mix (shared clocks)':38} {bpp['store_mix']:12.2f} "
          f"{bpp['baseline_rows']:12.2f} {rat['bytes_per_point']:7.3f} <= 4")
    print(f"{'bytes/point, mix (per-series clock)':38} {own_clock_bpp:12.2f}")
    for kind, value in per_kind.items():
        print(f"{'  bytes/point ' + kind:38} {value:12.2f}")
    print(f"{'week of 1m rollups, 100 series (s)':38} {wk['store']:12.3f} "
          f"{wk['baseline_rows']:12.3f} {rat['week_read']:7.3f} <= 0.5 s")
    print(f"{'  same, CPU s of the reading process':38} {wk['store_cpu']:12.3f} "
          f"{wk['baseline_rows_cpu']:12.3f}")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus "
          "(a shared box: wall times stretch with load)")
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
