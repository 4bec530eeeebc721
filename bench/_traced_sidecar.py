"""The sidecar with tracemalloc on, for ``bench/soak.py --trace-memory``: it dumps a snapshot
at each time ``$SOAK_SNAPSHOT_AT`` lists (seconds after start, comma separated) into
``$SOAK_SNAPSHOT_DIR``, so the soak can say which lines hold the memory that grew, or that
Python's heap did not grow and the growth is native (SQLite, the allocator).

Run as the sidecar is: ``python bench/_traced_sidecar.py --config FILE``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

FRAMES = 12


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
    from seedancectl.cli import main as cli_main

    sys.argv = ["seedancectl", "sidecar", *sys.argv[1:]]
    cli_main()


if __name__ == "__main__":
    main()
