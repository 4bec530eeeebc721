"""Changes are read in pages, in the journal's order: an index on that order, so a page is an
index range and not a sort of every change a fleet ever made. Idempotent, as r0001: a journal
of this release creates its own tables (and this index) before any migration ran.

Revision ID: r0003
Revises: r0002
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "r0003"
down_revision = "r0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Index changes by (created_at_ns, id)."""
    op.create_index("changes_in_order", "changes", ["created_at_ns", "id"], if_not_exists=True)


def downgrade() -> None:
    """Drop the index."""
    op.drop_index("changes_in_order", table_name="changes", if_exists=True)
