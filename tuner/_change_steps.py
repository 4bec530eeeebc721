"""The rollout controller's primitives: journaled transitions and saves, the registry's lapse
and attach events, and the watch over a rollback's restore (the job's ack of its baseline, sent
again up to ``restore_attempts`` times, then ``manual_intervention_required``).
``RolloutController`` drives the state machine with them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from tuner._change import (
    ACTIVE,
    ENDED,
    IN_FLIGHT,
    MANUAL,
    TRANSITIONS,
    Change,
    ChangeCursor,
    IllegalTransition,
    RolloutError,
    State,
)
from tuner._change_trace import ChangeTrace
from tuner._journal import ChangeJournal
from tuner._lease import JobRegistry
from tuner._lease_messages import AttachEvent, JobStatus
from tuner._restore import RESTORE_KEY, Restore, restore_outcome
from tuner._tuning_metrics import TuningMetrics
from tuner._verdict import RolloutConfig
from tuner._windows import Comparison

log = logging.getLogger(__name__)


class ChangeObserver(Protocol):
    """Who wants to hear about a change's windows and end (the search driver)."""

    def on_window(self, change: Change, comparison: Comparison) -> bool:
        """Called after each candidate window; True stops the change (rolled back, pruned)."""
        ...

    def on_finished(self, change: Change) -> None:
        """Called once the change reached a final state."""
        ...


