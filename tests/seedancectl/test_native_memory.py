"""The sidecar's native-memory hold: freed heap below a live block goes back to the OS only
when trimmed, which is what kept the sidecar's RSS climbing in the soak while Python's heap
stayed flat. Each case runs in a fresh interpreter so its RSS is its own."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

SCRIPT = """
import json, sys
from pathlib import Path
from seedancectl._native_memory import cap_arenas, trim

def rss_mib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines()
                if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

capped = cap_arenas()
start = rss_mib()
blocks = [bytes(1024) for _ in range(100_000)]  # past pymalloc's 512 bytes: glibc's heap
pin = blocks[-1]  # a live block at the top keeps free() from shrinking the heap itself
del blocks
held = rss_mib()
trimmed = trim()
print(json.dumps({"capped": capped, "trimmed": trimmed, "start": start, "held": held,
                  "after": rss_mib()}))
"""


def test_a_trim_hands_freed_heap_back_to_the_os() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    r = json.loads(out)
    assert r["capped"] and r["trimmed"]
    assert r["held"] - r["start"] > 60, r  # the freed 100 MiB stayed with the process
    assert r["held"] - r["after"] > 60, r  # and the trim gave it back
