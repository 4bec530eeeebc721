"""The highest config version issued to each job, kept in the state database.

The lease protocol says a version names one apply and never repeats within a job. The registry
lives in memory, so after a sidecar restart it learns the job's versions again from the job's
re-attach; but a version issued just before a crash (desired, never acked) is one the job never
reports, and the counter would hand that number out again for another config. The ledger is
written before a version is handed to anyone, so a restarted sidecar continues above it.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, MetaData, String, Table, func, select
from sqlalchemy.dialects import postgresql, sqlite

from collectors import autocommit_reads, release_state_engine, shared_state_engine

_metadata = MetaData()
versions_table = Table(
    "config_versions", _metadata,
    Column("job", String(256), primary_key=True),
    Column("last_version", BigInteger, nullable=False),
)


class VersionLedger:
    """Per job, the highest version issued; ``issued`` only ever raises it."""

    def __init__(self, db_url: str) -> None:
        self._engine = shared_state_engine(db_url)
        self._reads = autocommit_reads(self._engine)
        _metadata.create_all(self._engine)

    def last(self, job: str) -> int:
        with self._reads.connect() as conn:
            value = conn.execute(select(versions_table.c.last_version)
                                 .where(versions_table.c.job == job)).scalar()
        return int(value or 0)

    def issued(self, job: str, version: int) -> None:
        """Record ``version`` as issued to ``job`` (committed when this returns)."""
        postgres = self._engine.dialect.name == "postgresql"
        insert = (postgresql.insert if postgres else sqlite.insert)(versions_table)
        higher = (func.greatest if postgres else func.max)(versions_table.c.last_version,
                                                            insert.excluded.last_version)
        upsert = insert.values(job=job, last_version=version).on_conflict_do_update(
            index_elements=[versions_table.c.job], set_={"last_version": higher})
        with self._engine.begin() as conn:
            conn.execute(upsert)

    def close(self) -> None:
        release_state_engine(self._engine)

