"""Tell a person that a change waits for them: a Slack-compatible webhook, sent off-thread.

The message carries what a person needs to decide without opening anything else: the evidence
(the finding's own words, or the trial that proposed it), the change (knob: before -> after)
and the exact commands that approve or reject it. Posting happens on the notifier's own thread
with a deadline, so a slow or dead webhook never holds up the rollout controller; a failure is
logged and counted, never retried in a loop.
"""

from __future__ import annotations

import logging
import queue
import shlex
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from collectors import background_thread
from tuner import Change

log = logging.getLogger(__name__)

DEFAULT_SIDECAR_URL = "http://127.0.0.1:4318"
MAX_QUEUED = 1000

ResultCallback = Callable[[Change, bool, str], None]
"""Called on the notifier's thread after each post: (change, delivered, one-line detail)."""


def approval_message(change: Change, *, evidence: Sequence[str],
                     sidecar_url: str = DEFAULT_SIDECAR_URL) -> dict[str, Any]:
    """The Slack-compatible body (``text`` for plain clients, ``blocks`` for Slack)."""
    target = "" if sidecar_url == DEFAULT_SIDECAR_URL else f" --sidecar {sidecar_url}"
    approve = f"seedancectl approve {change.id} --by NAME{target}"
    reject = (f"seedancectl reject {change.id} --by NAME --reason {shlex.quote('WHY')}"
              f"{target}")
    knobs = "\n".join(f"`{k}`: {change.baseline.get(k)!r} -> {v!r}"
                      for k, v in sorted(change.values.items()))
    title = (f"seedance: change {change.id} of job {change.job} waits for approval "
             f"({change.scope} scope, {change.risk} risk, expires in "
             f"{max(0.0, change.expires_at_s - change.created_at_s):.0f} s)")
    why = "\n\n".join([f"{change.source}: {change.reason}", *evidence])
    text = f"{title}\n{knobs}\nWhy: {why}\nApprove: {approve}\nReject: {reject}"
    blocks = [
        {"type": "header", "text": {"type": "plain_text", "text": title[:150]}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"*Change*\n{knobs}"}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"*Evidence*\n{why}"[:3000]}},
        {"type": "section", "text": {"type": "mrkdwn", "text": (
            f"*Approve*\n```{approve}```\n*Reject*\n```{reject}```")}},
    ]
    return {"text": text, "blocks": blocks}


@dataclass
class NotifierStats:
    """What the notifier did since it started; plain ints, safe to read."""

    sent: int = 0
    failed: int = 0
    dropped: int = 0

    def to_json(self) -> dict[str, int]:
        return {"sent": self.sent, "failed": self.failed, "dropped": self.dropped}


class Notifier:
    """A null notifier: no webhook configured, nothing sent. ``WebhookNotifier`` has the API."""

    url: str | None = None

    def __init__(self) -> None:
        self.stats = NotifierStats()

    def notify(self, change: Change, message: Mapping[str, Any]) -> None:
        """Queue ``message`` about ``change``; never blocks."""

    def start(self) -> None:
        """Start sending (idempotent)."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop sending (idempotent)."""


class WebhookNotifier(Notifier):
    """Posts each queued message to ``url`` from one daemon thread, ``timeout_s`` per post."""

    def __init__(self, url: str, *, timeout_s: float,
                 on_result: ResultCallback | None = None) -> None:
        super().__init__()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = self._target = url
        self.timeout_s = timeout_s
        self._on_result = on_result
        self._queue: queue.Queue[tuple[Change, Mapping[str, Any]] | None] = queue.Queue(
            MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def notify(self, change: Change, message: Mapping[str, Any]) -> None:
        try:
            self._queue.put_nowait((change, message))
        except queue.Full:
            self.stats.dropped += 1
            log.error("webhook queue full; notice of change %s dropped", change.id)

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = background_thread(self._run, name="webhook")
                self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while (item := self._queue.get()) is not None:
                change, message = item
                try:
                    reply = client.post(self._target, json=message)
                    delivered = reply.is_success
                    detail = f"HTTP {reply.status_code}"
                except Exception as exc:  # the loop never dies
                    delivered, detail = False, f"{type(exc).__name__}: {exc}"
                if not delivered:
                    log.warning("webhook %s: notice of change %s not delivered: %s", self.url,
                                change.id, detail)
                if self._on_result is not None:
                    try:
                        self._on_result(change, delivered, detail)
                    except Exception:
                        log.exception("webhook result callback failed for change %s",
                                      change.id)
                # counted last, so a reader who sees the count also finds the result's record
                if delivered:
                    self.stats.sent += 1
                else:
                    self.stats.failed += 1