class ChangeSteps:
    """Journaled moves of changes and the restore watch, over the attributes a controller
    sets up. Callers hold ``_lock``."""

    registry: JobRegistry
    journal: ChangeJournal
    metrics: TuningMetrics
    trace: ChangeTrace
    config: RolloutConfig
    _clock: Callable[[], float]
    _lock: threading.RLock
    _observers: list[ChangeObserver]
    _restoring: set[str]  # rolled back, the job's ack of its baseline to come

    def get(self, change_id: str) -> Change:
        """One change (``RolloutError`` when unknown)."""
        return self.journal.get(change_id)

    def changes(self, *, job: str | None = None,
                states: Sequence[str] | None = None) -> list[Change]:
        """Changes, oldest first."""
        return self.journal.changes(job=job, states=states)

    def changes_page(self, *, job: str | None = None, states: Sequence[str] | None = None,
                     after: ChangeCursor | None = None, limit: int | None = None
                     ) -> tuple[list[Change], ChangeCursor | None]:
        """One page of changes (``ChangeJournal.changes_page``)."""
        return self.journal.changes_page(job=job, states=states, after=after, limit=limit)

    def state_counts(self) -> dict[str, int]:
        """How many changes are in each state (``ChangeJournal.state_counts``)."""
        return self.journal.state_counts()

    def _confirm_restore(self, change: Change) -> None:
        """One look at a rollback's restore: confirmed, still to come, or failed (then sent
        again, or, after ``restore_attempts``, the change needs a person)."""
        restore = Restore.from_plan(change.plan)
        if restore is None or restore.confirmed or change.state not in ("rolled_back", MANUAL):
            self._restoring.discard(change.id)
            return
        if not self._attached(change.job) or self.registry.status(change.job).state == "lapsed":
            return  # it returns to its baseline itself; a late ack costs one attempt at most
        outcome = restore_outcome(restore, self.registry.acks(change.job), now_s=self._clock(),
                                  ack_timeout_s=self.config.ack_timeout_s)
        if outcome is None:
            return
        if outcome == "confirmed":
            self._restoring.discard(change.id)
            change = self._save(change, plan={**change.plan, RESTORE_KEY: replace(
                restore, confirmed=True, problem=None).to_json()}, event=(
                "restore_confirmed", f"the job acked its baseline v{restore.version}"
                + (" and ran the rollback" if restore.action else ""), restore.version))
            if change.state == MANUAL:
                self._move(change, "rolled_back", by="job", reason=(
                    f"the job is back on its baseline (v{restore.version} acked)"))
            return
        if restore.attempt < self.config.restore_attempts:
            self._send_restore(change, by="controller", reason=outcome)
            return
        self._restoring.discard(change.id)
        change = self._save(change, plan={**change.plan, RESTORE_KEY: replace(
            restore, problem=outcome).to_json()})
        if change.state != MANUAL:
            self._move(change, MANUAL, by="controller", reason=(
                f"the rollback failed {restore.attempt} times, the last: {outcome}; the job "
                "may run a config or model state nobody checked. Find out why, then "
                f"`seedancectl rollback {change.job}` to try again"))

    def _send_restore(self, change: Change, *, by: str, reason: str,
                      fresh: bool = False) -> Change:
        """Send the rollback's baseline (and action) again; ``fresh``: an operator's retry,
        which starts a new round of attempts."""
        restore = Restore.from_plan(change.plan)
        if restore is None:
            raise RolloutError(f"change {change.id} has no rollback to send again")
        if not self._attached(change.job):
            raise RolloutError(f"job {change.job} is not attached: it returns to its baseline "
                               "when it attaches again")
        config = self.registry.set_desired(change.job, restore.values, change_id=change.id)
        if restore.action is not None:
            config = self.registry.push_action(change.job, restore.action)
        attempt = 1 if fresh else restore.attempt + 1
        sent = replace(restore, version=config.version, attempt=attempt,
                       sent_at_s=self._clock(), problem=reason, confirmed=False)
        self._restoring.add(change.id)
        return self._save(change, plan={**change.plan, RESTORE_KEY: sent.to_json()},
                          event=("restore_retry", f"attempt {attempt} of "
                                 f"{self.config.restore_attempts} as v{config.version} "
                                 f"({by}): {reason}", config.version))

    def _unrestored(self, job: str) -> Change | None:
        """The job's rollback whose restore is not confirmed yet, or that needs a person."""
        waiting = [self.get(c) for c in sorted(self._restoring)]  # under the lock
        found = [c for c in waiting if c.job == job] or self.changes(job=job, states=[MANUAL])
        return found[0] if found else None

    def _on_lapse(self, status: JobStatus) -> None:
        with self._lock:
            for change in self.changes(job=status.job, states=sorted(ACTIVE)):
                self._fail(change, f"the lease lapsed (no call for {status.lease_ttl_s:g} s)")

    def _on_attach(self, event: AttachEvent) -> None:
        """Every attach is in the audit log, with what it did to the baseline."""
        reason = {
            "new": "first attach: the job's launch config is its baseline",
            "resumed": "re-attached: the stored baseline stays"
                       + (f" (the job proposed other values of {', '.join(event.ignored)}: "
                          "ignored; a new baseline is a change)" if event.ignored else ""),
            "merged": "re-attached with other knobs: the stored values stay where still "
                      "valid, new knobs take the job's",
        }[event.outcome]
        self.journal.record(event.job, "attach", f"job:{event.job}", reason,
                            version_after=event.baseline_version,
                            detail={"session": event.session, "outcome": event.outcome,
                                    "ignored": list(event.ignored)})

    def _in_flight(self, job: str) -> Change | None:
        found = self.changes(job=job, states=sorted(IN_FLIGHT))
        return found[0] if found else None

    def _attached(self, job: str) -> bool:
        return any(s.job == job for s in self.registry.jobs())

    def _fail(self, change: Change, reason: str) -> None:
        self._move(change, "failed", by="controller", reason=reason, spans={})

    # ---- journal -----------------------------------------------------------------------------

    def _move(self, change: Change, to: State, *, by: str, reason: str,
              version_before: int | None = None, version_after: int | None = None,
              detail: Mapping[str, Any] | None = None, **fields: Any) -> Change:
        """Journal and persist a transition (one database transaction); nothing else."""
        if to not in TRANSITIONS[change.state]:
            raise IllegalTransition(f"change {change.id}: {change.state} -> {to} is not allowed")
        moved = replace(change, state=to, **fields)
        self.journal.move(change, moved, actor=by, reason=reason, version_before=version_before,
                          version_after=version_after, detail=detail)
        log.info("change %s (%s): %s -> %s by %s: %s", change.id, change.job, change.state, to,
                 by, reason)
        self.trace.moved(change, moved, by, reason)
        self.metrics.entered(moved, change.state)
        if (to in ENDED and change.state != MANUAL) or to == "kept":
            for observer in list(self._observers):
                try:
                    observer.on_finished(moved)
                except Exception:
                    log.exception("rollout observer %r failed on change %s", observer, moved.id)
        return moved

    def _save(self, change: Change, *, event: tuple[str, str, int | None] | None = None,
              **fields: Any) -> Change:
        saved = replace(change, **fields)
        self.journal.save(saved, event=event)
        return saved

    def _event_only(self, change: Change, kind: str, by: str, reason: str, *,
                    version_before: int | None = None, version_after: int | None = None,
                    detail: Mapping[str, Any] | None = None) -> None:
        self.journal.record(change.job, kind, by, reason, change_id=change.id,
                            version_before=version_before, version_after=version_after,
                            detail=detail)
