"""Locks that several sidecars on one state database take around a read-modify-write that spans
statements (or transactions, like Optuna's enqueue then ask), so only one runs it at a time.

PostgreSQL: advisory locks keyed on a name's 64-bit hash (``hashtextextended``), held until the
transaction that took them ends, so a sidecar that dies mid-way never leaves one held. SQLite:
nothing, its writers are serialised by the file lock, and a fleet shares PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from collectors._state_engine import state_engine, state_url

_TRY = text("SELECT pg_try_advisory_xact_lock(hashtextextended(:name, 0))")
_WAIT = text("SELECT pg_advisory_xact_lock(hashtextextended(:name, 0))")


def lock_transaction(conn: Connection, name: str) -> bool:
    """Take lock ``name`` until ``conn``'s transaction ends; True when another holder made it
    wait. Nothing on SQLite (False)."""
    if conn.dialect.name != "postgresql":
        return False
    if conn.execute(_TRY, {"name": name}).scalar_one():
        return False
    conn.execute(_WAIT, {"name": name})
    return True


class StateLocks:
    """Named locks held across calls that use other connections (``held``); counts the times
    one was busy (``waits``). Thread-safe; ``close`` is idempotent."""

    def __init__(self, url: str) -> None:
        postgres = state_url(url).get_backend_name() == "postgresql"
        self._engine: Engine | None = state_engine(url) if postgres else None
        self._count = threading.Lock()
        self.waits = 0
        """How many times ``held`` found its lock taken by another holder and waited."""

    @contextmanager
    def held(self, name: str) -> Iterator[None]:
        """Hold lock ``name`` for the block (on a connection of its own)."""
        if self._engine is None:
            yield
            return
        with self._engine.begin() as conn:
            if lock_transaction(conn, name):
                with self._count:
                    self.waits += 1
            yield

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
