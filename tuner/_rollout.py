"""The rollout controller: proposed -> approved -> applying -> observing -> kept | rolled_back.

An explicit state machine over changes, journaled in the state database (the findings store's
SQLAlchemy URL) BEFORE every transition and every call that touches a job, so a crash at any
moment leaves a change the next controller finds: on start, every change left in `applying` or
`observing` is rolled back. ``change_events`` is append-only and is the audit log: proposals,
decisions (who, when, why), applies with the config versions before and after, acks, windows,
keeps and rollbacks.

Life of a change (``tick()`` advances every active one; a sidecar thread calls it):

- ``proposed``: waits for a person unless the job's approval mode is ``auto`` and the change is
  live, low risk and within the operator's per-knob bounds. Expires after ``proposal_ttl_s``.
- ``approved``: waits until no other change of the job is in flight. A change that lowers a
  precision first pushes a ``{"kind": "snapshot"}`` action.
- ``applying``: the candidate was sent (``registry.set_desired``); waits for its ack.
- ``observing``: windows alternate candidate, baseline, candidate, ... (each a fresh version, see
  ``tuner._measure``), so an approved change reaches the job at once; after each pair
  guardrails are checked, observers (the search driver) may stop it, and the sequential test
  decides or asks for one more pair (``RolloutConfig``). Kept only when the confidence
  sequence of the gain excludes zero and loss stays on the baseline's trajectory; then the
  candidate becomes the baseline.
- Guardrails roll back at once: non-finite loss -> FULL rollback action; a gradient-collapse /
  underflow finding on group G -> LOCAL rollback action for G and precision.G back to fp32;
  a measured regression -> config rollback only. A lapsed lease fails the change.
- ``rolled_back`` is confirmed when the job acks its baseline and ran the rollback action
  (``tuner._restore``); until then no other change of the job starts. A restore that fails is
  sent again up to ``restore_attempts`` times, then the change is
  ``manual_intervention_required`` (the sidecar opens a finding) until an operator's rollback
  gets the job's ack; then it is ``rolled_back`` again.

Every change is one OpenTelemetry trace (``tracing``): a root span ``change`` from proposal to
verdict with children ``propose``, ``approve``, ``apply`` and ``observe`` (one of each per
window), and ``keep`` or ``rollback`` (or ``reject``, ``expire``, ``fail``). A span that spans
ticks is *journaled*: its W3C traceparent and start are stored in the change record
(``Change.traceparent`` for the root, ``Change.spans`` for open ones) and it is recorded when it
ends, so a controller started after a crash continues the same trace. ``set_desired`` sends the
``apply`` (or ``keep`` / ``rollback``) span's traceparent, so the job's ``job.apply`` span joins
the trace. The root is recorded at the verdict, so until then a trace viewer shows the children
under a parent it has not received yet.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Connection

from collectors import Tracing, new_traceparent, null_tracing, state_engine
from tuner._change import (
    ACTIVE,
    ENDED,
    IN_FLIGHT,
    MANUAL,
    PRUNED,
    TRANSITIONS,
    Change,
    IllegalTransition,
    Mode,
    RolloutError,
    Source,
    State,
    Trip,
    precision_lowered,
)
from tuner._change_tables import change_events_table, changes_table, metadata, modes_table
from tuner._guardrails import Guardrail
from tuner._knobs import KnobSpace
from tuner._lease import JobRegistry
from tuner._lease_messages import AttachEvent, JobStatus
from tuner._measure import Comparison, QueryFn, compare, measure_window, window_config
from tuner._restore import RESTORE_KEY, Restore, restore_outcome
from tuner._verdict import RolloutConfig, decide, interval_text

log = logging.getLogger(__name__)


class ChangeObserver(Protocol):
    """Who wants to hear about a change's windows and end (the search driver)."""

    def on_window(self, change: Change, comparison: Comparison) -> bool:
        """Called after each candidate window; True stops the change (rolled back, pruned)."""
        ...

    def on_finished(self, change: Change) -> None:
        """Called once the change reached a final state."""
        ...


