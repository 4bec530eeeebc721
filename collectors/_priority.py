"""Bulk work below the threads that answer.

The sidecar shares cores with the job it watches, so its bulk work (store folds, policy
passes, the search, decoding exports) must yield to the job. Its answers must not: an
operator's API call, a job's lease renewal and a heartbeat wait behind every runnable thread
of their priority, so a whole process at ``nice 10`` answers late on a busy node, then later
again behind its own bulk work. Linux gives each thread its own niceness, so the threads that
do bulk work lower their own and the rest keep the process's. Where a thread's priority is
not its own (other platforms), the whole process is lowered, as before.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_background_nice = 0


def per_thread_priority() -> bool:
    """Whether ``setpriority`` on a thread id moves that thread alone (Linux's semantics)."""
    return sys.platform.startswith("linux") and hasattr(os, "setpriority")


def yield_cpu(nice: int) -> None:
    """Run the process's bulk work ``nice`` steps below its answering threads (the whole
    process, where threads have no priority of their own); 0 runs them alike. Call it
    before the bulk threads start."""
    global _background_nice
    if per_thread_priority():
        _background_nice = max(0, nice)
    elif nice <= 0:
        return
    elif hasattr(os, "nice"):
        os.nice(nice)
    else:
        log.warning("nice = %d ignored: this platform has no os.nice", nice)


def enter_background() -> None:
    """Lower the calling thread by the niceness `yield_cpu` set (nothing when unset), and give
    the OS thread its Python name, so ``top -H`` and ``ps -L`` tell the bulk threads apart."""
    if not per_thread_priority():
        return
    tid = threading.get_native_id()
    try:  # the kernel keeps 15 bytes of a thread's name
        Path(f"/proc/self/task/{tid}/comm").write_bytes(
            threading.current_thread().name.encode()[:15])
    except OSError as e:
        log.debug("could not name thread %d: %s", tid, e)
    if _background_nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + _background_nice))
    except OSError as e:  # a sandbox may forbid it; the thread then runs as it is
        log.debug("could not lower thread %d's priority: %s", tid, e)


def background_thread(target: Callable[[], Any], *, name: str) -> threading.Thread:
    """A daemon thread for bulk work: it runs ``target`` at the background niceness."""
    def run() -> None:
        enter_background()
        target()

    return threading.Thread(target=run, name=name, daemon=True)


def background_pool(workers: int, *, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run at the background niceness."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name,
                              initializer=enter_background)
