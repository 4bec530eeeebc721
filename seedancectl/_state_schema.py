"""The state database's schema: our tables' Alembic migrations, run before any store opens.

The composition root owns them because it alone sees every package's tables (spans from
collectors, findings from policies, the journal, ledger and fleet tables from tuner). Optuna
keeps its own tables, with its own Alembic and its ``alembic_version`` table, in the same
database: ours record their revision in ``seedance_alembic_version`` and never compare, create
or drop a table that is not ours.

``migrate`` runs one sidecar at a time (``StateLocks``: an advisory lock on PostgreSQL, a
folder lock next to a SQLite file), so sidecars of a fleet starting together neither create a
table twice nor record a revision twice; under the same lock it lets Optuna create its own
schema, which Optuna does without a lock. A database whose tables were made before there were
migrations (``create_all``) upgrades like an empty one: the first revision creates only what
is missing.
"""

from __future__ import annotations

from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import MetaData
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from collectors import StateLocks, spans_table, state_db_error, state_engine, state_engine_options
from policies import findings_table
from tuner import STATE_TABLES

VERSION_TABLE = "seedance_alembic_version"
MIGRATE_LOCK = "seedance:migrate"


def state_metadata() -> MetaData:
    """Our tables, as the code declares them, in one MetaData (the migrations' target)."""
    merged = MetaData()
    for table in (spans_table, findings_table, *STATE_TABLES):
        table.to_metadata(merged)
    return merged


def include_name(name: str | None, type_: str, _parent: Any) -> bool:
    """Alembic's filter: only our tables (and their indexes) are compared or touched."""
    return type_ != "table" or name in state_metadata().tables


def alembic_config() -> Config:
    """Alembic's configuration of our migrations (no ini file: scripts ship in the package)."""
    config = Config()
    config.set_main_option("script_location", "seedancectl:migrations")
    return config


def head() -> str:
    """The newest revision of our tables."""
    revision = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert revision is not None, "seedancectl/migrations has no revision"
    return revision


def current(url: str) -> str | None:
    """The revision the database at ``url`` is at; None before its first ``migrate``."""
    engine = state_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            return context.get_current_revision()
    except SQLAlchemyError as exc:
        raise state_db_error(url, exc) from None
    finally:
        engine.dispose()


def migrate(url: str) -> str:
    """Upgrade our tables to the newest revision and let Optuna create its own, one process at
    a time; returns the revision. An unreachable or unusable database is a ``StateDbError``."""
    import optuna  # its schema, created under our lock

    locks = StateLocks(url)
    engine = state_engine(url)
    try:
        with locks.held(MIGRATE_LOCK):
            with engine.begin() as conn:
                config = alembic_config()
                config.attributes["connection"] = conn
                command.upgrade(config, "head")
            connect_args = state_engine_options(url).get("connect_args", {})
            optuna.storages.RDBStorage(url, engine_kwargs={  # no pool left behind
                "poolclass": NullPool, "connect_args": connect_args})
    except SQLAlchemyError as exc:
        raise state_db_error(url, exc) from None
    finally:
        engine.dispose()
        locks.close()
    return head()
