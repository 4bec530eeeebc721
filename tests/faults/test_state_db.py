"""The sidecar on a PostgreSQL state DB: it migrates at start, answers 503 while the server is
down (unready, with the reason; its log says the failure once, and when it ended) and serves
again once it is back (ready again at the next fleet heartbeat), with no dead pooled
connection; an unreachable server
stops `seedancectl sidecar` with one line before its banner. Real sidecar processes, a real
PostgreSQL."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seedancectl._state_schema import current, head
from seedancectl.cli import app
from tests.faults._sidecar import TOKEN, SidecarProcess
from tests.postgres import PostgresServer
from tests.servers import free_port
from tuner import DEFAULT_HEARTBEAT_S

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def log(folder: Path) -> str:
    """The whole sidecar log (``SidecarProcess.log`` keeps its end only)."""
    return (folder / "sidecar.log").read_text(errors="replace")


def test_a_sidecar_migrates_and_outlives_a_postgresql_restart(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    server = PostgresServer()  # its own: this test stops it
    try:
        server.start()
        url = server.create_database("state")
        sidecar = SidecarProcess(tmp_path, state_db=url)
        try:
            assert current(url) == head()
            assert sidecar.http.get("/v1/audit", headers=AUTH).status_code == 200
            server.stop("immediate")
            server.start()  # the pool holds connections to the old server: pinged, replaced
            assert sidecar.http.get("/v1/audit", headers=AUTH).status_code == 200
            server.stop("immediate")
            for _ in range(20):
                down = sidecar.http.get("/v1/audit", headers=AUTH)
                assert down.status_code == 503 and "state DB" in down.json()["detail"]
            assert any("state DB" in r for r in sidecar.http.get("/readyz").json()["reasons"])
            deadline = time.monotonic() + 4 * DEFAULT_HEARTBEAT_S  # a heartbeat fails too
            while "fleet heartbeat of sidecar" not in log(tmp_path):
                assert time.monotonic() < deadline, log(tmp_path)[-2000:]
                time.sleep(0.2)
            server.start()
            assert sidecar.http.get("/v1/audit", headers=AUTH).status_code == 200
            # ready again once a fleet heartbeat commits, long before the error's 60 s expire
            deadline = time.monotonic() + 8 * DEFAULT_HEARTBEAT_S
            while sidecar.http.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, sidecar.http.get("/readyz").text
                time.sleep(0.2)
            # the outage in the log: each failure once, with its time, and its end
            lines = log(tmp_path).splitlines()
            failed = [ln for ln in lines if "state DB write failed" in ln]
            assert len(failed) == 1 and re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ERROR ",
                                                 failed[0]), failed
            assert any("written again, after" in ln for ln in lines), lines[-20:]
        finally:
            sidecar.stop()
    finally:
        server.remove()


def test_an_unreachable_postgresql_is_one_line_before_the_banner(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text(f'state_db = "postgresql+psycopg://u:pw@127.0.0.1:{free_port()}/d"\n'
                      f'store = "{tmp_path / "metrics.db"}"\nnvml = "off"\n')
    result = CliRunner().invoke(app, ["sidecar", "--config", str(config)])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error: state_db postgresql+psycopg://u:***@")
    assert "refused" in line and "listening" not in result.output
