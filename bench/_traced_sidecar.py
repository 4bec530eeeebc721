"""The sidecar with tracemalloc on, for ``bench/soak.py --trace-memory``: it dumps a snapshot
at each time ``$SOAK_SNAPSHOT_AT`` lists (seconds after start, comma separated) into
``$SOAK_SNAPSHOT_DIR``, so the soak can say which lines hold the memory that grew, or that
Python's heap did not grow and the growth is native. Every ``SAMPLE_EVERY_S`` it also appends
Python's traced heap and SQLite's own allocations (``sqlite3_memory_used``, the library the
``sqlite3`` module runs on) to ``memory.jsonl`` there, to tell those two from the rest.

Run as the sidecar is: ``python bench/_traced_sidecar.py --config FILE``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

FRAMES = 12
SAMPLE_EVERY_S = 10.0


def _sqlite_memory_used() -> Callable[[], int] | None:
    """SQLite's ``sqlite3_memory_used`` from the library ``_sqlite3`` loaded (one copy)."""
    name = ctypes.util.find_library("sqlite3")
    if name is None:
        return None
    function = ctypes.CDLL(name).sqlite3_memory_used
    function.restype = ctypes.c_int64
    return function  # type: ignore[no-any-return]


def _sample(folder: Path) -> None:
    sqlite_used = _sqlite_memory_used()
    started = time.monotonic()
    with (folder / "memory.jsonl").open("a") as out:
        while True:
            out.write(json.dumps({
                "t_s": round(time.monotonic() - started, 1),
                "python_traced_mib": round(tracemalloc.get_traced_memory()[0] / 2**20, 2),
                "sqlite_mib": (None if sqlite_used is None
                               else round(sqlite_used() / 2**20, 2))}) + "\n")
            out.flush()
            time.sleep(SAMPLE_EVERY_S)


def _dump_at(times_s: list[float], folder: Path) -> None:
    started = time.monotonic()
    for at in sorted(times_s):
        time.sleep(max(0.0, started + at - time.monotonic()))
        tracemalloc.take_snapshot().dump(str(folder / f"tracemalloc-{at:.0f}.snap"))


def main() -> None:
    tracemalloc.start(FRAMES)
    times = [float(t) for t in os.environ["SOAK_SNAPSHOT_AT"].split(",") if t]
    folder = Path(os.environ["SOAK_SNAPSHOT_DIR"])
    threading.Thread(target=_dump_at, args=(times, folder), daemon=True).start()
    threading.Thread(target=_sample, args=(folder,), daemon=True).start()
    from seedancectl.cli import main as cli_main

    sys.argv = ["seedancectl", "sidecar", *sys.argv[1:]]
    cli_main()


if __name__ == "__main__":
    main()
