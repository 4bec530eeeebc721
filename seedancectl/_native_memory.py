"""The sidecar's memory outside Python's heap, held to its working set.

A soak under tracemalloc (``bench/soak.py --trace-memory``) showed Python's heap flat
(164 -> 162 MiB) while RSS kept climbing: glibc's allocator keeps freed memory in up to eight
arenas per core for the API's worker threads and hands little of it back. So the sidecar caps
the arenas before its threads start and trims free pages back to the OS once a minute. On a
libc without these calls (musl, macOS) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
ARENAS = 2
TRIM_EVERY_S = 60.0


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def cap_arenas(arenas: int = ARENAS) -> bool:
    """Cap malloc's arenas (as ``MALLOC_ARENA_MAX`` would); call before threads start.
    False where the libc has no ``mallopt``."""
    libc = _glibc()
    return libc is not None and libc.mallopt(M_ARENA_MAX, arenas) == 1


def trim() -> bool:
    """Hand the heap's free pages back to the OS now; False where the libc cannot."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def trim_periodically(stop: threading.Event, every_s: float = TRIM_EVERY_S) -> None:
    """`trim` every `every_s` until `stop` is set."""
    if not trim():
        log.info("no glibc malloc_trim: the sidecar's free heap stays with the process")
        return
    while not stop.wait(every_s):
        trim()
