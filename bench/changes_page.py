"""Benchmark: what one ``GET /v1/changes`` costs a sidecar when the fleet's journal is large.

The fleet shares one change journal, and it only grows (nothing prunes it yet). Until
``changes_page``, ``/v1/changes`` decoded and encoded every change in it on every call; now it
answers one page (``seedancectl._api.PAGE``, 100) on the keyset index ``changes_in_order``. This bench times
the endpoint's work, without HTTP, on one journal of ``--changes`` SIMULATED changes (each
like the fleet bench's: six measured windows, a plan, a comparison; about 3 KiB of JSON), in a
real PostgreSQL 15 (``tests/postgres.py``) and in a SQLite file:

- ``whole``: ``ChangeJournal.changes()`` and each change to JSON, what the endpoint did before;
- ``first_page``: ``changes_page(limit=PAGE)`` and its JSON;
- ``deep_page``: the same for the last page, after the ``--changes - PAGE``-th change (a keyset
  page deep in the journal must cost what the first does, unlike an offset).

Each encodes its changes as the endpoint does (``change_json``, then rendered by pydantic as
FastAPI renders the answer). Two more ops time that encoding alone, on the first page's
changes already read: ``json_before`` with json's round trip (``json.loads(to_json())``, the
code before orjson) and ``json_now`` with ``change_json``.

Calls alternate (whole, first, deep, json_before, json_now, whole, ...), ``--calls`` of each
per database; medians and their ratios are reported.

Targets: a page at most 1/20 of the whole journal's time at 20,000 changes, a deep page at
most 2x the first, and the encoding now at most what it was.

Run: python bench/changes_page.py [--changes 20000 --calls 15]
Results: bench/results/changes_page.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import insert

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pydantic import TypeAdapter  # noqa: E402

from bench._default_session import code_revision  # noqa: E402
from bench._targets import Target, at_most, judged  # noqa: E402
from seedancectl._api import PAGE, change_json  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402
from tuner import Change, ChangeCursor, ChangeJournal  # noqa: E402
from tuner._change_tables import changes_table  # noqa: E402
from tuner._windows import Window  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "changes_page.json"
OPS = ("whole", "first_page", "deep_page", "json_before", "json_now")
_ANSWER = TypeAdapter(list[dict[str, Any]])
"""How FastAPI renders the endpoint's answer: its declared type, through pydantic."""


def targets(result: dict[str, Any]) -> list[Target]:
    """Per database: a page well under the whole journal, a deep page like the first."""
    found = []
    for db, figures in result["databases"].items():
        found += [
            at_most(f"{db}: first page / whole journal", 0.05,
                    figures["first_page_over_whole"], "issue #14 (scale: a fleet's journal)"),
            at_most(f"{db}: deep page / first page", 2.0, figures["deep_over_first"],
                    "issue #14 (scale: a keyset page, not an offset)"),
            at_most(f"{db}: a page's encoding, now / before", 1.0,
                    figures["json_now_over_before"], "bench docstring (no regression)")]
    return found


def simulated_change(i: int, at_ns: int) -> Change:
    """A SIMULATED kept change shaped as the fleet bench's: six windows, a plan, a verdict."""
    windows = tuple(Window(version=2 * i + k, arm="candidate" if k % 2 else "baseline",
                           steps=400 + k, step_s=0.05 + 0.001 * k, tokens_per_s=8000.0 + k,
                           loss=2.5, nonfinite_loss=False, start_ns=at_ns + k * 10**10,
                           end_ns=at_ns + (k + 1) * 10**10, step_cv=0.02) for k in range(6))
    return Change(
        id=f"{i:016x}", job=f"fleet-job-{i % 1000}", state="kept", source="trial",
        reason="search trial 7: sim.fuse on", risk="low", scope="live",
        values={"sim.fuse": "on"}, baseline={"sim.fuse": "off", "sim.batch": 8},
        created_at_s=at_ns / 1e9, expires_at_s=at_ns / 1e9 + 600, approved_by="auto",
        traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01",
        plan={"arms": ["baseline", "candidate"] * 3, "index": 5, "version": 2 * i + 5,
              "acked": True, "trial": i},
        windows=windows,
        comparison={"gain": 0.08, "ci_low": 0.05, "ci_high": 0.11, "confidence": 0.95,
                    "pairs": 3})


