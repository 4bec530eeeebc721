"""The webhook notifier's counts agree with what its result callback recorded."""

from __future__ import annotations

import socket
import threading
import time

from seedancectl._webhook import WebhookNotifier
from tuner import Change


def test_a_failed_post_is_counted_only_after_its_result_is_recorded() -> None:
    recorded = threading.Event()
    release = threading.Event()
    results: list[tuple[str, bool, str]] = []

    def record(change: Change, delivered: bool, detail: str) -> None:
        results.append((change.id, delivered, detail))
        recorded.set()
        release.wait(10)

    with socket.socket() as silent:  # listens, never answers: the post times out
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        notifier = WebhookNotifier(f"http://127.0.0.1:{silent.getsockname()[1]}/hook",
                                   timeout_s=0.2, on_result=record)
        notifier.start()
        try:
            notifier.notify(Change(
                id="c1", job="gpt", state="proposed", source="operator", reason="test",
                risk="low", scope="job", values={"threads": 2}, baseline={"threads": 1},
                created_at_s=0.0, expires_at_s=60.0), {"text": "x"})
            assert recorded.wait(10), "the post's result never reached the callback"
            assert notifier.stats.failed == 0  # a reader who saw 1 here would find no record
            release.set()
            deadline = time.monotonic() + 10
            while notifier.stats.failed < 1:
                assert time.monotonic() < deadline, "the failed post was never counted"
                time.sleep(0.01)
        finally:
            release.set()
            notifier.shutdown()
    assert [(cid, ok) for cid, ok, _ in results] == [("c1", False)]
    assert "Timeout" in results[0][2]
