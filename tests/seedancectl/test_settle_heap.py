"""The sidecar process freezes what its start-up left, so full collections stay short."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
import seedancectl._sidecar as sidecar
before = len(gc.get_objects())
sidecar.settle_heap()
print(json.dumps({"before": before, "after": len(gc.get_objects()),
                  "frozen": gc.get_freeze_count()}))
"""


def test_a_full_collection_no_longer_walks_the_start_up_objects() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          check=True, timeout=120)
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["before"] > 50_000  # the sidecar's imports alone leave this many
    assert counts["after"] < counts["before"] / 100
    assert counts["frozen"] >= counts["before"] // 2
