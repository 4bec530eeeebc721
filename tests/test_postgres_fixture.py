"""The PostgreSQL fixture itself: a fresh database per test, a server that survives a crash."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.postgres import PostgresServer


def test_each_test_gets_an_empty_database(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    try:
        with engine.begin() as conn:
            assert sa.inspect(conn).get_table_names() == []
            conn.execute(sa.text("CREATE TABLE t (x int)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1)"))
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 1
    finally:
        engine.dispose()


@pytest.mark.integration
def test_a_server_stopped_like_a_crash_starts_again_with_its_data(
        postgres_server: PostgresServer) -> None:
    server = PostgresServer()
    try:
        server.start()
        url = server.create_database("kept")
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (x int)"))
            conn.execute(sa.text("INSERT INTO t VALUES (7)"))
        engine.dispose()
        server.stop("immediate")
        assert not server.running()
        with pytest.raises(sa.exc.OperationalError):
            sa.create_engine(url, connect_args={"connect_timeout": 2}).connect()
        server.start()
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT x FROM t")).scalar_one() == 7
        engine.dispose()
    finally:
        server.remove()
    assert not server.root.exists()
