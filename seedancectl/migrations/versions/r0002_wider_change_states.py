"""A change's state fits its longest name: ``manual_intervention_required`` is 28 characters,
and PostgreSQL refuses it in the 16 the first tables gave (SQLite never checked a length).

Revision ID: r0002
Revises: r0001
Create Date: 2026-05-20
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0002"
down_revision = "r0001"
branch_labels = None
depends_on = None

_STATES = (("changes", ("state",)), ("change_events", ("from_state", "to_state")))


def upgrade() -> None:
    """Widen the state columns to 32 characters."""
    _resize(sa.String(16), sa.String(32))


def downgrade() -> None:
    """Back to 16 characters (fails on PostgreSQL while a longer state is stored)."""
    _resize(sa.String(32), sa.String(16))


def _resize(old: sa.String, new: sa.String) -> None:
    for table, columns in _STATES:
        with op.batch_alter_table(table) as batch:  # SQLite: a copy of the table
            for column in columns:
                batch.alter_column(column, existing_type=old, type_=new,
                                   existing_nullable=column != "state")
