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
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from collectors._errors import ConfigError, SeedanceError

CONNECT_TIMEOUT_S = 10
"""How long opening one PostgreSQL connection may take before it is an error."""
POSTGRES_POOL: dict[str, Any] = {"pool_size": 2, "max_overflow": 8, "pool_timeout": 30}
"""Idle connections kept per engine (``pool_size``) and the burst above it, for an engine of
its own (a search's Optuna storage, the lock holder, the heartbeat)."""
SHARED_POSTGRES_POOL: dict[str, Any] = {**POSTGRES_POOL, "pool_size": 4, "max_overflow": 16}
"""The pool of the one engine the stores of a process share (`shared_state_engine`): with an
engine each, a sidecar's six stores kept up to 12 idle connections and burst to 60, and 16
sidecars exhausted a PostgreSQL's ``max_connections = 200`` (``bench/fleet.py``)."""
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


_shared: dict[str, Engine] = {}  # url -> the engine its stores share
_holders: dict[int, tuple[str | None, Engine]] = {}  # id(handed out) -> (shared url, it)
_shared_lock = threading.Lock()


def shared_state_engine(url: str) -> Engine:
    """An engine on the state database at ``url`` for one store, to give back with
    `release_state_engine`. On PostgreSQL the stores of a process share one pool, so a
    sidecar's connections do not grow with its stores; not for work that holds a connection
    while it needs another (a lock held across a block), which takes an engine of its own.
    SQLite gets an engine of its own: its connections are cheap, and an in-memory database is
    one engine's alone."""
    with _shared_lock:
        if state_url(url).get_backend_name() != "postgresql":
            engine, key = state_engine(url), None
        else:
            if url not in _shared:
                _shared[url] = create_engine(
                    state_url(url), **{**state_engine_options(url), **SHARED_POSTGRES_POOL})
            engine, key = _shared[url].execution_options(), url  # one handle per store
        _holders[id(engine)] = (key, engine)
        return engine


def release_state_engine(engine: Engine) -> None:
    """A store is done with ``engine``: its connections close once no store holds its pool
    (harmless twice)."""
    with _shared_lock:
        held = _holders.pop(id(engine), None)
        if held is None:
            return
        url = held[0]
        if url is None:
            pool_owner = engine
        elif any(key == url for key, _ in _holders.values()):
            return
        else:
            pool_owner = _shared.pop(url)
    pool_owner.dispose()


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
