"""A fixed mmap threshold for glibc's malloc in the sidecar process.

glibc serves an allocation of 128 KiB or more with its own mmap, returned to the system when
freed, but each time such a block is freed it raises that threshold to the block's size (up to
32 MiB). The store's flushes and folds allocate numpy columns of megabytes: after the first is
freed, later ones come from the heap, and a hole left between smaller live objects is never
given back. At 500k points/s a sidecar's RSS reached 0.65-1.25 GiB that way; with the
thresholds fixed (as ``MALLOC_MMAP_THRESHOLD_`` would fix them, which needs the environment
before the process starts) it stayed at 400-525 MiB at the same rate (`bench/otlp_ingest.py`,
8 exporters, protobuf: two runs each way).
"""

from __future__ import annotations

import ctypes
import platform

MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's own default for both thresholds, kept: setting them at all is what stops the
dynamic raise."""

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3


def fix_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for the rest of the process, and its trim threshold, which
    each raise of the first had set to twice it (so a heap's free top stays mapped up to 64
    MiB when the process's start-up already freed a large block); False where the C library
    is not glibc (musl and others have no dynamic threshold) or refuses."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes)
                and libc.mallopt(_M_TRIM_THRESHOLD, threshold_bytes))
