"""The state DB engine on PostgreSQL: a restarted server leaves no dead connection, and a bad
URL or an unreachable server is one line that hides the password."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from collectors import (
    ConfigError,
    autocommit_reads,
    release_state_engine,
    shared_state_engine,
    state_db_error,
    state_engine,
)
from collectors._state_engine import SHARED_POSTGRES_POOL
from tests.postgres import PostgresServer
from tests.servers import free_port


@pytest.mark.integration
def test_pooled_connections_survive_a_server_restart(postgres_server: PostgresServer) -> None:
    server = PostgresServer()
    try:
        server.start()
        engine = state_engine(server.url)
        with engine.connect() as conn:  # the pool now holds a connection to the old server
            before = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        server.stop("immediate")
        server.start()
        with engine.connect() as conn:
            after = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        assert after != before
        engine.dispose()
    finally:
        server.remove()


def _last_statement_start(admin: sa.Connection, pid: int) -> object:
    admin.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
    return admin.execute(sa.text("SELECT query_start FROM pg_stat_activity WHERE pid = :pid"),
                         {"pid": pid}).scalar_one()


@pytest.fixture
def engines(postgres_url: str) -> Iterator[tuple[sa.Engine, sa.Engine]]:
    """The state engine under test and a plain one to watch the server with."""
    engine, admin_engine = state_engine(postgres_url), sa.create_engine(postgres_url)
    yield engine, admin_engine
    engine.dispose()
    admin_engine.dispose()


@pytest.mark.integration
def test_checking_out_a_live_pooled_connection_sends_the_server_nothing(
        engines: tuple[sa.Engine, sa.Engine]) -> None:
    engine, admin_engine = engines
    with engine.connect() as conn:
        pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    with admin_engine.connect() as admin:
        admin = admin.execution_options(isolation_level="AUTOCOMMIT")
        before = _last_statement_start(admin, pid)
        with engine.connect() as conn:  # the pooled connection, checked out and back
            assert conn.connection.dbapi_connection.info.backend_pid == pid
        assert _last_statement_start(admin, pid) == before


@pytest.mark.integration
def test_a_connection_the_server_dropped_is_replaced_at_checkout(
        engines: tuple[sa.Engine, sa.Engine]) -> None:
    engine, admin_engine = engines
    with engine.connect() as conn:
        dropped = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    with admin_engine.connect() as admin:
        admin.execute(sa.text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": dropped})
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() != dropped


@pytest.mark.integration
def test_a_read_is_one_round_trip_and_writes_on_the_same_pool_stay_transactional(
        engines: tuple[sa.Engine, sa.Engine]) -> None:
    engine, admin_engine = engines
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (x int)"))
    with autocommit_reads(engine).connect() as conn:
        pid = conn.execute(sa.text("SELECT count(*), pg_backend_pid() FROM t")).one()[1]
    with admin_engine.connect() as admin:  # no ROLLBACK after it: there was no BEGIN
        assert admin.execute(sa.text("SELECT query FROM pg_stat_activity WHERE pid = :p"),
                             {"p": pid}).scalar_one().startswith("SELECT count(*)")
    with pytest.raises(RuntimeError), engine.begin() as conn:  # the same connection
        assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() == pid
        conn.execute(sa.text("INSERT INTO t VALUES (1)"))
        raise RuntimeError("the write fails half-way")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 0


def test_an_unreachable_server_is_one_line_without_the_password() -> None:
    url = f"postgresql+psycopg://seedance:s3cret@127.0.0.1:{free_port()}/state"
    engine = state_engine(url)
    with pytest.raises(OperationalError) as failed:
        engine.connect()
    message = str(state_db_error(url, failed.value))
    assert "\n" not in message and "s3cret" not in message
    assert message.startswith("state_db postgresql+psycopg://seedance:***@127.0.0.1:")
    assert "refused" in message


@pytest.mark.parametrize(("url", "says"), [
    ("not a url", "is not a SQLAlchemy URL"),
    ("mysql+pymysql://u@h/d", "mysql is not supported"),
    ("postgresql+asyncpg://u@h/d", "write postgresql+psycopg://"),
])
def test_a_bad_url_is_a_config_error(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        state_engine(url)


def _connections(admin_engine: sa.Engine, database: str, settle_to: int | None = None) -> int:
    """Our connections the server lists; with ``settle_to``, waits up to 10 s for that count,
    as a backend leaves the list a moment after its client closed it."""
    deadline = time.monotonic() + 10
    while True:
        with admin_engine.connect() as admin:
            found = int(admin.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = :db "
                "AND application_name = 'seedance'"), {"db": database}).scalar_one())
        if settle_to is None or found == settle_to or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.integration
def test_a_process_stores_share_one_pool_on_postgres(postgres_url: str) -> None:
    """A sidecar opens six stores on the state DB; with an engine each a fleet of 16 ran
    PostgreSQL out of connections. Shared, the connections are the pool's, whatever the
    number of stores, and a store that closes leaves the others working."""
    from policies import FindingStore
    from tuner import ChangeJournal

    database = str(sa.engine.make_url(postgres_url).database)
    admin_engine = sa.create_engine(postgres_url)
    stores = [ChangeJournal(postgres_url) for _ in range(3)] + \
        [FindingStore(postgres_url) for _ in range(3)]
    try:
        for _ in range(3):  # every store reads while the others hold their connection
            with contextlib.ExitStack() as held:
                for store in stores:
                    held.enter_context(store._engine.connect())
        kept = SHARED_POSTGRES_POOL["pool_size"]
        assert _connections(admin_engine, database, settle_to=kept) == kept
        for store in stores[1:]:
            store.close()
            store.close()  # harmless twice: the pool stays for the store still open
        assert stores[0].changes() == []
        assert _connections(admin_engine, database) >= 1
        stores[0].close()
        assert _connections(admin_engine, database, settle_to=0) == 0
    finally:
        admin_engine.dispose()


def test_sqlite_stores_keep_engines_of_their_own(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    first, second = shared_state_engine(url), shared_state_engine(url)
    assert first.pool is not second.pool
    release_state_engine(first)
    with second.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    release_state_engine(second)
