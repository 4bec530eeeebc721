"""Findings in the state database: one SQLAlchemy URL, a SQLite file by default.

Tables are prefixed ``findings`` so the tuner's tables (changes, approvals, audit) and the
Optuna study can share the same database. A partial unique index allows at most one active
finding per (detector, job, resource), so two engines on one database cannot open duplicates.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    MetaData,
    String,
    Table,
    Text,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from collectors import SeedanceError, autocommit_reads, release_state_engine, shared_state_engine
from collectors import sqlite_url as sqlite_url
from policies._findings import Finding

_metadata = MetaData()
findings_table = Table(
    "findings",
    _metadata,
    Column("id", String(64), primary_key=True),
    Column("detector", String(128), nullable=False),
    Column("job", String(256), nullable=False),
    Column("resource_key", String(1024), nullable=False),
    Column("severity", String(16), nullable=False),
    Column("opened_at_ns", BigInteger, nullable=False),
    Column("closed_at_ns", BigInteger, nullable=True),
    Column("body", Text, nullable=False),
    Index("findings_by_job", "job", "opened_at_ns"),
    Index("findings_one_active", "detector", "job", "resource_key", unique=True,
          sqlite_where=text("closed_at_ns IS NULL"),
          postgresql_where=text("closed_at_ns IS NULL")),
)


class DuplicateFindingError(SeedanceError):
    """Another finding with the same (detector, job, resource) is still open in the state DB
    (two engines on one database opened the same one)."""


class FindingStore:
    """Saves and loads findings. Thread-safe (one pooled engine); ``close`` is idempotent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine: Engine = shared_state_engine(url)
        self._reads = autocommit_reads(self._engine)
        _metadata.create_all(self._engine)

    def save(self, finding: Finding) -> None:
        """Insert or update ``finding`` by id (it must have been opened: id and opened_at_ns)."""
        if not finding.id or finding.opened_at_ns is None:
            raise ValueError("only opened findings (with id and opened_at_ns) can be saved")
        detector, job, resource = finding.key
        row = {"detector": detector, "job": job, "resource_key": resource,
               "severity": finding.severity, "opened_at_ns": finding.opened_at_ns,
               "closed_at_ns": finding.closed_at_ns, "body": finding.to_json()}
        try:
            with self._engine.begin() as conn:
                result = conn.execute(update(findings_table)
                                      .where(findings_table.c.id == finding.id).values(**row))
                if result.rowcount == 0:
                    conn.execute(insert(findings_table).values(id=finding.id, **row))
        except IntegrityError as e:  # SQLite reports a full disk as one too: ask which
            other = self._open_id(detector, job, resource)
            if other is None or other == finding.id:
                raise
            raise DuplicateFindingError(
                f"finding {finding.id}: {detector} on job {job} ({resource or 'whole job'}) is "
                f"already open as finding {other}") from e

    def _open_id(self, detector: str, job: str, resource: str) -> str | None:
        t = findings_table
        with self._reads.connect() as conn:
            return conn.execute(select(t.c.id).where(
                t.c.detector == detector, t.c.job == job, t.c.resource_key == resource,
                t.c.closed_at_ns.is_(None))).scalar_one_or_none()

    def get(self, finding_id: str) -> Finding | None:
        """The finding with this id, or None."""
        with self._reads.connect() as conn:
            body = conn.execute(select(findings_table.c.body).where(
                findings_table.c.id == finding_id)).scalar_one_or_none()
        return None if body is None else Finding.from_json(body)

    def active(self) -> list[Finding]:
        """Findings opened and not closed, oldest first."""
        return self._select(findings_table.c.closed_at_ns.is_(None))

    def history(self, *, job: str | None = None, detector: str | None = None,
                since_ns: int | None = None) -> list[Finding]:
        """Findings (open or closed) of a job/detector opened at or after ``since_ns``."""
        conditions = []
        if job is not None:
            conditions.append(findings_table.c.job == job)
        if detector is not None:
            conditions.append(findings_table.c.detector == detector)
        if since_ns is not None:
            conditions.append(findings_table.c.opened_at_ns >= since_ns)
        return self._select(*conditions)

    def _select(self, *conditions: Any) -> list[Finding]:
        query = select(findings_table.c.body).where(*conditions).order_by(
            findings_table.c.opened_at_ns, findings_table.c.id)
        with self._reads.connect() as conn:
            return [Finding.from_json(body) for body in conn.execute(query).scalars()]

    def close(self) -> None:
        """Release the connection pool; a second call is harmless."""
        release_state_engine(self._engine)

    def __enter__(self) -> FindingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
