"""Each change is one OpenTelemetry trace that outlives the controller process.

A root span ``change`` runs from proposal to verdict, with children ``propose``, ``approve``,
``apply`` and ``observe`` (one of each per window), and ``keep`` or ``rollback`` (or
``reject``, ``expire``, ``fail``). A span that spans ticks is *journaled*: its W3C traceparent
and start are stored with the change (``Change.traceparent`` for the root, ``Change.spans`` for
open ones) and it is recorded when it ends, so a controller started after a crash continues the
same trace. Recording never stops a change: a failure is logged and the change goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from collectors import Tracing, new_traceparent
from collectors.names import ATTR_SEEDANCE_JOB
from tuner._change import TRANSITIONS, Change

log = logging.getLogger(__name__)

OpenSpans = Mapping[str, Mapping[str, Any]]

_MOVE_SPANS: Mapping[str, str] = {"approved": "approve", "rejected": "reject",
                                  "expired": "expire", "failed": "fail"}


class ChangeTrace:
    """Records the spans of changes through ``tracing``, timed by the controller's clock."""

    def __init__(self, tracing: Tracing, clock: Callable[[], float], *, scope: str) -> None:
        self.tracing = tracing
        self._clock = clock
        self._scope = scope

    def now_ns(self) -> int:
        """The controller's clock, in ns: when a span the caller opens starts."""
        return _ns(self._clock())

    def moved(self, before: Change, moved: Change, by: str, reason: str) -> None:
        """The spans of a transition that sends nothing to the job (keep and rollback record
        their own, with the traceparent they send)."""
        name = _MOVE_SPANS.get(moved.state)
        if name is None:
            return
        error = reason if moved.state == "failed" else None
        if error is not None:
            self.end_open(before, error=error)
        self.span(moved, name, attributes={
            "seedance.actor": by, "seedance.reason": reason,
            "seedance.approve.auto": by == "auto" if moved.state == "approved" else None},
            error=error)
        if not TRANSITIONS[moved.state]:
            self.end_trace(moved, error=error)

    @staticmethod
    def child(change: Change) -> str | None:
        """A new span's traceparent in the change's trace (None for a change without one)."""
        return new_traceparent(change.traceparent) if change.traceparent else None

    def open(self, change: Change, spans: OpenSpans, name: str,
             attributes: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """``spans`` plus a journaled span ``name`` starting now (to be saved with the change)."""
        opened = {k: {**v, "attributes": dict(v["attributes"])} for k, v in spans.items()}
        span = self.child(change)
        if span is not None:
            opened[name] = {"traceparent": span, "start_ns": self.now_ns(),
                            "attributes": dict(attributes)}
        return opened

    def end(self, change: Change, name: str, attributes: Mapping[str, Any] | None = None,
            error: str | None = None) -> OpenSpans:
        """Record the open span ``name`` as ending now; the open spans without it."""
        opened = change.spans.get(name)
        if opened is not None:
            self.span(change, name, traceparent=opened["traceparent"],
                      start_ns=int(opened["start_ns"]),
                      attributes={**opened["attributes"], **(attributes or {})}, error=error)
        return {k: v for k, v in change.spans.items() if k != name}

    def end_open(self, change: Change, *, error: str) -> None:
        """End every span the change left open, as failed with ``error``."""
        for name in list(change.spans):
            self.end(change, name, error=error)

    def span(self, change: Change, name: str, *, traceparent: str | None = None,
             start_ns: int | None = None, attributes: Mapping[str, Any] | None = None,
             error: str | None = None) -> None:
        """Record a span of the change's trace ending now."""
        if not change.traceparent:
            return
        now = self.now_ns()
        try:
            self.tracing.record(
                name, traceparent=traceparent or new_traceparent(change.traceparent),
                parent=change.traceparent, start_ns=now if start_ns is None else start_ns,
                end_ns=now, attributes={**_change_ids(change), **(attributes or {})},
                error=error, scope=self._scope)
        except Exception:
            log.exception("recording span %s of change %s failed; going on", name, change.id)

    def end_trace(self, change: Change, error: str | None = None) -> None:
        """Record the root span ``change``, from the proposal to now."""
        if not change.traceparent:
            return
        try:
            self.tracing.record(
                "change", traceparent=change.traceparent, parent=None,
                start_ns=_ns(change.created_at_s), end_ns=self.now_ns(), attributes={
                    **change_attributes(change), "seedance.change.state": change.state,
                    "seedance.change.approved_by": change.approved_by,
                    "seedance.gain": (change.comparison or {}).get("gain")},
                error=error, scope=self._scope)
        except Exception:
            log.exception("recording the trace of change %s failed; going on", change.id)


def change_attributes(change: Change) -> dict[str, Any]:
    """What a reader of the trace needs to know what the change was and why."""
    finding = change.meta.get("finding")
    return {
        **_change_ids(change), "seedance.change.source": change.source,
        "seedance.change.reason": change.reason, "seedance.change.risk": change.risk,
        "seedance.change.scope": change.scope,
        "seedance.change.knobs": ", ".join(f"{k}: {change.baseline.get(k)!r} -> {v!r}"
                                           for k, v in sorted(change.values.items())),
        "seedance.finding.id": None if finding is None else str(finding),
        "seedance.trial": change.meta.get("trial")}


def _change_ids(change: Change) -> dict[str, Any]:
    return {"seedance.change.id": change.id, ATTR_SEEDANCE_JOB: change.job}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
