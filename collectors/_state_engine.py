"""One way to open the state database (findings, changes, audit log, spans, Optuna study).

A SQLAlchemy URL, SQLite file by default: WAL so readers (the CLI, the web page) never block
the sidecar, synchronous=NORMAL so committed rows survive a killed process, and a busy timeout
so a second process waits instead of failing with "database is locked".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """The SQLAlchemy URL of a SQLite file (``sqlite:////abs/path/state.db``)."""
    return f"sqlite:///{Path(path).resolve()}"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def state_engine(url: str) -> Engine:
    """An engine on the state database; a SQLite file's folder is created if missing."""
    parsed = make_url(url)
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url)
    if sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine
