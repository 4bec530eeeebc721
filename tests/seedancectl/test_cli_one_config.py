"""One configuration file drives every `seedancectl` command (#15): a real sidecar started
with `-c FILE` on 127.0.0.1 keeps its store and state database in one folder, and `status`,
`changes list`, `findings`, `metrics list` and `fleet status` find it all from the same file
(or `$SEEDANCE_CONFIG`), no flag repeated."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from seedancectl.cli import app
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
LOCATING = ("--store", "--state-db", "--sidecar", "--token-file")
"""Options that say where a command's data is: each such command takes the config too."""


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def test_every_command_that_reads_data_takes_the_config() -> None:
    checked = 0
    for name, command in _commands(typer.main.get_group(app)):
        options = {opt for p in command.params for opt in p.opts}
        if options & set(LOCATING):
            checked += 1
            config = next(p for p in command.params if "--config" in p.opts)
            assert "-c" in config.opts and config.envvar == "SEEDANCE_CONFIG", name
    assert checked >= 20


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A sidecar run as an operator would, from a config naming only listen and store."""
    port = free_port()
    config = tmp_path / "seedance.toml"
    config.write_text(f'[sidecar]\nlisten = "127.0.0.1:{port}"\nnvml = "off"\n'
                      f'store = "{tmp_path / "data" / "metrics.db"}"\n')
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    log = open(tmp_path / "sidecar.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "seedancectl.sidecar", "-c", str(config)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (
                (tmp_path / "sidecar.log").read_text())
            time.sleep(0.2)
        yield config, url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.mark.integration
def test_one_config_file_drives_every_command(sidecar: tuple[Path, str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config, url = sidecar
    data = tmp_path / "data"
    assert {"metrics.db", "state.db", "token"} <= {p.name for p in data.iterdir()}
    assert not (tmp_path / "seedance-data").exists()  # one data folder, not two

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no seedance-data/ here: all comes from the file
    for key in [k for k in os.environ if k.startswith("SEEDANCE_")]:
        monkeypatch.delenv(key)
    commands = [["status"], ["changes", "list"], ["findings"], ["metrics", "list"],
                ["fleet", "status"], ["tuning", "pause", "--job", "nobody"]]
    for args in commands:
        result = CliRunner().invoke(app, [*args, "-c", str(config)])
        if args[0] == "tuning":  # the token found next to the store: the sidecar answers
            assert result.exit_code == 2 and "HTTP 409" in result.output, result.output
        else:
            assert result.exit_code == 0, (args, result.output)
    monkeypatch.setenv("SEEDANCE_CONFIG", str(config))
    status = CliRunner().invoke(app, ["status"])
    assert status.exit_code == 0 and url in status.output, status.output