def fill(url: str, n: int) -> ChangeCursor:
    """``n`` changes in the journal at ``url``, in bulk; the cursor before the last page."""
    journal = ChangeJournal(url)  # creates the tables
    start = time.time_ns()
    rows = []
    for i in range(n):
        change = simulated_change(i, start + i)
        rows.append({"id": change.id, "job": change.job, "state": change.state,
                     "created_at_ns": start + i, "updated_at_ns": start + i,
                     "body": change.to_json()})
    with journal._engine.begin() as conn:  # noqa: SLF001 - a bench's bulk load, not an API
        for lo in range(0, n, 2000):
            conn.execute(insert(changes_table), rows[lo:lo + 2000])
    journal.close()
    last = rows[n - PAGE - 1]
    return ChangeCursor(last["created_at_ns"], last["id"])


def json_round_trip(change: Change) -> dict[str, Any]:
    """``change_json`` before orjson: the baseline of ``json_before``."""
    return json.loads(change.to_json())  # type: ignore[no-any-return]


def endpoint_json(changes: list[Change],
                  encode: Callable[[Change], dict[str, Any]] = change_json) -> int:
    """The endpoint's encoding of a list of changes; the bytes it would send."""
    return len(_ANSWER.dump_json([encode(c) for c in changes]))


def time_one(call: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    size = call()
    return (time.perf_counter() - start) * 1e3, size


def measure(url: str, n: int, calls: int) -> dict[str, Any]:
    deep = fill(url, n)
    journal = ChangeJournal(url)
    arms: dict[str, Callable[[], int]] = {
        "whole": lambda: endpoint_json(journal.changes()),
        "first_page": lambda: endpoint_json(journal.changes_page(limit=PAGE)[0]),
        "deep_page": lambda: endpoint_json(journal.changes_page(limit=PAGE, after=deep)[0]),
        "json_before": lambda: endpoint_json(page, json_round_trip),
        "json_now": lambda: endpoint_json(page),
    }
    page = journal.changes_page(limit=PAGE)[0]
    for call in arms.values():  # warm-up: connections, caches
        call()
    ms: dict[str, list[float]] = {op: [] for op in OPS}
    sizes: dict[str, int] = {}
    for _ in range(calls):
        for op in OPS:
            took, sizes[op] = time_one(arms[op])
            ms[op].append(took)
    journal.close()
    med = {op: statistics.median(v) for op, v in ms.items()}
    return {
        "changes": n, "calls": calls,
        "median_ms": med, "ms": ms, "bytes": sizes,
        "first_page_over_whole": med["first_page"] / med["whole"],
        "deep_over_first": med["deep_page"] / med["first_page"],
        "json_now_over_before": med["json_now"] / med["json_before"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--changes", type=int, default=20000)
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    databases: dict[str, Any] = {}
    with PostgresServer() as server:
        databases["postgresql"] = measure(server.create_database("changes_page"),
                                          args.changes, args.calls)
    with tempfile.TemporaryDirectory() as tmp:
        databases["sqlite"] = measure(f"sqlite:///{tmp}/state.db", args.changes, args.calls)
    result: dict[str, Any] = {
        "bench": "changes_page",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version()},
        "protocol": __doc__,
        "page": PAGE,
        "code_revision": code_revision(),
        "databases": databases,
    }
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for db, figures in databases.items():
        m = figures["median_ms"]
        print(f"{db}: whole {m['whole']:.1f} ms, first page {m['first_page']:.1f} ms, "
              f"deep page {m['deep_page']:.1f} ms, a page's encoding {m['json_before']:.1f} -> "
              f"{m['json_now']:.1f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
