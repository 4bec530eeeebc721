"""The change journal's tables in the state database: changes, their append-only events, and
each job's approval mode."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Index, Integer, MetaData, String, Table, Text

metadata = MetaData()
changes_table = Table(
    "changes", metadata,
    Column("id", String(64), primary_key=True),
    Column("job", String(256), nullable=False),
    Column("state", String(32), nullable=False),  # manual_intervention_required: 28
    Column("created_at_ns", BigInteger, nullable=False),
    Column("updated_at_ns", BigInteger, nullable=False),
    Column("body", Text, nullable=False),
    Index("changes_by_job", "job", "created_at_ns"),
    Index("changes_by_state", "state"),
    Index("changes_in_order", "created_at_ns", "id"),  # the keyset of a page of changes
)
change_events_table = Table(
    "change_events", metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("change_id", String(64), nullable=True),
    Column("job", String(256), nullable=False),
    Column("at_ns", BigInteger, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("from_state", String(32), nullable=True),
    Column("to_state", String(32), nullable=True),
    Column("actor", String(256), nullable=False),
    Column("reason", Text, nullable=False),
    Column("version_before", BigInteger, nullable=True),
    Column("version_after", BigInteger, nullable=True),
    Column("detail", Text, nullable=False),
    Index("change_events_by_change", "change_id", "seq"),
    Index("change_events_by_job", "job", "at_ns"),
)
modes_table = Table(
    "approval_modes", metadata,
    Column("job", String(256), primary_key=True),
    Column("mode", String(16), nullable=False),
)


