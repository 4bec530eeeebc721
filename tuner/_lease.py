"""The sidecar side of the knob lease (docs/lease-protocol.md): who is attached, what they run.

`JobRegistry` is the one place that knows, per job, its knob space, its baseline and desired
configs, the session holding the lease and the acks it sent. The rollout controller drives it
(`set_desired`, `push_action`, `wait_ack`, `on_lapse`); the HTTP router (`lease_router`,
`tuner._lease_http`) serves the job's client. No torch here: the sidecar imports this. One
`threading.Condition` guards its state; nothing is persisted (jobs re-attach after a restart).

docs/lease-protocol.md, 'Inside the sidecar: the registry' explains threads, versions and restarts.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from collectors import JobFingerprint
from tuner._knobs import Config, Knob, KnobError, KnobSpace, KnobValue
from tuner._lease_messages import (
    Ack,
    AckStatus,
    AttachEvent,
    AttachOutcome,
    InvalidRequestError,
    JobKind,
    JobState,
    JobStatus,
    Lease,
    LeaseError,
    SessionError,
    UnknownJobError,
    validate_action,
)
from tuner._versions import VersionLedger

log = logging.getLogger(__name__)

MAX_ACKS_KEPT = 1000

LapseCallback = Callable[[JobStatus], None]
ClaimCallback = Callable[[str, JobKind], None]
"""(job, kind) before an attach starts a session; what it raises refuses the attach."""


@dataclass(kw_only=True)
class _Job:
    name: str
    kind: JobKind
    world_size: int
    space: KnobSpace
    baseline: Config
    desired: Config
    session: str
    ttl_s: float
    expires_at: float
    state: JobState = "attached"
    change_id: str | None = None
    traceparent: str | None = None
    actions: list[dict[str, Any]] = field(default_factory=list)
    last_version: int = 0
    fingerprint: JobFingerprint | None = None
    acks: collections.deque[Ack] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_ACKS_KEPT))


class JobRegistry:
    """Thread-safe registry of attached jobs and their leases; see the module docstring.

    `lease_ttl_s` is the default TTL; a job may ask for its own at attach. Lapses are found by
    `reap()`, which the thread started by `start()` calls every quarter of the shortest TTL;
    `clock` (monotonic seconds) is injectable so tests can move time. With a `ledger`, every
    version is recorded before anyone sees it and a job's first attach continues above the
    highest one ever issued to it, so versions stay unique across restarts.
    """

    def __init__(self, *, lease_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 ledger: VersionLedger | None = None) -> None:
        if not lease_ttl_s > 0:
            raise LeaseError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._ledger = ledger
        self._jobs: dict[str, _Job] = {}
        self._cond = threading.Condition()
        self._on_lapse: list[LapseCallback] = []
        self._on_attach: list[Callable[[AttachEvent], None]] = []
        self._claims: list[ClaimCallback] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def keep_versions_in(self, ledger: VersionLedger) -> None:
        """Record versions in ``ledger`` from now on (before the first attach)."""
        with self._cond:
            self._ledger = ledger

    def _issued(self, job: str) -> int:
        return self._ledger.last(job) if self._ledger is not None else 0

    def _next_version(self, record: _Job) -> int:
        """The job's next version, recorded in the ledger before it is used."""
        version = record.last_version + 1
        if self._ledger is not None:
            self._ledger.issued(record.name, version)
        record.last_version = version
        return version

    # ---- the job's side (the HTTP router calls these) ---------------------------------------

    def attach(self, job: str, *, rank: int = 0, world_size: int = 1, kind: JobKind = "train",
               knobs: Iterable[Knob], baseline: Mapping[str, Any],
               lease_ttl_s: float | None = None, version: int = 0,
               fingerprint: JobFingerprint | None = None) -> tuple[str, Config]:
        """Start a new session for `job` (replacing any earlier one) and return it with the
        config the job should run.

        `knobs` are all the job's knobs (the client declares the built-ins too: their domains
        depend on the job, e.g. its thread count). `baseline` is the job's proposal, taken only
        at a job's first attach: a known job keeps the registry's baseline and desired config
        when they fit the declared knobs, else the stored values wherever still valid (a new
        baseline is a change, approved and audited, never an attach).
        `version` is the config version the job runs now; new versions go above it. Only rank 0
        holds a lease (SessionError otherwise). `fingerprint`: what kind of job it is (kept
        until an attach sends another).
        """
        if rank != 0:
            raise SessionError(f"only rank 0 holds the lease of job {job!r}, not rank {rank}")
        if kind not in ("train", "serve"):
            raise InvalidRequestError(f"kind must be 'train' or 'serve', got {kind!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidRequestError(f"world_size must be an int >= 1, got {world_size!r}")
        ttl_s = self.lease_ttl_s if lease_ttl_s is None else float(lease_ttl_s)
        if not ttl_s > 0:
            raise InvalidRequestError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        space = KnobSpace.of(knobs)
        proposed = space.validate(baseline)
        with self._cond:
            claims = list(self._claims)
        for claim in claims:  # outside the lock: a claim may wait on the state database
            claim(job, kind)
        session = secrets.token_hex(8)
        with self._cond:
            now = self._clock()
            record = self._jobs.get(job)
            if record is None:
                record = _Job(name=job, kind=kind, world_size=world_size, space=space,
                              baseline=Config(0, proposed), desired=Config(0, proposed),
                              session=session, ttl_s=ttl_s, expires_at=now + ttl_s,
                              last_version=max(0, int(version), self._issued(job)))
                record.baseline = record.desired = Config(self._next_version(record), proposed)
                self._jobs[job] = record
                event = AttachEvent(job=job, session=session, outcome="new",
                                    baseline_version=record.baseline.version)
            else:
                record.last_version = max(record.last_version, int(version))
                outcome: AttachOutcome = "resumed"
                if not (_fits(space, record.baseline) and _fits(space, record.desired)):
                    # the job declares other knobs (a new version of it): what it ran under
                    # the stored baseline stays wherever still valid; only new knobs take
                    # the job's values. A job never replaces its baseline by attaching.
                    merged = _merge(space, record.baseline.values, proposed)
                    record.baseline = record.desired = Config(self._next_version(record), merged)
                    record.change_id = record.traceparent = None
                    record.actions.clear()
                    outcome = "merged"
                ignored = sorted(k for k, v in proposed.items()
                                 if record.baseline.values.get(k) != v)
                event = AttachEvent(job=job, session=session, outcome=outcome,
                                    baseline_version=record.baseline.version,
                                    ignored=tuple(ignored))
                record.kind, record.world_size, record.space = kind, world_size, space
                record.session, record.ttl_s = session, ttl_s
                record.expires_at, record.state = now + ttl_s, "attached"
            record.fingerprint = fingerprint or record.fingerprint
            self._cond.notify_all()
            callbacks, desired = list(self._on_attach), record.desired
            log.info("job %s attached (session %s, world size %d, %d knobs, config v%d)",
                     job, session, world_size, len(space.knobs), desired.version)
        for callback in callbacks:
            try:
                callback(event)
            except Exception:
                log.exception("attach callback failed for job %s", job)
        return session, desired

    def lease(self, job: str, session: str, known_version: int, wait_s: float) -> Lease:
        """Renew the lease and return the desired config: at once when its version differs
        from `known_version`, else when it changes or after `wait_s` (capped at half the TTL,
        so the next call renews in time)."""
        with self._cond:
            record = self._session(job, session)
            record.expires_at = self._clock() + record.ttl_s
            deadline = time.monotonic() + max(0.0, min(float(wait_s), record.ttl_s / 2))
            while (record.desired.version == known_version and record.session == session
                   and record.state == "attached"):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._session(job, session)
            return Lease(config=record.desired, baseline=record.baseline,
                         change_id=record.change_id, traceparent=record.traceparent,
                         lease_ttl_s=record.ttl_s, actions=tuple(record.actions))

    def ack(self, job: str, session: str, *, version: int, step: int, status: AckStatus,
            error: str | None = None, actions: Iterable[Mapping[str, Any]] = ()) -> Ack:
        """Record an ack (renews the lease). Pending actions up to an applied version are done."""
        if status not in ("applied", "failed"):
            raise InvalidRequestError(f"status must be 'applied' or 'failed', got {status!r}")
        with self._cond:
            record = self._session(job, session)
            if not 0 < version <= record.last_version:
                raise InvalidRequestError(f"version {version} was never issued to job {job!r} "
                                          f"(last {record.last_version})")
            record.expires_at = self._clock() + record.ttl_s
            ack = Ack(job=job, session=session, version=int(version), step=int(step),
                      status=status, error=error, actions=tuple(dict(a) for a in actions),
                      time_s=time.time())
            record.acks.append(ack)
            if version >= record.desired.version:
                record.actions.clear()
            self._cond.notify_all()
            return ack

    # ---- the rollout controller's side ------------------------------------------------------

    def set_desired(self, job: str, values: Mapping[str, Any], *, change_id: str | None = None,
                    traceparent: str | None = None) -> Config:
        """Ask the job to run `values` (knobs not named keep their baseline value) under a NEW
        version; raises KnobError for values outside the knob space."""
        with self._cond:
            record = self._record(job)
            checked = record.space.validate(values, partial=True)
            record.desired = Config(self._next_version(record), {**record.baseline.values, **checked})
            record.change_id, record.traceparent = change_id, traceparent
            self._cond.notify_all()
            return record.desired

    def set_baseline(self, job: str, values: Mapping[str, Any]) -> Config:
        """Make `values` (a full assignment; missing knobs take their defaults) the config the
        job falls back to when its lease lapses. The desired config is left alone."""
        with self._cond:
            record = self._record(job)
            record.baseline = Config(self._next_version(record), record.space.validate(values))
            self._cond.notify_all()
            return record.baseline

    def push_action(self, job: str, action: Mapping[str, Any]) -> Config:
        """Queue a one-shot action (snapshot / rollback) for the next step boundary.

        The desired config gets a new version carrying the same values, so the job sees the
        change and acks it; actions run before the config's values are applied and stay
        pending until a version at or above it is acked.
        """
        checked = validate_action(action)
        with self._cond:
            record = self._record(job)
            record.actions.append(checked)
            record.desired = Config(self._next_version(record), record.desired.values)
            self._cond.notify_all()
            return record.desired

    def wait_ack(self, job: str, version: int, timeout_s: float) -> Ack | None:
        """The first ack of `version` or a later one (a job applies only the newest config it
        has, so it may skip one); None after `timeout_s`. Check `ack.version` and `status`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                record = self._record(job)
                found = next((a for a in record.acks if a.version >= version), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                self._cond.wait(left)

    def acks(self, job: str) -> list[Ack]:
        """The job's acks, oldest first (the last MAX_ACKS_KEPT)."""
        with self._cond:
            return list(self._record(job).acks)

    def jobs(self) -> list[JobStatus]:
        """Every job the registry knows, attached or lapsed."""
        with self._cond:
            return [self._status(r) for r in self._jobs.values()]

    def status(self, job: str) -> JobStatus:
        """The job as the registry sees it now; UnknownJobError if it never attached."""
        with self._cond:
            return self._status(self._record(job))

    def on_attach(self, callback: Callable[[AttachEvent], None]) -> None:
        """Call ``callback(event)`` after each attach (from the caller's thread; exceptions
        are logged), for the audit log."""
        with self._cond:
            self._on_attach.append(callback)

    def claim_with(self, claim: ClaimCallback) -> None:
        """Call ``claim(job, kind)`` before each attach starts a session (from the caller's
        thread); a `LeaseError` it raises refuses the attach and leaves the registry as it was.
        The fleet's ownership of a job is such a claim (``tuner._fleet``)."""
        with self._cond:
            self._claims.append(claim)

    def on_lapse(self, callback: LapseCallback) -> None:
        """Call `callback(status)` once each time a job's lease lapses (from the reaper thread;
        exceptions are logged). By then the registry has reset the desired config to the
        baseline and dropped pending actions, as the job itself does."""
        with self._cond:
            self._on_lapse.append(callback)

    # ---- lapse detection ---------------------------------------------------------------------

    def reap(self) -> list[str]:
        """Mark every job whose lease expired as lapsed; return their names."""
        lapsed: list[JobStatus] = []
        with self._cond:
            now = self._clock()
            for record in self._jobs.values():
                if record.state == "attached" and now >= record.expires_at:
                    record.state = "lapsed"
                    record.desired = Config(self._next_version(record), record.baseline.values)
                    record.change_id = record.traceparent = None
                    record.actions.clear()
                    lapsed.append(self._status(record))
            if lapsed:
                self._cond.notify_all()
            callbacks = list(self._on_lapse)
        for status in lapsed:
            log.warning("job %s: lease lapsed (no call for %.1f s); desired config is the "
                        "baseline again", status.job, status.lease_ttl_s)
            for callback in callbacks:
                try:
                    callback(status)
                except Exception:
                    log.exception("lapse callback %r failed for job %s", callback, status.job)
        return [s.job for s in lapsed]

    def start(self) -> None:
        """Start the reaper thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._reap_loop, name="lease-reaper",
                                            daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the reaper thread (idempotent)."""
        with self._cond:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout_s)

    def _reap_loop(self) -> None:
        while True:
            with self._cond:
                ttls = [r.ttl_s for r in self._jobs.values()] or [self.lease_ttl_s]
            if self._stop.wait(min(ttls) / 4):
                return
            try:
                self.reap()
            except Exception:
                log.exception("lease reaper failed; going on")

    # ---- helpers (call with the lock held) ----------------------------------------------------

    def _record(self, job: str) -> _Job:
        record = self._jobs.get(job)
        if record is None:
            raise UnknownJobError(f"job {job!r} is not attached; attach first")
        return record

    def _session(self, job: str, session: str) -> _Job:
        record = self._record(job)
        if record.session != session:
            raise SessionError(f"session {session!r} of job {job!r} was replaced; re-attach")
        if record.state == "lapsed":
            raise SessionError(f"the lease of job {job!r} lapsed; re-attach")
        return record

    def _status(self, record: _Job) -> JobStatus:
        applied = [a for a in record.acks if a.status == "applied"]
        return JobStatus(
            job=record.name, kind=record.kind, world_size=record.world_size, state=record.state,
            session=record.session, lease_ttl_s=record.ttl_s,
            expires_in_s=record.expires_at - self._clock(), knobs=record.space,
            baseline=record.baseline, desired=record.desired, change_id=record.change_id,
            acked_version=applied[-1].version if applied else None,
            last_step=record.acks[-1].step if record.acks else None,
            fingerprint=record.fingerprint)


def _merge(space: KnobSpace, stored: Mapping[str, KnobValue],
           proposed: Mapping[str, KnobValue]) -> dict[str, KnobValue]:
    """Each declared knob at its stored value where that is still valid, else the job's."""
    out = {}
    for name, knob in space.knobs.items():
        try:
            out[name] = knob.validate(stored[name]) if name in stored else proposed[name]
        except KnobError:
            out[name] = proposed[name]
    return out


def _fits(space: KnobSpace, config: Config) -> bool:
    try:
        return (set(config.values) == set(space.knobs)
                and space.validate(config.values) == dict(config.values))
    except KnobError:
        return False


__all__ = ["ClaimCallback", "JobRegistry", "LapseCallback"]
