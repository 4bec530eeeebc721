"""A real PostgreSQL server for tests and benches: ``initdb`` + ``pg_ctl`` under a temp dir, on a
free 127.0.0.1 port, its unix socket in that dir.

``initdb`` refuses to run as root, and CI runs as root: then every server command runs as the
``postgres`` system user (from the Debian package) through ``runuser``, and the temp dir is
handed to that user. A bench can ``stop(mode="immediate")`` (a crash, as far as clients can
tell) and ``start()`` the same cluster again on the same port.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Literal

from tests.servers import free_port

SUPERUSER = "postgres"
START_TIMEOUT_S = 60
# Settings for a throwaway cluster: loopback only, no fsync (data outlives a killed server,
# not a killed machine; commits stay synchronous so `stop("immediate")` loses no committed
# row), enough connections for several sidecar processes with their pools.
_SETTINGS = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{socket_dir}'
fsync = off
full_page_writes = off
max_connections = {max_connections}
shared_buffers = 32MB
log_min_messages = warning
"""


MAX_CONNECTIONS = 200


class PostgresUnavailable(RuntimeError):
    """The PostgreSQL server binaries are not installed here."""


def postgres_bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` live: $SEEDANCE_PG_BINDIR, the newest Debian
    ``/usr/lib/postgresql/N/bin``, else the folder of ``initdb`` on PATH."""
    if configured := os.environ.get("SEEDANCE_PG_BINDIR"):
        candidates = [configured]
    else:
        debian = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit()
                        else 0)
        on_path = shutil.which("initdb")
        candidates = [*reversed(debian), *([str(Path(on_path).parent)] if on_path else [])]
    for folder in candidates:
        if all(os.access(Path(folder) / tool, os.X_OK) for tool in ("initdb", "pg_ctl")):
            return Path(folder)
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (initdb, pg_ctl); install them with "
        "scripts/install-test-deps.sh (Debian package 'postgresql') or set SEEDANCE_PG_BINDIR")


class PostgresServer:
    """One throwaway PostgreSQL cluster: ``start()``, ``stop()``, ``start()`` again, ``remove()``.

    ``url`` is the SQLAlchemy URL of its ``postgres`` database (superuser, trust auth on
    loopback); ``create_database()`` gives each test its own database. Usable as a context
    manager (started on entry, removed on exit). Not thread-safe: one owner starts and stops it.
    """

    def __init__(self, root: Path | None = None, *, bindir: Path | None = None) -> None:
        self.bindir = bindir or postgres_bindir()
        self.root = root or Path(tempfile.mkdtemp(prefix="seedance-postgres-"))
        self.data_dir = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.port = free_port()
        self._as_user: list[str] = ["runuser", "-u", SUPERUSER, "--"] if os.getuid() == 0 else []
        self._initialised = False

    @property
    def host(self) -> str:
        """The address the server listens on."""
        return "127.0.0.1"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the cluster's ``postgres`` database."""
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        """SQLAlchemy URL of database ``name`` on this server."""
        return f"postgresql+psycopg://{SUPERUSER}@{self.host}:{self.port}/{name}"

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self._as_user, *args], capture_output=True, text=True,
                              check=False, cwd=self.root)
        if done.returncode != 0:
            log = self.log_path.read_text()[-2000:] if self.log_path.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}\n{log}")

    def _initdb(self) -> None:
        if self._as_user:
            entry = pwd.getpwnam(SUPERUSER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run(str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER,
                  "--auth=trust", "--encoding=UTF8", "--no-sync", "--no-instructions")
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(_SETTINGS.format(port=self.port, socket_dir=self.root,
                                         max_connections=MAX_CONNECTIONS))
        self._initialised = True

    def start(self) -> None:
        """Start the cluster (``initdb`` first on the first call); returns once it accepts
        connections."""
        if not self._initialised:
            self._initdb()
        self._run(str(self.bindir / "pg_ctl"), "start", "-D", str(self.data_dir),
                  "-l", str(self.log_path), "-w", "-t", str(START_TIMEOUT_S))

    def stop(self, mode: Literal["smart", "fast", "immediate"] = "fast") -> None:
        """Stop the cluster; ``immediate`` drops every connection at once, like a crash (the
        next ``start()`` recovers from the WAL)."""
        self._run(str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data_dir),
                  "-m", mode, "-w", "-t", str(START_TIMEOUT_S))

    def running(self) -> bool:
        """Whether the cluster's postmaster is up."""
        done = subprocess.run([*self._as_user, str(self.bindir / "pg_ctl"), "status", "-D",
                               str(self.data_dir)], capture_output=True, check=False)
        return done.returncode == 0

    def remove(self) -> None:
        """Stop the cluster if it runs and delete its folder; a second call is harmless."""
        if self._initialised and self.running():
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def _admin(self, sql: str) -> None:
        import psycopg  # the 'postgres' extra; conftest imports this module in every run

        with psycopg.connect(host=self.host, port=self.port, user=SUPERUSER, dbname="postgres",
                             autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql)  # type: ignore[arg-type]  # our own names, never user input

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database (a fresh random name by default); returns its URL."""
        name = name or f"test_{uuid.uuid4().hex[:12]}"
        self._admin(f'CREATE DATABASE "{name}"')
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        """Drop a database, closing whatever connections are still open on it."""
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()
