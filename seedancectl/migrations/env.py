"""Alembic's environment: migrates on the connection ``migrate`` hands it (online only), our
tables only, their revision in our own version table."""

from __future__ import annotations

from alembic import context

from seedancectl._state_schema import VERSION_TABLE, include_name, state_metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run our migrations through `seedancectl db upgrade` (or "
                       "seedancectl._state_schema.migrate), which hand Alembic a connection")
context.configure(connection=connection, target_metadata=state_metadata(),
                  version_table=VERSION_TABLE, include_name=include_name,
                  render_as_batch=True)  # SQLite alters a table by copying it
with context.begin_transaction():
    context.run_migrations()
