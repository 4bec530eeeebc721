"""Shared fixtures: real servers on loopback."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from sqlalchemy.engine import make_url

from collectors import sqlite_url
from tests._live_sessions import LIVE_SESSION_MODULES, LiveSessionsInOneUnit, module_of
from tests.postgres import PostgresServer, PostgresUnavailable, postgres_bindir
from tests.servers import PROMETHEUS

# No per-example deadline: it is an absolute time, and on a shared, loaded 2-core box an
# example can take seconds (tests/policies/test_cost_models.py failed on one this way).
settings.register_profile("seedance", deadline=None)
settings.load_profile("seedance")


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's workers start with COLUMNS=80, and the CLI's consoles read COLUMNS once,
    # when first imported: every test sets the width it needs instead.
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The live sessions first: xdist hands work out in collection order, and their unit is
    the longest (tests/_live_sessions.py)."""
    items.sort(key=lambda item: module_of(item.nodeid) not in LIVE_SESSION_MODULES)


BACKGROUND_NICENESS = 10
"""The niceness of a pytest-xdist worker once it runs anything but a live session: the live
sessions measure speed (tokens/s, step time) and judge configs on it, and beside a worker at
the same priority one window's tokens/s swung by +-25% and hid gains of 15-30% (the serving
session failed 3 runs of 3). A process may always lower its own priority, so this needs no
root; the live sessions' own processes keep theirs."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ and module_of(item.nodeid) not in LIVE_SESSION_MODULES:
        yield_cpu_to_live_sessions()


def yield_cpu_to_live_sessions() -> None:
    """Lower this worker (and what it starts from now on) to ``BACKGROUND_NICENESS``."""
    increment = BACKGROUND_NICENESS - os.nice(0)
    if increment > 0:
        os.nice(increment)


@pytest.fixture(autouse=True)
def torch_threads_put_back() -> Iterator[None]:
    """Each test leaves torch's intra-op threads as it found them: the serving engine and
    several tests set 1 for steadier timings, and a later test in the same worker whose
    defaults come from ``torch.get_num_threads()`` (a threads knob, a launch config) then ran
    from other defaults than when run alone (two fleet-prior replay tests failed so)."""
    torch = sys.modules.get("torch")  # imported by collection wherever a test uses it
    before = None if torch is None else torch.get_num_threads()
    yield
    if torch is not None and before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None  # another --dist asked for on the command line
    return LiveSessionsInOneUnit(config, log)


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    if not os.access(PROMETHEUS, os.X_OK):
        reason = (f"no Prometheus server at {PROMETHEUS}; "
                  "install it with scripts/install-test-deps.sh (Debian package 'prometheus')")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return PROMETHEUS


@pytest.fixture
def prometheus_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="seedance-prometheus-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL for the session (initdb + pg_ctl on a free loopback port)."""
    try:
        postgres_bindir()
    except PostgresUnavailable as missing:
        if os.getuid() == 0:  # CI runs as root and can install it: these tests must run there
            pytest.fail(str(missing))
        pytest.skip(str(missing))
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty database on the session's PostgreSQL, dropped after."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(str(make_url(url).database))


@pytest.fixture(params=["sqlite", "postgresql"])
def state_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh state database, once as a SQLite file and once on the session's PostgreSQL, so
    a state test proves both."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "state.db")
    return str(request.getfixturevalue("postgres_url"))
