"""The state tables' migrations: head matches the code's tables on SQLite and PostgreSQL, next
to Optuna's own schema; a database made before migrations upgrades; sidecars starting at once
migrate once; `seedancectl db upgrade`."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

from collectors import SpanStore, StateDbError, sqlite_url
from policies import Evidence, Finding, FindingStore
from seedancectl._config import load_config
from seedancectl._preflight import preflight
from seedancectl._state_schema import (
    VERSION_TABLE,
    alembic_config,
    current,
    head,
    include_name,
    migrate,
    state_metadata,
)
from seedancectl.cli import app
from tests.servers import free_port
from tuner import STATE_TABLES, ChangeJournal, VersionLedger

OPTUNA_TABLES = {"studies", "trials", "alembic_version", "version_info"}


def schema_diff(url: str) -> list[object]:
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={
                "include_name": include_name, "version_table": VERSION_TABLE})
            return list(compare_metadata(context, state_metadata()))
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_head_creates_exactly_the_tables_the_code_declares(state_db_url: str) -> None:
    assert current(state_db_url) is None
    assert migrate(state_db_url) == head()
    assert current(state_db_url) == head()
    assert schema_diff(state_db_url) == []
    assert set(state_metadata().tables) | {VERSION_TABLE} | OPTUNA_TABLES <= tables(state_db_url)
    assert migrate(state_db_url) == head()  # a second start changes nothing
    optuna.create_study(study_name="s", storage=state_db_url)  # Optuna's schema is whole


def test_a_schema_difference_is_seen(state_db_url: str) -> None:
    """The comparison can fail: a column the code has and the database lacks is reported."""
    migrate(state_db_url)
    engine = sa.create_engine(state_db_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX changes_by_state"))
    engine.dispose()
    assert [d[0] for d in schema_diff(state_db_url)] == ["add_index"]  # type: ignore[index]


def test_downgrade_to_base_drops_our_tables_and_leaves_optunas(state_db_url: str) -> None:
    migrate(state_db_url)
    engine = sa.create_engine(state_db_url, poolclass=NullPool)
    with engine.begin() as conn:
        config = alembic_config()
        config.attributes["connection"] = conn
        command.downgrade(config, "base")
    engine.dispose()
    left = tables(state_db_url)
    assert not left & set(state_metadata().tables)
    assert OPTUNA_TABLES <= left


def test_a_sqlite_db_made_before_migrations_upgrades_with_its_rows(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "state.db")
    finding = Finding(id="f1", detector="d", job="j", severity="warning",
                      evidence=Evidence(summary="s", model="m"), opened_at_ns=1)
    with FindingStore(url) as findings:  # each store made its own tables with create_all
        findings.save(finding)
    ChangeJournal(url).close()
    VersionLedger(url).close()
    SpanStore(url).close()
    optuna.create_study(study_name="old", storage=url)
    fleet = sa.create_engine(url)
    for table in STATE_TABLES:  # the fleet tables: no store of their own yet
        if table.name.startswith("fleet_"):
            table.create(fleet)
    fleet.dispose()
    assert current(url) is None
    assert migrate(url) == head()
    assert schema_diff(url) == []
    with FindingStore(url) as findings:
        assert findings.get("f1") == finding
    assert optuna.load_study(study_name="old", storage=url).study_name == "old"


def _migrate(url: str) -> str:
    return migrate(url)


@pytest.mark.integration
def test_sidecars_starting_together_migrate_once(state_db_url: str) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        revisions = pool.map(_migrate, [state_db_url] * 4)
    assert revisions == [head()] * 4
    engine = sa.create_engine(state_db_url, poolclass=NullPool)
    with engine.connect() as conn:
        assert conn.execute(sa.text(f"SELECT count(*) FROM {VERSION_TABLE}")).scalar_one() == 1
        assert conn.execute(sa.text("SELECT count(*) FROM version_info")).scalar_one() == 1
    engine.dispose()
    assert schema_diff(state_db_url) == []


def test_db_upgrade_command(state_db_url: str) -> None:
    first = CliRunner().invoke(app, ["db", "upgrade", "--state-db", state_db_url])
    assert first.exit_code == 0, first.output
    assert first.output.strip() == f"state database at revision {head()} (was empty)"
    again = CliRunner().invoke(app, ["db", "upgrade", "--state-db", state_db_url])
    assert again.output.strip() == f"state database at revision {head()}"


@pytest.mark.parametrize(("url", "says"), [
    ("mysql://u@h/d", "mysql is not supported"),
    ("postgresql+psycopg://u:pw@127.0.0.1:{port}/d", "refused"),  # a port no one listens on
], ids=["mysql", "postgresql-refused"])
def test_db_upgrade_says_what_is_wrong_in_one_line(url: str, says: str) -> None:
    url = url.format(port=free_port())
    result = CliRunner().invoke(app, ["db", "upgrade", "--state-db", url])
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error:") and says in line
    assert "pw" not in line.replace("upgrade", "")


def test_preflight_says_when_postgresql_does_not_answer(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://u@127.0.0.1:{free_port()}/d"
    settings = load_config(overrides={"state_db": url, "store": tmp_path / "metrics.db"})
    with pytest.raises(StateDbError, match="refused"):
        preflight(settings)
