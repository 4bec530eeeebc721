"""The state DB engine on PostgreSQL: a restarted server leaves no dead connection, and a bad
URL or an unreachable server is one line that hides the password."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from collectors import ConfigError, state_db_error, state_engine
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
