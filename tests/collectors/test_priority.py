"""Bulk threads run below the threads that answer; the process's own priority is untouched."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors._priority import background_pool, background_thread, yield_cpu

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(),
                                reason="per-thread priority is Linux's")


def _niceness_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _comm_of_this_thread() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


@pytest.fixture
def nice_3() -> Iterator[None]:
    yield_cpu(3)
    yield
    yield_cpu(0)


def test_a_background_thread_runs_lower_under_its_own_name(nice_3: None) -> None:
    base = _niceness_of_this_thread()
    seen: dict[str, object] = {}
    thread = background_thread(
        lambda: seen.update(nice=_niceness_of_this_thread(), comm=_comm_of_this_thread()),
        name="policy-engine")
    thread.start()
    thread.join(10)
    assert thread.daemon
    assert seen == {"nice": min(base + 3, 19), "comm": "policy-engine"}
    assert _niceness_of_this_thread() == base  # the caller keeps its priority


def test_a_background_pool_runs_every_task_lower(nice_3: None) -> None:
    base = _niceness_of_this_thread()
    with background_pool(2, name="otlp-ingest") as pool:
        seen = set(pool.map(lambda _: (_niceness_of_this_thread(), _comm_of_this_thread()[:11]),
                            range(8)))
    assert seen == {(min(base + 3, 19), "otlp-ingest")}


def test_nice_0_leaves_background_threads_at_the_callers_priority() -> None:
    yield_cpu(0)
    base = _niceness_of_this_thread()
    seen: list[int] = []
    thread = background_thread(lambda: seen.append(_niceness_of_this_thread()), name="x")
    thread.start()
    thread.join(10)
    assert seen == [base]
