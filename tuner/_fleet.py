"""One sidecar's membership of the fleet: its row in ``fleet_sidecars`` with the URL the others
reach its API at, a heartbeat, and the claim of each job that attaches to it (``fleet_jobs``).

A job is tuned by one sidecar at a time. Its attach claims its row, and the claim succeeds only
when the row is free, already this sidecar's, held by an earlier process of this sidecar (same
host and URL: two live processes cannot listen on one address), or held by a sidecar whose
heartbeat is stale; otherwise the attach is refused (``JobClaimedError``, HTTP 409) naming the
owner. The claim is ONE conditional upsert (``INSERT ... ON CONFLICT DO UPDATE ... WHERE``), so
it is atomic on SQLite (writes are serialised) and on PostgreSQL, where the conflicting row is
locked and the WHERE is evaluated on its newest version, as ``SELECT ... FOR UPDATE`` would:
of two sidecars claiming one job at once, the second sees the first's claim and is refused.

``owns(job)`` answers from what the last heartbeat read, without a query, so the rollout
controller can ask it on every tick: a sidecar drives only the changes of jobs it owns.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import and_, delete, insert, not_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from collectors import state_engine
from tuner._fleet_directory import DEFAULT_HEARTBEAT_S, config_json, stale_after_s
from tuner._fleet_tables import fleet_metadata, jobs_table, sidecars_table
from tuner._lease import JobRegistry
from tuner._lease_messages import AttachEvent, JobClaimedError, JobKind, JobStatus

log = logging.getLogger(__name__)

StudyOf = Callable[[str], str | None]
"""job -> the name of the Optuna study that tunes it here (None: not tuned)."""


class FleetMember:
    """This sidecar in the fleet; see the module docstring.

    Thread-safe. ``start()`` registers the sidecar, claims through ``registry`` from then on and
    starts the heartbeat thread; ``shutdown()`` stops it and marks the sidecar gone, so its
    jobs may be claimed at once. Both are idempotent. A heartbeat that cannot write is logged
    and tried again next period (the jobs run on; others see this sidecar go stale).
    """

    def __init__(self, db_url: str, registry: JobRegistry, *, url: str,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, study_of: StudyOf = lambda job: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.host, self.pid, self.url = socket.gethostname(), os.getpid(), url
        self.sidecar_id = f"{self.host}-{self.pid}-{secrets.token_hex(3)}"
        """Stable for the process: a restarted sidecar is a new member (its earlier processes'
        jobs are its own again, see ``owns``)."""
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s(heartbeat_s)
        self._registry = registry
        self._study_of = study_of
        self._clock = clock
        self._engine: Engine = state_engine(db_url)
        self._lock = threading.Lock()
        self._owners: dict[str, str] = {}
        self._earlier: frozenset[str] = frozenset()
        self._lost: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hooked = False
        self.wrote_at: float | None = None
        """``time.monotonic()`` of the last heartbeat that committed: the state DB writes."""
        self.write_error: tuple[float, str] | None = None
        """(``time.monotonic()``, reason) of the last heartbeat, if it failed."""
        self._failing_since: float | None = None  # monotonic time of the first failed beat

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Register, then claim every attach and beat every ``heartbeat_s`` (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            fleet_metadata.create_all(self._engine)
            self._register()
            if not self._hooked:
                self._registry.claim_with(self.claim)
                self._registry.on_attach(self._attached)
                self._hooked = True
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="fleet-heartbeat",
                                            daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the heartbeat and mark this sidecar gone (idempotent)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        try:
            with self._engine.begin() as conn:
                conn.execute(update(sidecars_table).where(
                    sidecars_table.c.sidecar_id == self.sidecar_id).values(heartbeat_at=0.0))
        except Exception as exc:  # the state DB is down: the heartbeat goes stale by itself
            log.warning("fleet: could not mark sidecar %s gone: %s", self.sidecar_id, exc)
        self._engine.dispose()

    # ---- claims and ownership ----------------------------------------------------------------

    def claim(self, job: str, kind: JobKind) -> None:
        """Take ``job`` for this sidecar, or raise `JobClaimedError` naming its live owner."""
        now = self._clock()
        jobs, sidecars = jobs_table, sidecars_table
        live_others = select(sidecars.c.sidecar_id).where(
            sidecars.c.heartbeat_at >= now - self.stale_after_s,
            sidecars.c.sidecar_id != self.sidecar_id,
            not_(and_(sidecars.c.host == self.host, sidecars.c.url == self.url)))
        values = {"sidecar_id": self.sidecar_id, "kind": kind, "study": self._study_of(job),
                  "attached_at": now, "seen_at": now}
        row = self._insert().values(job=job, **values)
        upsert = row.on_conflict_do_update(  # the fingerprint is another part's: left alone
            index_elements=[jobs.c.job], set_=values,
            where=jobs.c.sidecar_id.not_in(live_others)).returning(jobs.c.sidecar_id)
        with self._engine.begin() as conn:
            if conn.execute(upsert).first() is not None:  # a row back: inserted or taken over
                with self._lock:
                    self._owners[job] = self.sidecar_id
                    self._lost.discard(job)
                return
            owner = conn.execute(
                select(jobs.c.sidecar_id, sidecars.c.url, sidecars.c.heartbeat_at)
                .select_from(jobs.join(sidecars, jobs.c.sidecar_id == sidecars.c.sidecar_id))
                .where(jobs.c.job == job)).one()
        with self._lock:
            self._owners[job] = owner.sidecar_id
        raise JobClaimedError(
            f"job {job!r} is attached to sidecar {owner.sidecar_id} at {owner.url} (heartbeat "
            f"{max(0.0, now - owner.heartbeat_at):.1f} s ago): stop it there, or this sidecar "
            f"takes the job once that heartbeat is {self.stale_after_s:g} s old")

    def owns(self, job: str) -> bool:
        """Whether this sidecar drives ``job``'s changes: it (or an earlier process of it)
        holds the job, or no sidecar of the fleet does; as of the last heartbeat."""
        with self._lock:
            owner = self._owners.get(job)
            return owner is None or owner == self.sidecar_id or owner in self._earlier

    # ---- heartbeat ---------------------------------------------------------------------------

    def beat(self) -> None:
        """One heartbeat: this sidecar's row, the seen time and kept config of the jobs it
        holds, and the owners of every job read back for ``owns``."""
        attached = [s for s in self._registry.jobs() if s.state == "attached"]
        with self._engine.begin() as conn:
            beat = update(sidecars_table).where(
                sidecars_table.c.sidecar_id == self.sidecar_id).values(
                heartbeat_at=self._clock())
            if conn.execute(beat).rowcount == 0:  # someone removed the row: come back
                conn.execute(insert(sidecars_table).values(**self._row()))
            self._touch(conn, attached)
            owners = dict(conn.execute(select(jobs_table.c.job, jobs_table.c.sidecar_id))
                          .tuples().all())
        lost = sorted(s.job for s in attached if owners.get(s.job) not in (
            self.sidecar_id, *self._earlier, None))
        with self._lock:
            self._owners = owners
            newly = [job for job in lost if job not in self._lost]
            self._lost = set(lost)
        for job in newly:
            log.warning("fleet: job %s is attached here but sidecar %s claimed it (this "
                        "sidecar's heartbeat was stale); it no longer drives the job's changes",
                        job, owners[job])

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._beat_once()

    def _beat_once(self) -> None:
        """One heartbeat; a failure is recorded for readiness, and the first success after
        failures says in the log how long the state DB was out of reach."""
        try:
            self.beat()
        except Exception as exc:  # a loop never dies: the next period tries again
            reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            now = time.monotonic()
            self.write_error = (now, reason)
            if self._failing_since is None:
                self._failing_since = now
            log.warning("fleet heartbeat of sidecar %s failed: %s", self.sidecar_id, reason)
        else:
            self.wrote_at, self.write_error = time.monotonic(), None
            if self._failing_since is not None:
                log.warning("fleet heartbeat of sidecar %s written again, after %.0f s of failed "
                            "heartbeats", self.sidecar_id,
                            self.wrote_at - self._failing_since)
                self._failing_since = None

    def _attached(self, event: AttachEvent) -> None:
        """Right after an attach: the job's kept config, so the fleet view need not wait for
        the next heartbeat."""
        with self._engine.begin() as conn:
            self._touch(conn, [self._registry.status(event.job)])

    def _touch(self, conn: Connection, held: Iterable[JobStatus]) -> None:
        now = self._clock()
        for status in held:
            conn.execute(update(jobs_table).where(
                jobs_table.c.job == status.job, jobs_table.c.sidecar_id == self.sidecar_id)
                .values(seen_at=now, baseline=config_json(status.baseline)))

    # ---- internals ---------------------------------------------------------------------------

    def _register(self) -> None:
        """This process's row; earlier processes of this sidecar (same host and URL) are
        remembered as this one, and their rows dropped once they own no job."""
        sidecars = sidecars_table
        same = and_(sidecars.c.host == self.host, sidecars.c.url == self.url)
        with self._engine.begin() as conn:
            earlier = conn.execute(select(sidecars.c.sidecar_id).where(same)).scalars().all()
            conn.execute(delete(sidecars).where(
                same, sidecars.c.sidecar_id.not_in(select(jobs_table.c.sidecar_id))))
            conn.execute(insert(sidecars).values(**self._row()))
            owners = dict(conn.execute(select(jobs_table.c.job, jobs_table.c.sidecar_id))
                          .tuples().all())
        self._earlier, self._owners = frozenset(earlier), owners
        log.info("fleet: sidecar %s registered at %s", self.sidecar_id, self.url)

    def _row(self) -> dict[str, Any]:
        now = self._clock()
        return {"sidecar_id": self.sidecar_id, "url": self.url, "host": self.host,
                "pid": self.pid, "started_at": now, "heartbeat_at": now}

    def _insert(self) -> Any:
        """The dialect's INSERT, which knows ON CONFLICT (SQLite and PostgreSQL alike)."""
        dialect = postgresql if self._engine.dialect.name == "postgresql" else sqlite
        return dialect.insert(jobs_table)


__all__ = ["FleetMember", "StudyOf"]
