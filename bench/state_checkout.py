"""Benchmark: one short read of the state DB on PostgreSQL, as before and as now, interleaved.

Every API call of a sidecar checks out a pooled connection, runs a statement or a few, and
gives it back. Before, that was four round trips: SQLAlchemy's ``pool_pre_ping`` sent
``SELECT 1`` at checkout, psycopg a ``BEGIN`` before the statement, and the pool a
``ROLLBACK`` when the connection came back. Now ``collectors/_state_pool.py`` polls the socket
instead of pinging, and reads of one statement go through ``collectors.autocommit_reads``
(no transaction to open or end): one round trip. This bench times a read each way, on one
real PostgreSQL 15 (``tests/postgres.py``) with a ``changes``-like table of ``--rows`` rows:

- ``pre_ping``: ``create_engine`` with the same pool sizes and ``pool_pre_ping=True``, the
  read in a transaction (the code before);
- ``polled``: ``collectors.state_engine``, the read in a transaction (the pool change alone);
- ``autocommit``: ``autocommit_reads(state_engine(...))`` (the read as the sidecar makes it now).

One read is ``engine.connect()``, one indexed ``SELECT`` of the 50 newest rows of a job,
fetched, and the connection given back. Arms alternate in blocks of ``--block`` reads for
``--rounds`` rounds (drift on a shared box hits both alike); medians and p99 per arm, pooled,
and their ratios. With ``--busy K``, K processes spin on the CPU throughout (a fleet node's
jobs and other sidecars): there every round trip waits for a core twice.

Target: autocommit (what ships) at most pre_ping, p50 and p99: each round trip saved is time
and PostgreSQL work. ``polled`` is the pool change alone, reported without a target. The
issue's API p99 (100 ms) is judged in ``bench/fleet.py``.

Run: python bench/state_checkout.py [--rounds 10 --block 200 --busy 0]
Results: bench/results/state_checkout.json (``--busy K``: state_checkout_busyK.json)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import numpy as np  # noqa: E402
import sqlalchemy as sa  # noqa: E402

from bench._ab_result import write_ab_result  # noqa: E402
from bench._busy import busy_cores  # noqa: E402
from bench._targets import Target, at_most  # noqa: E402
from collectors import autocommit_reads, state_engine  # noqa: E402
from collectors._state_engine import POSTGRES_POOL  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "state_checkout.json"
ARMS = ("pre_ping", "polled", "autocommit")
_READ = sa.text("SELECT id, job, state, created FROM bench_changes WHERE job = :job "
                "ORDER BY created DESC LIMIT 50")


def targets(result: dict[str, Any]) -> list[Target]:
    """The read as it ships at most the read before, at p50 and p99."""
    s = result["summary"]
    return [at_most(f"read {q}, {arm} / pre_ping", 1.0, s[f"{q}_{arm}_over_pre_ping"],
                    "bench docstring (a round trip fewer must not cost more)")
            for arm in ("autocommit",) for q in ("p50", "p99")]


def _fill(url: str, rows: int) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE bench_changes (id text PRIMARY KEY, job text, "
                             "state text, created double precision)"))
        conn.execute(sa.text("CREATE INDEX ON bench_changes (job, created)"))
        conn.execute(sa.text("INSERT INTO bench_changes VALUES (:id, :job, :state, :created)"),
                     [{"id": f"c{i}", "job": f"job-{i % 16}", "state": "kept",
                       "created": float(i)} for i in range(rows)])
    engine.dispose()


def _reads(engine: sa.Engine, count: int) -> list[float]:
    out = []
    for i in range(count):
        start = time.perf_counter()
        with engine.connect() as conn:
            conn.execute(_READ, {"job": f"job-{i % 16}"}).fetchall()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    args = parser.parse_args()
    from tests.postgres import PostgresServer

    runs: dict[str, list[dict[str, list[float]]]] = {arm: [] for arm in ARMS}
    with PostgresServer() as server:
        url = server.create_database("checkout")
        _fill(url, args.rows)
        options = {k: v for k, v in POSTGRES_POOL.items() if k != "poolclass"}
        engines = {"pre_ping": sa.create_engine(url, pool_pre_ping=True, **options),
                   "polled": state_engine(url)}
        engines["autocommit"] = autocommit_reads(engines["polled"])
        for engine in engines.values():
            _reads(engine, 50)  # warm: pooled connections, compiled statements
        with busy_cores(args.busy):
            for r in range(args.rounds):
                order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
                for arm in order:
                    runs[arm].append({"read": _reads(engines[arm], args.block)})
        for engine in engines.values():
            engine.dispose()

    def pooled(arm: str) -> list[float]:
        return [v for run in runs[arm] for v in run["read"]]

    summary: dict[str, Any] = {
        arm: {"read_p50_ms": round(statistics.median(pooled(arm)), 3),
              "read_p99_ms": round(float(np.percentile(pooled(arm), 99)), 3)} for arm in ARMS}
    for arm in ARMS[1:]:
        for q in ("p50", "p99"):
            summary[f"{q}_{arm}_over_pre_ping"] = round(
                summary[arm][f"read_{q}_ms"] / summary["pre_ping"][f"read_{q}_ms"], 4)
    results = RESULTS if not args.busy else RESULTS.with_name(
        f"state_checkout_busy{args.busy}.json")
    write_ab_result(results, bench="state_checkout", summary=summary, runs=runs,
                    targets=targets,
                    protocol={"rounds": args.rounds, "block": args.block, "rows": args.rows,
                              "busy_cores": args.busy, "database": "PostgreSQL 15 on loopback",
                              "order": "arms alternate per block, the first arm rotating each round"})


if __name__ == "__main__":
    main()
