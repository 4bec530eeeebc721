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

import abc
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Connection

from collectors import (
    ConfigError,
    SeedanceError,
    Tracing,
    new_traceparent,
    null_tracing,
    state_engine,
)
from policies import Finding
from policies.detectors import COLLAPSE, NON_FINITE, UNDERFLOW
from tuner._knobs import KnobSpace, KnobValue
from tuner._lease import AttachEvent, JobRegistry, JobStatus
from tuner._measure import (
    Comparison,
    MeasureConfig,
    QueryFn,
    Window,
    compare,
    measure_window,
    nonfinite_loss,
    window_config,
    windows_from_json,
)
from tuner._restore import RESTORE_KEY, Restore, restore_outcome

log = logging.getLogger(__name__)

State = Literal["proposed", "approved", "applying", "observing", "kept", "rolled_back",
                "rejected", "expired", "failed", "manual_intervention_required"]
Source = Literal["trial", "finding", "operator"]
Mode = Literal["auto", "suggest", "off"]
MANUAL: State = "manual_intervention_required"
RollbackKind = Literal["config", "full", "local"]

TRANSITIONS: Mapping[str, frozenset[str]] = {
    "proposed": frozenset({"approved", "rejected", "expired", "failed"}),
    "approved": frozenset({"applying", "rejected", "failed"}),
    "applying": frozenset({"observing", "rolled_back", "failed"}),
    "observing": frozenset({"kept", "rolled_back", "failed"}),
    "kept": frozenset({"rolled_back"}),
    "rolled_back": frozenset({MANUAL}), MANUAL: frozenset({"rolled_back"}),
    "rejected": frozenset(), "expired": frozenset(), "failed": frozenset(),
}
"""Legal transitions; ``kept -> rolled_back`` only by an operator's ``rollback``;
``rolled_back <-> manual_intervention_required`` only as its restore fails or is confirmed."""
ENDED: frozenset[str] = frozenset({"rolled_back", "rejected", "expired", "failed"})
"""The verdicts of a change that was tried or refused (the search learns from them)."""
ACTIVE: frozenset[str] = frozenset({"proposed", "approved", "applying", "observing"})
IN_FLIGHT: frozenset[str] = frozenset({"applying", "observing"})
PRECISION_ORDER = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""Higher index = lower precision; lowering one is a risky change (snapshot first)."""
PRUNED = "pruned by the search"


class RolloutError(SeedanceError):
    """A change cannot be proposed or moved as asked."""


class IllegalTransition(RolloutError):
    """The state machine does not allow this move."""


# ---- storage ------------------------------------------------------------------------------

_metadata = MetaData()
changes_table = Table(
    "changes", _metadata,
    Column("id", String(64), primary_key=True),
    Column("job", String(256), nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at_ns", BigInteger, nullable=False),
    Column("updated_at_ns", BigInteger, nullable=False),
    Column("body", Text, nullable=False),
    Index("changes_by_job", "job", "created_at_ns"),
    Index("changes_by_state", "state"),
)
change_events_table = Table(
    "change_events", _metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("change_id", String(64), nullable=True),
    Column("job", String(256), nullable=False),
    Column("at_ns", BigInteger, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("from_state", String(16), nullable=True),
    Column("to_state", String(16), nullable=True),
    Column("actor", String(256), nullable=False),
    Column("reason", Text, nullable=False),
    Column("version_before", BigInteger, nullable=True),
    Column("version_after", BigInteger, nullable=True),
    Column("detail", Text, nullable=False),
    Index("change_events_by_change", "change_id", "seq"),
    Index("change_events_by_job", "job", "at_ns"),
)
modes_table = Table(
    "approval_modes", _metadata,
    Column("job", String(256), primary_key=True),
    Column("mode", String(16), nullable=False),
)


# ---- values ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Change:
    """Config A -> B for one job; ``values`` are the knobs it sets, ``baseline`` what it left.

    ``plan`` is the observation's progress (window arms, index, version in force, acked);
    ``windows`` what each window measured; ``comparison`` the verdict's numbers.
    ``traceparent`` is the W3C context of the change's root span; ``spans`` the spans open
    across ticks (``apply``, ``observe``): name -> traceparent, start_ns and attributes.
    """

    id: str
    job: str
    state: State
    source: Source
    reason: str
    risk: str
    scope: str
    values: Mapping[str, KnobValue]
    baseline: Mapping[str, KnobValue]
    created_at_s: float
    expires_at_s: float
    approved_by: str | None = None
    traceparent: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)
    spans: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    plan: Mapping[str, Any] = field(default_factory=dict)
    windows: tuple[Window, ...] = ()
    comparison: Mapping[str, Any] | None = None

    @property
    def candidate(self) -> dict[str, KnobValue]:
        return {**self.baseline, **self.values}

    def arm_of(self, version: int) -> str | None:
        """Which arm config ``version`` ran as in this change (None: not one of its windows)."""
        if self.plan.get("version") == version:
            return str(self.plan["arms"][int(self.plan["index"])])
        return next((w.arm for w in self.windows if w.version == version), None)

    def to_json(self) -> str:
        body = {k: v for k, v in self.__dict__.items() if k != "windows"}
        body["windows"] = [w.to_json() for w in self.windows]
        return json.dumps(body, sort_keys=True, default=dict)

    @classmethod
    def from_json(cls, text: str) -> Change:
        body = json.loads(text)
        body["windows"] = tuple(windows_from_json(body.get("windows", ())))
        return cls(**body)


@dataclass(frozen=True, kw_only=True)
class Trip:
    """A guardrail fired: roll back now, of this kind (``group`` for a local rollback)."""

    kind: RollbackKind
    reason: str
    group: str | None = None
    job_failed: bool = False
    """The job itself reported the config failing (it raised there): never to be tried again."""
    inconclusive: bool = False
    """The test ran out of pairs or time without an answer: the config may still pay."""


class Guardrail(abc.ABC):
    """A condition that forces an immediate rollback of the change in flight.

    ``check`` is called from ``tick()`` (one thread) with the version in force; it must not
    block for long and returns None when all is well.
    """

    @abc.abstractmethod
    def check(self, change: Change, version: int, query: QueryFn) -> Trip | None: ...


class NonFiniteLoss(Guardrail):
    """NaN or infinite loss under the change's current version: FULL rollback."""

    def check(self, change: Change, version: int, query: QueryFn) -> Trip | None:
        if nonfinite_loss(query, change.job, version):
            return Trip(kind="full", reason=f"non-finite loss under config v{version}")
        return None


