"""The state tables as they were before migrations: spans, findings, the change journal, the
version ledger and the fleet tables.

Idempotent (``IF NOT EXISTS`` throughout): a database whose tables ``create_all`` made before
there were migrations upgrades through it unchanged, and so does one a store of this release
created on its own.

Revision ID: r0001
Revises:
Create Date: 2026-05-20
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0001"
down_revision = None
branch_labels = None
depends_on = None

_TABLES = ("spans", "findings", "changes", "change_events", "approval_modes", "config_versions",
           "fleet_sidecars", "fleet_jobs")


def upgrade() -> None:
    """Create each table and index that is missing."""
    op.create_table(
        "spans",
        sa.Column("trace_id", sa.String(32), primary_key=True),
        sa.Column("span_id", sa.String(16), primary_key=True),
        sa.Column("parent_span_id", sa.String(16), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("start_ns", sa.BigInteger, nullable=False),
        sa.Column("end_ns", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(8), nullable=False),
        sa.Column("status_message", sa.Text, nullable=False),
        sa.Column("service", sa.String(256), nullable=False),
        sa.Column("attributes", sa.Text, nullable=False),
        sa.Column("resource", sa.Text, nullable=False),
        if_not_exists=True)
    op.create_index("spans_by_start", "spans", ["start_ns"], if_not_exists=True)

    op.create_table(
        "findings",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("detector", sa.String(128), nullable=False),
        sa.Column("job", sa.String(256), nullable=False),
        sa.Column("resource_key", sa.String(1024), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("opened_at_ns", sa.BigInteger, nullable=False),
        sa.Column("closed_at_ns", sa.BigInteger, nullable=True),
        sa.Column("body", sa.Text, nullable=False),
        if_not_exists=True)
    op.create_index("findings_by_job", "findings", ["job", "opened_at_ns"], if_not_exists=True)
    op.create_index("findings_one_active", "findings", ["detector", "job", "resource_key"],
                    unique=True, if_not_exists=True,
                    sqlite_where=sa.text("closed_at_ns IS NULL"),
                    postgresql_where=sa.text("closed_at_ns IS NULL"))

    op.create_table(
        "changes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("job", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at_ns", sa.BigInteger, nullable=False),
        sa.Column("updated_at_ns", sa.BigInteger, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        if_not_exists=True)
    op.create_index("changes_by_job", "changes", ["job", "created_at_ns"], if_not_exists=True)
    op.create_index("changes_by_state", "changes", ["state"], if_not_exists=True)

    op.create_table(
        "change_events",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("change_id", sa.String(64), nullable=True),
        sa.Column("job", sa.String(256), nullable=False),
        sa.Column("at_ns", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=True),
        sa.Column("actor", sa.String(256), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("version_before", sa.BigInteger, nullable=True),
        sa.Column("version_after", sa.BigInteger, nullable=True),
        sa.Column("detail", sa.Text, nullable=False),
        if_not_exists=True)
    op.create_index("change_events_by_change", "change_events", ["change_id", "seq"],
                    if_not_exists=True)
    op.create_index("change_events_by_job", "change_events", ["job", "at_ns"],
                    if_not_exists=True)

    op.create_table(
        "approval_modes",
        sa.Column("job", sa.String(256), primary_key=True),
        sa.Column("mode", sa.String(16), nullable=False),
        if_not_exists=True)

    op.create_table(
        "config_versions",
        sa.Column("job", sa.String(256), primary_key=True),
        sa.Column("last_version", sa.BigInteger, nullable=False),
        if_not_exists=True)

    op.create_table(
        "fleet_sidecars",
        sa.Column("sidecar_id", sa.String(64), primary_key=True),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("host", sa.String(256), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        if_not_exists=True)

    op.create_table(
        "fleet_jobs",
        sa.Column("job", sa.String(256), primary_key=True),
        sa.Column("sidecar_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("study", sa.String(512), nullable=True),
        sa.Column("fingerprint", sa.Text, nullable=True),
        sa.Column("baseline", sa.Text, nullable=True),
        sa.Column("attached_at", sa.Float, nullable=False),
        sa.Column("seen_at", sa.Float, nullable=False),
        if_not_exists=True)
    op.create_index("fleet_jobs_by_sidecar", "fleet_jobs", ["sidecar_id"], if_not_exists=True)


def downgrade() -> None:
    """Drop our tables (Optuna's stay)."""
    for table in reversed(_TABLES):
        op.drop_table(table)
