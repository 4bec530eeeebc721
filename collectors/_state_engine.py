"""One way to open the state database (findings, changes, audit log, spans, Optuna study).

A SQLAlchemy URL, SQLite file by default: WAL so readers (the CLI, the web page) never block
the sidecar, synchronous=NORMAL so committed rows survive a killed process, and a busy timeout
so a second process waits instead of failing with "database is locked".

PostgreSQL (``postgresql+psycopg://``) when several sidecars share the state: every pooled
connection is checked before use (``_state_pool``: its socket polled, pinged only when the
server said something), so a server that restarted leaves no dead connection behind (the next
call reconnects); a connect timeout, so an unreachable server is an error in seconds,
not a hang; a small pool per engine, because a sidecar opens a few engines (findings, journal,
ledger, spans, one Optuna storage per search) and a fleet of them shares one server's
``max_connections``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from collectors._errors import ConfigError, SeedanceError

CONNECT_TIMEOUT_S = 10
"""How long opening one PostgreSQL connection may take before it is an error."""
POSTGRES_POOL: dict[str, Any] = {"pool_size": 2, "max_overflow": 8, "pool_timeout": 30}
"""Idle connections kept per engine (``pool_size``) and the burst above it; a sidecar has
about six engines, so a fleet of N sidecars holds about 12 N connections at rest."""
_BACKENDS = ("sqlite", "postgresql")


class StateDbError(SeedanceError):
    """The state database could not be reached or used (one line, password hidden)."""


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """The SQLAlchemy URL of a SQLite file (``sqlite:////abs/path/state.db``)."""
    return f"sqlite:///{Path(path).resolve()}"


def state_url(url: str) -> URL:
    """``url`` parsed, or ConfigError naming what is wrong: not a URL, a database other than
    SQLite or PostgreSQL, or PostgreSQL without the psycopg (3) driver or its package."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(f"state_db: {url!r} is not a SQLAlchemy URL "
                          "(sqlite:///path/state.db or postgresql+psycopg://user@host/db)"
                          ) from None
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    if backend not in _BACKENDS:
        raise ConfigError(f"state_db: {backend} is not supported; use sqlite:///path/state.db "
                          "or postgresql+psycopg://user@host/db")
    if backend == "postgresql":
        if driver != "psycopg":
            raise ConfigError(f"state_db: PostgreSQL through {driver} is not supported; "
                              "write postgresql+psycopg://...")
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise ConfigError("state_db: PostgreSQL needs psycopg; "
                              "pip install 'seedance-tuner[postgres]'") from None
    return parsed


def state_engine_options(url: str) -> dict[str, Any]:
    """``create_engine`` keyword arguments for the state DB at ``url`` (Optuna's storage
    takes them too, so its engine checks connections and times out like ours)."""
    if state_url(url).get_backend_name() != "postgresql":
        return {}
    from collectors._state_pool import LivenessCheckedPool  # psycopg is there: state_url said so

    return {**POSTGRES_POOL, "poolclass": LivenessCheckedPool, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S,
                                              "application_name": "seedance"}}


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def state_engine(url: str) -> Engine:
    """An engine on the state database; a SQLite file's folder is created if missing."""
    parsed = state_url(url)
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, **state_engine_options(url))
    if sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def autocommit_reads(engine: Engine) -> Engine:
    """``engine``'s pool, each statement its own transaction: for reads of one statement (or
    of statements that may each see their own snapshot). On PostgreSQL such a read is one
    round trip, where a transaction adds a BEGIN and the ROLLBACK that hands the connection
    back to the pool. Writes keep ``engine``."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def state_db_error(url: str, exc: BaseException) -> StateDbError:
    """``exc`` from the database at ``url`` as one line: where (password hidden) and why."""
    where = make_url(url).render_as_string(hide_password=True)
    cause = getattr(exc, "orig", None) or exc
    why = "; ".join(line.strip() for line in str(cause).splitlines() if line.strip())
    return StateDbError(f"state_db {where}: {why or type(cause).__name__}")


def ping_state_db(url: str) -> None:
    """Connect once and run ``SELECT 1``; a ``StateDbError`` line when the database cannot be
    reached or refuses us (within ``CONNECT_TIMEOUT_S`` on PostgreSQL)."""
    engine = state_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        raise state_db_error(url, exc) from None
    finally:
        engine.dispose()