class GradientCollapseFindings(Guardrail):
    """A gradient-collapse, underflow or non-finite finding on the job, opened since the change
    began: LOCAL rollback of the finding's ``module_group`` (FULL when it names none, and always
    for non-finite gradients: the optimizer may have stepped on them everywhere)."""

    def __init__(self, active_findings: Callable[[], Sequence[Finding]], *,
                 detectors: Sequence[str] = (COLLAPSE, UNDERFLOW, NON_FINITE)) -> None:
        self._active = active_findings
        self.detectors = frozenset(detectors)

    def check(self, change: Change, version: int, query: QueryFn) -> Trip | None:
        since_ns = int(change.plan.get("applied_at_s", change.created_at_s) * 1e9)
        for f in self._active():
            if (f.job == change.job and f.detector in self.detectors
                    and (f.opened_at_ns or 0) >= since_ns):
                group = None if f.detector == NON_FINITE else f.resource.get("module_group")
                return Trip(kind="local" if group else "full", group=group,
                            reason=f"{f.detector} finding {f.id}: {f.evidence.summary}")
        return None


class ChangeObserver(Protocol):
    """Who wants to hear about a change's windows and end (the search driver)."""

    def on_window(self, change: Change, comparison: Comparison) -> bool:
        """Called after each candidate window; True stops the change (rolled back, pruned)."""
        ...

    def on_finished(self, change: Change) -> None:
        """Called once the change reached a final state."""
        ...


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Timings and sizes of a rollout; ``auto_bounds`` are the operator's per-knob limits for
    auto-approval: a tuple (low, high) for numbers or a set of allowed values. A knob with no
    entry may auto-approve anywhere in its domain.

    A trial is a sequential test: pairs of windows are added until the confidence sequence
    decides (kept from ``min_pairs`` on when it excludes zero from above; rolled back from
    ``early_stop_pairs`` on when it excludes zero from below, and from ``min_pairs`` on when
    its upper end is below ``min_gain``, a gain not worth having), or until ``max_pairs`` or
    ``trial_budget_s`` of job time since the candidate was acked (then rolled back: no
    measured gain). A trial whose gain so far is at least ``min_gain`` is promising: it is
    measured on past its budget, up to ``promising_budget_s`` (twice the budget when None),
    since starting it over later would throw its pairs away; the confidence sequence stays
    valid however long the trial runs. A serving candidate whose token agreement over all its windows is below
    ``measure.min_token_agreement`` is rolled back from ``min_pairs`` on, so it is never
    kept. Whatever the test says, two candidate windows that ran below
    ``max_slowdown`` of their baselines' tokens/s end the trial at once: it harms the job (one
    such window may be a neighbour's burst on a shared box)."""

    min_pairs: int = 3
    max_pairs: int = 24
    trial_budget_s: float = 90.0
    promising_budget_s: float | None = None
    min_gain: float = 0.03
    max_slowdown: float = 0.4
    proposal_ttl_s: float = 3600.0
    ack_timeout_s: float = 60.0
    restore_attempts: int = 3
    """Times a rollback's baseline is sent before the change needs a person."""
    window_timeout_s: float = 600.0
    early_stop_pairs: int = 2
    default_mode: Mode = "suggest"
    auto_bounds: Mapping[str, Any] = field(default_factory=dict)
    measure: MeasureConfig = field(default_factory=MeasureConfig)

    @property
    def promising_horizon_s(self) -> float:
        """How long a promising trial may run (``promising_budget_s``, by default twice the
        budget)."""
        return (2 * self.trial_budget_s if self.promising_budget_s is None
                else self.promising_budget_s)

    def __post_init__(self) -> None:
        if not 1 <= self.min_pairs <= self.max_pairs:
            raise ConfigError(f"RolloutConfig.min_pairs must be >= 1 and <= max_pairs, got "
                             f"{self.min_pairs} and {self.max_pairs}")
        if self.restore_attempts < 1:
            raise ConfigError(f"RolloutConfig.restore_attempts must be >= 1, "
                             f"got {self.restore_attempts}")
        if self.early_stop_pairs < 1:
            raise ConfigError(f"RolloutConfig.early_stop_pairs must be >= 1, "
                             f"got {self.early_stop_pairs}")
        if not 0 <= self.max_slowdown < 1:
            raise ConfigError(f"RolloutConfig.max_slowdown must be in [0, 1), "
                             f"got {self.max_slowdown}")
        if self.promising_budget_s is not None and \
                not self.promising_budget_s >= self.trial_budget_s:
            raise ConfigError(f"RolloutConfig.promising_budget_s must be >= trial_budget_s, "
                              f"got {self.promising_budget_s} and {self.trial_budget_s}")
        if self.min_gain < 0:
            raise ConfigError(f"RolloutConfig.min_gain must be >= 0, got {self.min_gain}")
        for name in ("proposal_ttl_s", "ack_timeout_s", "window_timeout_s", "trial_budget_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"RolloutConfig.{name} must be > 0")
        if self.default_mode not in ("auto", "suggest", "off"):
            raise ConfigError(f"RolloutConfig.default_mode must be auto|suggest|off, "
                             f"got {self.default_mode!r}")


def precision_lowered(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Precision knobs (``precision`` or ``precision.<group>``) whose value gets lower."""
    def rank(v: Any) -> int:
        return PRECISION_ORDER.index(v) if v in PRECISION_ORDER else -1
    return sorted(k for k, v in after.items()
                  if (k == "precision" or k.startswith("precision."))
                  and rank(v) > rank(before.get(k)))


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
        _metadata.create_all(self._engine)
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
                                       f"gain {_interval_text(comparison)}", version))
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


def decide(comparison: Comparison, config: RolloutConfig, elapsed_s: float
           ) -> Literal["keep"] | Trip | None:
    """The sequential test's verdict after a pair (``RolloutConfig``): keep, a rollback (the
    trip says why) or None (measure another pair). ``elapsed_s``: job time since the
    candidate was first acked. Pure, so a bench replays recorded windows through exactly the
    controller's rule."""
    pairs = comparison.pairs
    # loss from min_pairs on: one short window's loss is noisy, and a guardrail that knows the
    # cause (an underflow finding on one group: a local rollback) gets the time to speak first
    if pairs >= config.min_pairs and not comparison.loss_ok:
        return Trip(kind="config", reason=(
            f"loss {comparison.loss_excess:+.2%} above the baseline's trajectory"))
    if not comparison.latency_ok:
        return Trip(kind="config", reason=(
            f"p99 latency {comparison.latency_excess:+.2%} above the baseline's"))
    if pairs >= config.min_pairs and not comparison.quality_ok:
        return Trip(kind="config", reason=(
            f"token agreement {comparison.quality:.4f} over the candidate's "
            f"{comparison.quality_tokens} checked tokens is below the bound "
            f"{config.measure.min_token_agreement:.4f}"))
    slow = sorted(r for r in comparison.pair_ratios if r < config.max_slowdown)
    if len(slow) >= 2:
        return Trip(kind="config", reason=(
            f"harms the job: {len(slow)} candidate windows ran at {slow[-1]:.0%} or less of "
            f"their baselines' tokens/s (bound {config.max_slowdown:.0%})"))
    if pairs >= config.early_stop_pairs and comparison.regresses:
        return Trip(kind="config", reason=f"measured regression {_interval_text(comparison)}")
    if comparison.improves:
        return "keep" if pairs >= config.min_pairs else None
    if pairs >= config.min_pairs and comparison.ci_high < config.min_gain:
        return Trip(kind="config", reason=(
            f"no gain worth having (below {config.min_gain:+.0%}): gain "
            f"{_interval_text(comparison)}"))
    promising = comparison.gain >= config.min_gain and elapsed_s < config.promising_horizon_s
    if pairs >= config.max_pairs or (elapsed_s >= config.trial_budget_s and not promising):
        spent = (f"{pairs} pairs" if pairs >= config.max_pairs
                 else f"the trial's {elapsed_s:.0f} s")
        return Trip(kind="config", inconclusive=True, reason=(
            f"no measured gain in {spent}: gain {_interval_text(comparison)}"))
    return None


def _interval_text(comparison: Comparison) -> str:
    return (f"{comparison.gain:+.2%} [{comparison.ci_low:+.2%}, {comparison.ci_high:+.2%}] "
            f"after {comparison.pairs} pair(s)")


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
