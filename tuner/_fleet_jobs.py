"""The fingerprints in the fleet's job table (``tuner._fleet_tables``): written as jobs attach,
read by the fleet priors of every sidecar sharing the state database.

Other parts of the sidecar own the row's other columns (which sidecar holds the job, since
when): a fingerprint write creates the row if it is missing, with those columns filled from
what the writer knows, and otherwise sets the fingerprint alone.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from collectors import (
    FingerprintError,
    JobFingerprint,
    autocommit_reads,
    release_state_engine,
    shared_state_engine,
)
from tuner._fleet_tables import fleet_metadata, jobs_table

log = logging.getLogger(__name__)


class FleetJobs:
    """Fingerprints of the fleet's jobs in the state database; thread-safe (one engine).
    ``create=False`` opens a database the fleet's tables may not be in yet (a reader: it
    finds no fingerprints until a sidecar wrote one)."""

    def __init__(self, db_url: str, *, create: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self._engine: Engine = shared_state_engine(db_url)
        self._reads = autocommit_reads(self._engine)
        self._clock = clock
        if create:
            fleet_metadata.create_all(self._engine)

    def close(self) -> None:
        release_state_engine(self._engine)

    def record_fingerprint(self, job: str, fingerprint: JobFingerprint, *, kind: str,
                           sidecar_id: str, study: str | None) -> None:
        """Set the job's fingerprint; a new row gets ``sidecar_id``, ``kind``, ``study`` and
        the time now, an existing row keeps them."""
        postgres = self._engine.dialect.name == "postgresql"
        insert = (postgresql.insert if postgres else sqlite.insert)(jobs_table)
        now = self._clock()
        upsert = insert.values(
            job=job, sidecar_id=sidecar_id, kind=kind, study=study,
            fingerprint=json.dumps(fingerprint.to_json(), sort_keys=True),
            attached_at=now, seen_at=now,
        ).on_conflict_do_update(index_elements=[jobs_table.c.job],
                                set_={"fingerprint": insert.excluded.fingerprint})
        with self._engine.begin() as conn:
            conn.execute(upsert)

    def known(self, job: str) -> bool:
        """Whether the table has a row for the job (with a fingerprint or not)."""
        with self._reads.connect() as conn:
            return self._engine.dialect.has_table(conn, jobs_table.name) and conn.execute(
                select(jobs_table.c.job).where(jobs_table.c.job == job)).first() is not None

    def fingerprints(self) -> dict[str, JobFingerprint]:
        """Every job's fingerprint (rows without one, or with one that no longer reads, are
        left out; the latter logged)."""
        with self._reads.connect() as conn:
            if not self._engine.dialect.has_table(conn, jobs_table.name):
                return {}
            rows = conn.execute(select(jobs_table.c.job, jobs_table.c.fingerprint).where(
                jobs_table.c.fingerprint.is_not(None))).all()
        out = {}
        for job, text in rows:
            try:
                out[job] = JobFingerprint.from_json(json.loads(text))
            except (ValueError, FingerprintError) as exc:
                log.warning("fleet job %s: stored fingerprint unreadable (%s); skipped", job, exc)
        return out