# ---- the controller -------------------------------------------------------------------------


class RolloutController:
    """Drives changes through the state machine; see the module docstring.

    Thread-safe: ``propose``/``approve``/``reject``/``rollback`` (HTTP handlers), ``tick``
    (the sidecar's rollout thread) and the registry's lapse callback share one lock. ``tick``
    never blocks on a job: it polls acks with ``timeout_s=0``.
    """

    def __init__(self, registry: JobRegistry, store_query: QueryFn, *, db_url: str,
                 guardrails: Sequence[Guardrail] = (), clock: Callable[[], float] = time.time,
                 config: RolloutConfig | None = None, tracing: Tracing | None = None) -> None:
        self.registry = registry
        self.tracing = tracing or null_tracing("seedance-rollout")
        self.query = store_query
        self.config = config or RolloutConfig()
        self.guardrails = tuple(guardrails)
        self._clock = clock
        self._lock = threading.RLock()
        self._observers: list[ChangeObserver] = []
        self._engine = state_engine(db_url)
        metadata.create_all(self._engine)
        self._restoring: set[str] = set()  # rolled back, the job's ack of its baseline to come
        registry.on_lapse(self._on_lapse)
        registry.on_attach(self._on_attach)
        self._recover()

    # ---- public API --------------------------------------------------------------------------

    def add_observer(self, observer: ChangeObserver) -> None:
        with self._lock:
            self._observers.append(observer)

    def set_mode(self, job: str, mode: Mode, *, by: str, reason: str = "") -> None:
        """Set the job's approval mode (journaled)."""
        if mode not in ("auto", "suggest", "off"):
            raise RolloutError(f"mode must be auto, suggest or off, got {mode!r}")
        with self._lock, self._engine.begin() as conn:
            old = self.mode(job)
            updated = conn.execute(update(modes_table).where(modes_table.c.job == job)
                                   .values(mode=mode)).rowcount
            if not updated:
                conn.execute(insert(modes_table).values(job=job, mode=mode))
            self._event(conn, None, job, "mode", by, reason or f"{old} -> {mode}",
                        detail={"from": old, "to": mode})

    def mode(self, job: str) -> Mode:
        with self._engine.connect() as conn:
            found = conn.execute(select(modes_table.c.mode).where(
                modes_table.c.job == job)).scalar_one_or_none()
        return found or self.config.default_mode  # type: ignore[return-value]

    def propose(self, job: str, values: Mapping[str, Any], *, reason: str, source: Source,
                by: str = "tuner", meta: Mapping[str, Any] | None = None) -> Change:
        """Record a proposal; auto-approve it when the job's mode and the change allow."""
        if source not in ("trial", "finding", "operator"):
            raise RolloutError(f"source must be trial, finding or operator, got {source!r}")
        status = self.registry.status(job)
        space = status.knobs
        checked = space.validate(values, partial=True)
        baseline = dict(status.baseline.values)
        changed = sorted(k for k, v in checked.items() if baseline.get(k) != v)
        if not changed:
            raise RolloutError(f"job {job}: the proposal equals the baseline; nothing to do")
        now = self._clock()
        change = Change(
            id=secrets.token_hex(8), job=job, state="proposed", source=source, reason=reason,
            risk=space.risk_of({k: checked[k] for k in changed}),
            scope=space.scope_of(changed),
            values={k: checked[k] for k in changed}, baseline=baseline, created_at_s=now,
            expires_at_s=now + self.config.proposal_ttl_s,
            traceparent=new_traceparent(), meta=dict(meta or {}))
        with self._lock:
            with self._engine.begin() as conn:
                # Strictly increasing, so "oldest first" is the order of proposal even when
                # the clock does not move between two proposals.
                last = conn.execute(select(func.max(changes_table.c.created_at_ns))).scalar()
                created_ns = max(_ns(now), (last or 0) + 1)
                conn.execute(insert(changes_table).values(
                    id=change.id, job=job, state=change.state, created_at_ns=created_ns,
                    updated_at_ns=_ns(now), body=change.to_json()))
                self._event(conn, change, job, "proposed", by, reason, to_state="proposed",
                            version_before=status.baseline.version,
                            detail={"values": change.values, "baseline": baseline,
                                    "risk": change.risk, "scope": change.scope,
                                    "source": source, "meta": change.meta})
            self._span(change, "propose",
                       attributes={**_change_attributes(change), "seedance.actor": by})
            mode = self.mode(job)
            if mode == "off":
                return self._move(change, "rejected", by="mode:off",
                                  reason=f"approval mode of job {job} is off")
            if mode == "auto" and self._auto_ok(change, space):
                return self._move(change, "approved", by="auto",
                                  reason="auto mode: live, low risk, within bounds",
                                  approved_by="auto")
            return change

    def approve(self, change_id: str, by: str, comment: str = "") -> Change:
        with self._lock:
            return self._move(self.get(change_id), "approved", by=by,
                              reason=comment or "approved", approved_by=by)

    def reject(self, change_id: str, by: str, reason: str) -> Change:
        with self._lock:
            return self._move(self.get(change_id), "rejected", by=by, reason=reason)

    def rollback(self, job: str, by: str, reason: str, *, change_id: str | None = None
                 ) -> Change:
        """Roll back the job's change in flight, else its last kept change (config only).
        With ``change_id``, only that change and only while it is in flight: a caller who saw
        it in flight must not undo a kept change if it ended meanwhile. A change whose rollback
        needs a person (``manual_intervention_required``) gets its rollback sent again, with a
        fresh round of attempts."""
        with self._lock:
            stuck = self.changes(job=job, states=[MANUAL])
            if stuck and change_id in (None, stuck[-1].id):  # a person's retry of the restore
                return self._send_restore(stuck[-1], by=by, reason=reason, fresh=True)
            current = self._in_flight(job)
            if change_id is not None and (current is None or current.id != change_id):
                raise RolloutError(f"job {job}: change {change_id} is not in flight")
            if current is None:
                kept = [c for c in self.changes(job=job) if c.state == "kept"]
                if not kept:
                    raise RolloutError(f"job {job}: no change in flight or kept to roll back")
                current = kept[-1]
            return self._roll_back(current, Trip(kind="config", reason=reason), by=by)

    def get(self, change_id: str) -> Change:
        with self._engine.connect() as conn:
            body = conn.execute(select(changes_table.c.body).where(
                changes_table.c.id == change_id)).scalar_one_or_none()
        if body is None:
            raise RolloutError(f"no change {change_id!r}")
        return Change.from_json(body)

    def changes(self, *, job: str | None = None,
                states: Sequence[str] | None = None) -> list[Change]:
        """Changes, oldest first."""
        query = select(changes_table.c.body).order_by(changes_table.c.created_at_ns,
                                                      changes_table.c.id)
        if job is not None:
            query = query.where(changes_table.c.job == job)
        if states is not None:
            query = query.where(changes_table.c.state.in_(list(states)))
        with self._engine.connect() as conn:
            return [Change.from_json(b) for b in conn.execute(query).scalars()]

    def events(self, *, change_id: str | None = None,
               job: str | None = None) -> list[dict[str, Any]]:
        """The audit log, oldest first."""
        query = select(change_events_table).order_by(change_events_table.c.seq)
        if change_id is not None:
            query = query.where(change_events_table.c.change_id == change_id)
        if job is not None:
            query = query.where(change_events_table.c.job == job)
        with self._engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [{**row, "detail": json.loads(row["detail"])} for row in rows]

    def tick(self) -> None:
        """Advance every active change one step; one failing change never stops the others."""
        for change in self.changes(states=sorted(ACTIVE)):
            try:
                with self._lock:
                    self._advance(self.get(change.id))
            except Exception:
                log.exception("rollout: change %s of job %s failed to advance; going on",
                              change.id, change.job)
        with self._lock:
            restoring = sorted(self._restoring)
        for change_id in restoring:
            try:
                with self._lock:
                    self._confirm_restore(self.get(change_id))
            except Exception:
                log.exception("rollout: the restore of change %s failed to advance; going on",
                              change_id)

    def close(self) -> None:
        """Release the connection pool; a second call is harmless."""
        self._engine.dispose()

    # ---- the machine -------------------------------------------------------------------------

    def _advance(self, change: Change) -> None:
        now = self._clock()
        if change.state == "proposed":
            if now >= change.expires_at_s:
                self._move(change, "expired", by="controller",
                           reason=f"not approved within {self.config.proposal_ttl_s:g} s")
            return
        if change.state == "approved":
            if self._in_flight(change.job) is None and self._unrestored(change.job) is None:
                self._start(change)
            return
        if not self._attached(change.job):
            self._fail(change, "the job is not attached (sidecar restarted or job gone)")
            return
        if self.registry.status(change.job).state == "lapsed":
            self._fail(change, "the job's lease lapsed")
            return
        version = int(change.plan["version"])
        live = change.plan.get("live_version")
        trip = None if live is None else self._guardrail(change, int(live))
        if trip is not None:
            self._roll_back(change, trip)
            return
        if change.plan.get("acked"):
            failed = next((a for a in self.registry.acks(change.job)
                           if a.version == version and a.status == "failed"), None)
            if failed is not None:  # a step raised under it; the job is back on its baseline
                self._roll_back(change, Trip(kind="config", job_failed=True, reason=(
                    f"the job failed under v{version}: {failed.error}")))
                return
        else:
            ack = self.registry.wait_ack(change.job, version, timeout_s=0.0)
            if ack is None:
                if now - change.plan["sent_at_s"] > self.config.ack_timeout_s:
                    self._roll_back(change, Trip(kind="config", reason=(
                        f"no ack of v{version} within {self.config.ack_timeout_s:g} s")))
                return
            if ack.status != "applied":
                self._roll_back(change, Trip(kind="config", job_failed=True, reason=(
                    f"the job failed to apply v{ack.version}: {ack.error}")))
                return
            plan = {**change.plan, "acked": True, "acked_at_s": now, "live_version": version}
            if change.state == "applying":
                plan["applied_at_s"] = now
            spans = self._end(change, "apply", {"seedance.step": ack.step})
            spans = self._open(change, spans, "observe", {
                "seedance.window": int(change.plan["index"]),
                "seedance.window.arm": change.plan["arms"][int(change.plan["index"])],
                "seedance.config.version": version})
            change = self._save(change, plan=plan, spans=spans, event=(
                "ack", f"v{ack.version} applied at step {ack.step}", version))
            if change.state == "applying":
                change = self._move(change, "observing", by="job",
                                    reason=f"candidate v{version} acked")
            trip = self._guardrail(change, version)
            if trip is not None:
                self._roll_back(change, trip)
                return
        self._observe(change, version, now)

    def _start(self, change: Change) -> None:
        current = dict(self.registry.status(change.job).baseline.values)
        if current != dict(change.baseline):
            # approved after a wait: other changes were kept meanwhile; move from today's
            values = {k: v for k, v in change.values.items() if current.get(k) != v}
            if not values:
                self._fail(change, "everything it sets is in force already")
                return
            change = self._save(change, baseline=current, values=values, event=(
                "rebased", "rebased on the job's baseline of now",
                self.registry.status(change.job).baseline.version))
        lowered = precision_lowered(change.baseline, change.values)
        arms = ["candidate", "baseline"]
        change = self._move(change, "applying", by="controller", reason="applying candidate",
                            plan={"arms": arms, "index": 0, "risky": bool(lowered)})
        if lowered:
            self._event_only(change, "snapshot", "controller",
                             f"precision lowered ({', '.join(lowered)}): snapshot first")
            self.registry.push_action(change.job, {"kind": "snapshot", "change_id": change.id})
        self._send(change, 0)

    def _send(self, change: Change, index: int) -> Change:
        """Journal then send window ``index``'s config (a fresh version)."""
        arm = change.plan["arms"][index]
        values = change.candidate if arm == "candidate" else change.baseline
        before = self.registry.status(change.job).desired.version
        self._event_only(change, "apply", "controller", f"window {index}: {arm}",
                         version_before=before, detail={"values": values})
        spans = self._open(change, change.spans, "apply", {
            "seedance.window": index, "seedance.window.arm": arm,
            "seedance.config.version.before": before})
        apply = spans.get("apply")
        config = self.registry.set_desired(change.job, values, change_id=change.id,
                                           traceparent=None if apply is None
                                           else apply["traceparent"])
        if apply is not None:
            apply["attributes"]["seedance.config.version.after"] = config.version
        # A crash before this save loses the apply span only; the change is rolled back anyway.
        return self._save(change, plan={**change.plan, "index": index, "version": config.version,
                                        "acked": False, "sent_at_s": self._clock()},
                          spans=spans,
                          event=("desired", f"window {index}: {arm} is v{config.version}",
                                 config.version))

    def _observe(self, change: Change, version: int, now: float) -> None:
        index, arms = int(change.plan["index"]), change.plan["arms"]
        kind = self.registry.status(change.job).kind
        measure = self.config.measure if kind == "serve" else window_config(
            change.windows, self.config.measure)
        window = measure_window(self.query, change.job, version, arms[index], measure, kind=kind)
        if window is None:
            if now - change.plan["acked_at_s"] > self.config.window_timeout_s:
                self._roll_back(change, Trip(kind="config", reason=(
                    f"window {index} got too few steps in {self.config.window_timeout_s:g} s")))
            return
        windows = (*change.windows, window)
        comparison = compare(windows, self.config.measure)
        spans = self._end(change, "observe", {
            "seedance.window.steps": window.steps,
            "seedance.window.tokens_per_s": window.tokens_per_s,
            "seedance.window.step_s": window.step_s, "seedance.pairs": comparison.pairs,
            "seedance.gain": comparison.gain, "seedance.gain.ci_low": comparison.ci_low,
            "seedance.gain.ci_high": comparison.ci_high, "seedance.loss_ok": comparison.loss_ok})
        change = self._save(change, windows=windows, comparison=comparison.to_json(),
                            spans=spans, event=("window", f"window {index} ({arms[index]}): "
                                   f"{window.tokens_per_s:.1f} tokens/s", version))
        if arms[index] == "baseline" and comparison.pairs:
            if self._judge(change, comparison, now):
                return
            change = self._save(change, plan={**change.plan,
                                              "arms": [*arms, "candidate", "baseline"]},
                                event=("extend", f"pair {comparison.pairs + 1}: undecided, "
                                       f"gain {interval_text(comparison)}", version))
        self._send(change, index + 1)

    def _judge(self, change: Change, comparison: Comparison, now: float) -> bool:
        """After each pair: keep, roll back, or (False) measure another pair. Guardrails on
        loss and latency first, then the sequential test, then the observers (the search's
        pruner), so a measured gain is never pruned."""
        config = self.config
        elapsed_s = now - float(change.plan.get("applied_at_s", now))
        verdict = decide(comparison, config, elapsed_s)
        if isinstance(verdict, Trip):
            self._roll_back(change, verdict)
            return True
        if verdict == "keep":
            self._keep(change, comparison)
            return True
        for observer in list(self._observers):
            try:
                stop = observer.on_window(change, comparison)
            except Exception:
                log.exception("rollout observer %r failed on change %s", observer, change.id)
                continue
            if stop:
                self._roll_back(change, Trip(kind="config", reason=PRUNED))
                return True
        return False

    def _guardrail(self, change: Change, version: int) -> Trip | None:
        """The first guardrail that fires. One that raises fails closed: a change it cannot
        vouch for is rolled back (a training job's state too, as nobody checked it)."""
        for guardrail in self.guardrails:
            try:
                trip = guardrail.check(change, version, self.query)
            except Exception as exc:
                log.exception("guardrail %r failed on change %s", guardrail, change.id)
                serving = self.registry.status(change.job).kind == "serve"
                return Trip(kind="config" if serving else "full", reason=(
                    f"guardrail {type(guardrail).__name__} could not check config v{version} "
                    f"({type(exc).__name__}: {exc}): rolled back, failing closed"))
            if trip is not None:
                return trip
        return None

    def _keep(self, change: Change, comparison: Comparison) -> None:
        before = self.registry.status(change.job).baseline.version
        start_ns, span = _ns(self._clock()), self._child(change)
        change = self._move(change, "kept", by="controller", reason=(
            f"gain {comparison.gain:+.2%} [{comparison.ci_low:+.2%}, {comparison.ci_high:+.2%}]"
            f" at {comparison.confidence:.0%}"), version_before=before)
        baseline = self.registry.set_baseline(change.job, change.candidate)
        desired = self.registry.set_desired(change.job, change.candidate, change_id=change.id,
                                            traceparent=span)
        self._event_only(change, "baseline", "controller", "the candidate is the baseline",
                         version_before=before, version_after=desired.version,
                         detail={"baseline_version": baseline.version})
        self._span(change, "keep", traceparent=span, start_ns=start_ns, attributes={
            "seedance.gain": comparison.gain, "seedance.gain.ci_low": comparison.ci_low,
            "seedance.gain.ci_high": comparison.ci_high,
            "seedance.confidence": comparison.confidence,
            "seedance.config.version.before": before,
            "seedance.config.version.after": desired.version})
        self._end_trace(change)

    def _roll_back(self, change: Change, trip: Trip, *, by: str = "controller") -> Change:
        """Journal the rollback, then send the baseline (and the rollback action, if any)."""
        job, was, opened = change.job, change.state, change
        start_ns, span = _ns(self._clock()), self._child(change)
        attached = self._attached(job)
        before = self.registry.status(job).desired.version if attached else None
        restore = dict(change.baseline)
        if trip.kind == "local" and trip.group:
            knob = next((k for k in (f"precision.{trip.group}", "precision")
                         if attached and k in self.registry.status(job).knobs.knobs), None)
            if knob is not None:
                restore[knob] = "fp32"
        action: dict[str, Any] | None = None
        if trip.kind == "full":
            action = {"kind": "rollback", "scope": "full", "change_id": change.id}
        elif trip.kind == "local":
            action = {"kind": "rollback", "scope": "local", "group": trip.group,
                      "change_id": change.id}
        change = self._move(change, "rolled_back", by=by, reason=trip.reason,
                            version_before=before, plan={**change.plan, "ended_because": (
                                trip.reason), "rollback": trip.kind,
                                "job_failed": trip.job_failed,
                                "inconclusive": trip.inconclusive},
                            detail={"rollback": trip.kind, "group": trip.group,
                                    "action": action, "restore": restore}, spans={})
        self._end_open(opened, error=f"rolled back: {trip.reason}")
        attributes: dict[str, Any] = {
            "seedance.actor": by, "seedance.rollback.cause": trip.reason,
            "seedance.rollback.scope": trip.kind, "seedance.rollback.group": trip.group,
            "seedance.config.version.before": before}
        if attached:
            if restore != change.baseline or was == "kept":
                self.registry.set_baseline(job, restore)
            config = self.registry.set_desired(job, restore, change_id=change.id,
                                               traceparent=span)
            if action is not None:
                config = self.registry.push_action(job, action)
            self._event_only(change, "restored", by, f"baseline sent as v{config.version}",
                             version_before=before, version_after=config.version)
            attributes["seedance.config.version.after"] = config.version
            change = self._save(change, plan={**change.plan, RESTORE_KEY: Restore(
                version=config.version, values=restore, action=action, attempt=1,
                sent_at_s=self._clock()).to_json()})
            self._restoring.add(change.id)
        # else the job returns to its baseline itself when it re-attaches
        self._span(change, "rollback", traceparent=span, start_ns=start_ns,
                   attributes=attributes)
        if was != "kept":  # a kept change's trace ended at its keep
            self._end_trace(change)
        return change

    def _fail(self, change: Change, reason: str) -> None:
        self._move(change, "failed", by="controller", reason=reason, spans={})

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
        with self._engine.begin() as conn:
            self._event(conn, None, event.job, "attach", f"job:{event.job}", reason,
                        version_after=event.baseline_version,
                        detail={"session": event.session, "outcome": event.outcome,
                                "ignored": list(event.ignored)})

    def _recover(self) -> None:
        for change in self.changes(states=["rolled_back"]):
            restore = Restore.from_plan(change.plan)
            if restore is not None and not restore.confirmed:
                self._restoring.add(change.id)
        for change in self.changes(states=sorted(IN_FLIGHT)):
            try:
                self._roll_back(change, Trip(kind="config", reason=(
                    f"controller restarted with the change in {change.state}")), by="recovery")
            except Exception:
                log.exception("recovery of change %s failed", change.id)

    def _auto_ok(self, change: Change, space: KnobSpace) -> bool:
        if change.scope != "live" or change.risk != "low":
            return False
        for name, value in change.values.items():
            bound = self.config.auto_bounds.get(name)
            if bound is None:
                continue
            if isinstance(bound, tuple) and len(bound) == 2 and not isinstance(value, str):
                if not bound[0] <= value <= bound[1]:
                    return False
            elif value not in bound:
                return False
        return True

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

    def _in_flight(self, job: str) -> Change | None:
        found = self.changes(job=job, states=sorted(IN_FLIGHT))
        return found[0] if found else None

    def _attached(self, job: str) -> bool:
        return any(s.job == job for s in self.registry.jobs())

    # ---- traces ------------------------------------------------------------------------------

    def _trace_move(self, before: Change, moved: Change, by: str, reason: str) -> None:
        """The spans of a transition that sends nothing to the job (keep and rollback record
        their own, with the traceparent they send)."""
        name = _MOVE_SPANS.get(moved.state)
        if name is None:
            return
        error = reason if moved.state == "failed" else None
        if error is not None:
            self._end_open(before, error=error)
        self._span(moved, name, attributes={
            "seedance.actor": by, "seedance.reason": reason,
            "seedance.approve.auto": by == "auto" if moved.state == "approved" else None},
            error=error)
        if not TRANSITIONS[moved.state]:
            self._end_trace(moved, error=error)

    def _child(self, change: Change) -> str | None:
        """A new span's traceparent in the change's trace (None for a change without one)."""
        return new_traceparent(change.traceparent) if change.traceparent else None

    def _open(self, change: Change, spans: Mapping[str, Mapping[str, Any]], name: str,
              attributes: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """``spans`` plus a journaled span ``name`` starting now (to be saved with the change)."""
        opened = {k: {**v, "attributes": dict(v["attributes"])} for k, v in spans.items()}
        span = self._child(change)
        if span is not None:
            opened[name] = {"traceparent": span, "start_ns": _ns(self._clock()),
                            "attributes": dict(attributes)}
        return opened

    def _end(self, change: Change, name: str, attributes: Mapping[str, Any] | None = None,
             error: str | None = None) -> Mapping[str, Mapping[str, Any]]:
        """Record the open span ``name`` as ending now; the open spans without it."""
        opened = change.spans.get(name)
        if opened is not None:
            self._span(change, name, traceparent=opened["traceparent"],
                       start_ns=int(opened["start_ns"]),
                       attributes={**opened["attributes"], **(attributes or {})}, error=error)
        return {k: v for k, v in change.spans.items() if k != name}

    def _end_open(self, change: Change, *, error: str) -> None:
        for name in list(change.spans):
            self._end(change, name, error=error)

    def _span(self, change: Change, name: str, *, traceparent: str | None = None,
              start_ns: int | None = None, attributes: Mapping[str, Any] | None = None,
              error: str | None = None) -> None:
        """Record a span of the change's trace ending now; tracing never stops a change."""
        if not change.traceparent:
            return
        now = _ns(self._clock())
        try:
            self.tracing.record(
                name, traceparent=traceparent or new_traceparent(change.traceparent),
                parent=change.traceparent, start_ns=now if start_ns is None else start_ns,
                end_ns=now, attributes={**_change_ids(change), **(attributes or {})},
                error=error, scope=__name__)
        except Exception:
            log.exception("recording span %s of change %s failed; going on", name, change.id)

    def _end_trace(self, change: Change, error: str | None = None) -> None:
        """Record the root span ``change``, from the proposal to now."""
        if not change.traceparent:
            return
        try:
            self.tracing.record(
                "change", traceparent=change.traceparent, parent=None,
                start_ns=_ns(change.created_at_s), end_ns=_ns(self._clock()), attributes={
                    **_change_attributes(change), "seedance.change.state": change.state,
                    "seedance.change.approved_by": change.approved_by,
                    "seedance.gain": (change.comparison or {}).get("gain")},
                error=error, scope=__name__)
        except Exception:
            log.exception("recording the trace of change %s failed; going on", change.id)

    # ---- journal -----------------------------------------------------------------------------

    def _move(self, change: Change, to: State, *, by: str, reason: str,
              version_before: int | None = None, version_after: int | None = None,
              detail: Mapping[str, Any] | None = None, **fields: Any) -> Change:
        """Journal and persist a transition (one database transaction); nothing else."""
        if to not in TRANSITIONS[change.state]:
            raise IllegalTransition(f"change {change.id}: {change.state} -> {to} is not allowed")
        moved = replace(change, state=to, **fields)
        with self._engine.begin() as conn:
            result = conn.execute(update(changes_table).where(
                changes_table.c.id == change.id, changes_table.c.state == change.state).values(
                state=to, updated_at_ns=_ns(self._clock()), body=moved.to_json()))
            if result.rowcount != 1:
                raise IllegalTransition(f"change {change.id} moved under us (was {change.state})")
            self._event(conn, moved, change.job, to, by, reason, from_state=change.state,
                        to_state=to, version_before=version_before,
                        version_after=version_after, detail=detail or {})
        log.info("change %s (%s): %s -> %s by %s: %s", change.id, change.job, change.state, to,
                 by, reason)
        self._trace_move(change, moved, by, reason)
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
        with self._engine.begin() as conn:
            conn.execute(update(changes_table).where(changes_table.c.id == change.id).values(
                updated_at_ns=_ns(self._clock()), body=saved.to_json()))
            if event is not None:
                kind, reason, version = event
                self._event(conn, saved, change.job, kind, "controller", reason,
                            version_after=version, detail={"plan": saved.plan})
        return saved

    def _event_only(self, change: Change, kind: str, by: str, reason: str, *,
                    version_before: int | None = None, version_after: int | None = None,
                    detail: Mapping[str, Any] | None = None) -> None:
        with self._engine.begin() as conn:
            self._event(conn, change, change.job, kind, by, reason,
                        version_before=version_before, version_after=version_after,
                        detail=detail or {})

    def _event(self, conn: Connection, change: Change | None, job: str, kind: str, actor: str,
               reason: str, *, from_state: str | None = None, to_state: str | None = None,
               version_before: int | None = None, version_after: int | None = None,
               detail: Mapping[str, Any]) -> None:
        conn.execute(insert(change_events_table).values(
            change_id=None if change is None else change.id, job=job,
            at_ns=_ns(self._clock()), kind=kind, from_state=from_state, to_state=to_state,
            actor=actor, reason=reason, version_before=version_before,
            version_after=version_after,
            detail=json.dumps(detail, sort_keys=True, default=_json_default)))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


_MOVE_SPANS: Mapping[str, str] = {"approved": "approve", "rejected": "reject",
                                  "expired": "expire", "failed": "fail"}


def _change_ids(change: Change) -> dict[str, Any]:
    return {"seedance.change.id": change.id, "seedance.job": change.job}


def _change_attributes(change: Change) -> dict[str, Any]:
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


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"not JSON: {type(value).__name__}")
