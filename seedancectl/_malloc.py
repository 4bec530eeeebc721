"""A fixed mmap threshold for glibc's malloc in the sidecar process.

glibc serves an allocation of 128 KiB or more with its own mmap, returned to the system when
freed, but each time such a block is freed it raises that threshold to the block's size (up to
32 MiB). The store's flushes and folds allocate numpy columns of megabytes: after the first is
freed, later ones come from the heap, and a hole left between smaller live objects is never
given back. At 500k points/s a sidecar's RSS reached 1.1-1.25 GiB that way; with the threshold
fixed (as ``MALLOC_MMAP_THRESHOLD_`` would fix it, which needs the environment before the
process starts) it stayed at 467 MiB, at the same rate (`bench/otlp_ingest.py`, 8 exporters).
"""

from __future__ import annotations

import ctypes
import platform

MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's own default, kept: setting it at all is what stops the dynamic raise."""

_M_MMAP_THRESHOLD = -3  # malloc.h


def fix_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for the rest of the process; False where the C library is
    not glibc (musl and others have no dynamic threshold) or refuses."""
    if platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
