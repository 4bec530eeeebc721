"""The sidecar with memray tracking a window of its run, for ``bench/soak.py --native-memory``.

tracemalloc sees only Python's allocator; memray sees every ``malloc`` and ``mmap`` (protobuf's
upb arenas, SQLite, pymalloc's own arenas), each with the Python stack that made it. Tracking
starts at ``$SOAK_MEMRAY_WINDOW``'s first time (seconds after start, after warm-up) and stops at
its second, while the sidecar keeps running: what memray then reports as never freed is memory
allocated inside the window and still held at its end, which is the growth and where it came
from (plus the little that was in flight at that instant).

Run as the sidecar is: ``python bench/_memray_sidecar.py --config FILE``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import memray


def _track(start_s: float, stop_s: float, path: str) -> None:
    time.sleep(start_s)
    with memray.Tracker(path):
        time.sleep(max(0.0, stop_s - start_s))


def main() -> None:
    start_s, stop_s = (float(t) for t in os.environ["SOAK_MEMRAY_WINDOW"].split(","))
    threading.Thread(target=_track, args=(start_s, stop_s, os.environ["SOAK_MEMRAY_FILE"]),
                     daemon=True).start()
    from seedancectl.cli import main as cli_main

    sys.argv = ["seedancectl", "sidecar", *sys.argv[1:]]
    cli_main()


if __name__ == "__main__":
    main()
