"""Locks that several sidecars on one state database take around a read-modify-write that spans
statements (or transactions, like Optuna's enqueue then ask, or a schema upgrade), so only one
runs it at a time.

PostgreSQL: advisory locks keyed on a name's 64-bit hash (``hashtextextended``), held until the
transaction that took them ends, so a sidecar that dies mid-way never leaves one held. A SQLite
file: ``flock`` on the file's folder, one lock for every name (held by the open file, so the
kernel drops it with a dead process; a folder, never the database file, because closing any
descriptor of that file would drop SQLite's own POSIX locks on it).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from collectors._state_engine import state_engine, state_url

_TRY = text("SELECT pg_try_advisory_xact_lock(hashtextextended(:name, 0))")
_WAIT = text("SELECT pg_advisory_xact_lock(hashtextextended(:name, 0))")


def lock_transaction(conn: Connection, name: str) -> bool:
    """Take lock ``name`` until ``conn``'s transaction ends; True when another holder made it
    wait. PostgreSQL only; on SQLite nothing (False): its transactions' writes are serialised
    by the database file's own lock."""
    if conn.dialect.name != "postgresql":
        return False
    if conn.execute(_TRY, {"name": name}).scalar_one():
        return False
    conn.execute(_WAIT, {"name": name})
    return True


class StateLocks:
    """Named locks held across calls that use other connections (``held``), across threads and
    processes; counts the times one was busy (``waits``). Thread-safe, not reentrant (a thread
    holding one waits forever for a second); ``close`` is idempotent."""

    def __init__(self, url: str) -> None:
        parsed = state_url(url)
        self._engine: Engine | None = None
        self._folder: Path | None = None
        if parsed.get_backend_name() == "postgresql":
            self._engine = state_engine(url)
        elif parsed.database not in (None, "", ":memory:"):
            self._folder = Path(parsed.database).resolve().parent
        self._count = threading.Lock()
        self.waits = 0
        """How many times ``held`` found its lock taken by another holder and waited."""

    @contextmanager
    def held(self, name: str) -> Iterator[None]:
        """Hold lock ``name`` for the block (on a connection or a descriptor of its own)."""
        if self._engine is not None:
            with self._engine.begin() as conn:
                self._waited(lock_transaction(conn, name))
                yield
        elif self._folder is not None:
            self._folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._folder, os.O_RDONLY)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self._waited(True)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # drops the lock
        else:  # an in-memory database lives in one connection: nobody to exclude
            yield

    def _waited(self, waited: bool) -> None:
        if waited:
            with self._count:
                self.waits += 1

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
