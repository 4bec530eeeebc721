"""The rollout controller: drives each change proposed -> approved -> applying -> observing ->
kept | rolled_back, journaling before every transition and every call that touches a job, so
a crash at any moment leaves a change that ``recover()`` rolls back. docs/rollout.md gives the
life of a change, the guardrails and the trace each change records.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import MeterProvider

from collectors import StoreReader, Tracing, new_traceparent, null_tracing
from collectors.names import ATTR_SEEDANCE_CONFIG_VERSION
from tuner._change import (
    ACTIVE,
    IN_FLIGHT,
    MANUAL,
    PRUNED,
    STOPPED,
    Change,
    Mode,
    RollbackCause,
    RolloutError,
    Source,
    Trip,
    precision_lowered,
)
from tuner._change_steps import ChangeObserver, ChangeSteps
from tuner._change_trace import ChangeTrace, change_attributes
from tuner._compare import compare
from tuner._guardrails import Guardrail
from tuner._journal import ChangeJournal
from tuner._lease import JobRegistry
from tuner._measure import measure_window, window_config
from tuner._restore import RESTORE_KEY, Restore
from tuner._tuning_metrics import TuningMetrics
from tuner._verdict import RolloutConfig, auto_approvable, decide, interval_text
from tuner._windows import Comparison

log = logging.getLogger(__name__)


# ---- the controller -------------------------------------------------------------------------


class RolloutController(ChangeSteps):
    """Drives changes through the state machine; see the module docstring.

    Thread-safe: ``propose``/``approve``/``reject``/``rollback`` (HTTP handlers), ``tick``
    (the sidecar's rollout thread) and the registry's lapse callback share one lock. ``tick``
    never blocks on a job: it polls acks with ``timeout_s=0``.
    """

    def __init__(self, registry: JobRegistry, reader: StoreReader, *, db_url: str,
                 guardrails: Sequence[Guardrail] = (), clock: Callable[[], float] = time.time,
                 config: RolloutConfig | None = None, tracing: Tracing | None = None,
                 owns: Callable[[str], bool] = lambda job: True,
                 meter_provider: MeterProvider | None = None) -> None:
        """``owns(job)``: whether this controller drives the job's changes. Sidecars sharing
        one state database see each other's changes in the journal; each moves only those of
        the jobs it holds (``tuner._fleet``), so none fails another's change as unattached.
        ``meter_provider``: where the tuning counters go (default: the global one)."""
        self.registry = registry
        self._owns = owns
        self.trace = ChangeTrace(tracing or null_tracing("seedance-rollout"), clock,
                                 scope=__name__)
        self.reader = reader
        self.config = config or RolloutConfig()
        self.guardrails = tuple(guardrails)
        self._clock = clock
        self._lock = threading.RLock()
        self._observers = []
        self.journal = ChangeJournal(db_url, clock=clock)
        self.metrics = TuningMetrics(meter_provider)
        self._restoring = set()
        registry.on_lapse(self._on_lapse)
        registry.on_attach(self._on_attach)

    # ---- public API --------------------------------------------------------------------------

    def add_observer(self, observer: ChangeObserver) -> None:
        with self._lock:
            self._observers.append(observer)

    def set_mode(self, job: str, mode: Mode, *, by: str, reason: str = "") -> None:
        """Set the job's approval mode (journaled)."""
        if mode not in ("auto", "suggest", "off"):
            raise RolloutError(f"mode must be auto, suggest or off, got {mode!r}")
        with self._lock:
            self.journal.set_mode(job, mode, actor=by, reason=reason, old=self.mode(job))

    def mode(self, job: str) -> Mode:
        """The job's approval mode: the one set for it, else the configured default."""
        return self.journal.mode(job) or self.config.default_mode

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
            self.journal.add(change, actor=by, reason=reason,
                             version_before=status.baseline.version,
                             detail={"values": change.values, "baseline": baseline,
                                     "risk": change.risk, "scope": change.scope,
                                     "source": source, "meta": change.meta})
            self.trace.span(change, "propose",
                       attributes={**change_attributes(change), "seedance.actor": by})
            self.metrics.entered(change, None)
            mode = self.mode(job)
            if mode == "off":
                return self._move(change, "rejected", by="mode:off",
                                  reason=f"approval mode of job {job} is off")
            if mode == "auto" and auto_approvable(change, self.config.auto_bounds):
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
            return self._roll_back(current, Trip(kind="config", reason=reason), "operator", by=by)

    def events(self, *, change_id: str | None = None,
               job: str | None = None) -> list[dict[str, Any]]:
        """The audit log, oldest first."""
        return self.journal.events(change_id=change_id, job=job)

    def tick(self) -> None:
        """Advance every active change of a job this controller owns one step; one failing
        change never stops the others. Sidecars sharing a journal each drive the changes of
        their own jobs only."""
        for change in self.changes(states=sorted(ACTIVE)):
            if not self._owns(change.job):
                continue  # another sidecar's job
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
        self.journal.close()

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
            self._roll_back(change, trip, "guardrail")
            return
        if change.plan.get("acked"):
            failed = next((a for a in self.registry.acks(change.job)
                           if a.version == version and a.status == "failed"), None)
            if failed is not None:  # a step raised under it; the job is back on its baseline
                self._roll_back(change, Trip(kind="config", job_failed=True, reason=(
                    f"the job failed under v{version}: {failed.error}")), "job_failed")
                return
        else:
            ack = self.registry.wait_ack(change.job, version, timeout_s=0.0)
            if ack is None:
                if now - change.plan["sent_at_s"] > self.config.ack_timeout_s:
                    self._roll_back(change, Trip(kind="config", reason=(
                        f"no ack of v{version} within {self.config.ack_timeout_s:g} s")),
                        "timeout")
                return
            if ack.status != "applied":
                self._roll_back(change, Trip(kind="config", job_failed=True, reason=(
                    f"the job failed to apply v{ack.version}: {ack.error}")), "job_failed")
                return
            plan = {**change.plan, "acked": True, "acked_at_s": now, "live_version": version}
            if change.state == "applying":
                plan["applied_at_s"] = now
            spans = self.trace.end(change, "apply", {"seedance.step": ack.step})
            spans = self.trace.open(change, spans, "observe", {
                "seedance.window": int(change.plan["index"]),
                "seedance.window.arm": change.plan["arms"][int(change.plan["index"])],
                ATTR_SEEDANCE_CONFIG_VERSION: version})
            change = self._save(change, plan=plan, spans=spans, event=(
                "ack", f"v{ack.version} applied at step {ack.step}", version))
            if change.state == "applying":
                change = self._move(change, "observing", by="job",
                                    reason=f"candidate v{version} acked")
            trip = self._guardrail(change, version)
            if trip is not None:
                self._roll_back(change, trip, "guardrail")
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
        spans = self.trace.open(change, change.spans, "apply", {
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
        window = measure_window(self.reader, change.job, version, arms[index], measure, kind=kind)
        if window is None:
            if now - change.plan["acked_at_s"] > self.config.window_timeout_s:
                self._roll_back(change, Trip(kind="config", reason=(
                    f"window {index} got too few steps in {self.config.window_timeout_s:g} s")),
                    "timeout")
            return
        windows = (*change.windows, window)
        comparison = compare(windows, self.config.measure, change.continued_ratios)
        spans = self.trace.end(change, "observe", {
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
            self._roll_back(change, verdict, "verdict")
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
                self._roll_back(change, Trip(kind="config", reason=PRUNED), "pruned")
                return True
        return False

    def _guardrail(self, change: Change, version: int) -> Trip | None:
        """The first guardrail that fires. One that raises fails closed: a change it cannot
        vouch for is rolled back (a training job's state too, as nobody checked it)."""
        for guardrail in self.guardrails:
            try:
                trip = guardrail.check(change, version, self.reader)
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
        start_ns, span = self.trace.now_ns(), self.trace.child(change)
        change = self._move(change, "kept", by="controller", reason=(
            f"gain {interval_text(comparison)} at {comparison.confidence:.0%}"),
            version_before=before)
        baseline = self.registry.set_baseline(change.job, change.candidate)
        desired = self.registry.set_desired(change.job, change.candidate, change_id=change.id,
                                            traceparent=span)
        self._event_only(change, "baseline", "controller", "the candidate is the baseline",
                         version_before=before, version_after=desired.version,
                         detail={"baseline_version": baseline.version})
        self.trace.span(change, "keep", traceparent=span, start_ns=start_ns, attributes={
            "seedance.gain": comparison.gain, "seedance.gain.ci_low": comparison.ci_low,
            "seedance.gain.ci_high": comparison.ci_high,
            "seedance.confidence": comparison.confidence,
            "seedance.config.version.before": before,
            "seedance.config.version.after": desired.version})
        self.trace.end_trace(change)

    def _roll_back(self, change: Change, trip: Trip, cause: RollbackCause, *,
                   by: str = "controller") -> Change:
        """Journal the rollback, then send the baseline (and the rollback action, if any);
        ``cause`` is what forced it, for the rollback counter."""
        job, was, opened = change.job, change.state, change
        start_ns, span = self.trace.now_ns(), self.trace.child(change)
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
        self.metrics.rolled_back(job, trip.kind, cause)
        self.trace.end_open(opened, error=f"rolled back: {trip.reason}")
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
        self.trace.span(change, "rollback", traceparent=span, start_ns=start_ns,
                   attributes=attributes)
        if was != "kept":  # a kept change's trace ended at its keep
            self.trace.end_trace(change)
        return change

    def drain(self) -> list[Change]:
        """At shutdown: roll back this controller's changes in flight (the job's lease lapses
        to its baseline when the sidecar is gone, so the candidate is no longer measured), and
        withdraw the ones it approved itself but has not applied (no person stands behind
        them, and the job's next owner proposes from its own search), so none is left active
        for a fleet to find; their trials may be tried again. A person's approval stays: it
        is a decision the next owner carries out."""
        drained = []
        with self._lock:
            for change in self.changes(states=sorted(IN_FLIGHT | {"approved"})):
                if not self._owns(change.job):
                    continue
                try:
                    if change.state == "approved" and change.approved_by == "auto":
                        drained.append(self._move(
                            change, "rejected", by="shutdown", reason=STOPPED,
                            plan={**change.plan, "ended_because": STOPPED}))
                    elif change.state in IN_FLIGHT:
                        drained.append(self._roll_back(
                            change, Trip(kind="config", reason=STOPPED), "stopped",
                            by="shutdown"))
                except Exception:
                    log.exception("drain of change %s failed; recovery rolls it back", change.id)
        return drained

    def recover(self) -> None:
        """After a restart: roll back every change a crash left applying or observing, and
        wait again for the acks of restores not yet confirmed. Explicit, so that opening a
        controller (or only its journal) to read changes undoes nothing."""
        for change in self.changes(states=["rolled_back"]):
            restore = Restore.from_plan(change.plan)
            if restore is not None and not restore.confirmed and self._owns(change.job):
                self._restoring.add(change.id)
        for change in self.changes(states=sorted(IN_FLIGHT)):
            if not self._owns(change.job):
                continue
            try:
                self._roll_back(change, Trip(kind="config", reason=(
                    f"controller restarted with the change in {change.state}")), "recovery",
                    by="recovery")
            except Exception:
                log.exception("recovery of change %s failed", change.id)
