"""A real sidecar started the way deploy/slurm starts one on each node: seedance-node.sh
`sidecar`, the Slurm sidecar.toml, the job's token in $SEEDANCE_TOKEN_FILE, on 127.0.0.1.
Only the state DB moves, from the fleet's PostgreSQL to a SQLite file (SEEDANCE_STATE_DB)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.files import NODE_SCRIPT
from tests.servers import free_port

READY_TIMEOUT_S = 90


@dataclass(frozen=True)
class NodeSidecar:
    port: int
    job: str
    token: str
    env: dict[str, str]


def slurm_env(tmp: Path, *, job_id: str = "90210", node: str = "gpu-017",
              **more: str) -> dict[str, str]:
    """A Slurm step's environment on one node; this process's SEEDANCE_* left out (they would
    override the sidecar's settings), this Python's scripts first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEEDANCE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(SLURM_JOB_ID=job_id, SLURM_JOB_NAME="gpt-train", SLURMD_NODENAME=node,
               TMPDIR=str(tmp), **more)
    return env


def node(command: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(NODE_SCRIPT), command, *args], env=env,
                          capture_output=True, text=True, timeout=READY_TIMEOUT_S + 30)


@pytest.fixture(scope="package")
def node_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeSidecar]:
    tmp = tmp_path_factory.mktemp("node")
    token = secrets.token_urlsafe(24)
    (tmp / "token").write_text(token + "\n")
    port = free_port()
    env = slurm_env(tmp, SIDECAR_PORT=str(port), SEEDANCE_TOKEN_FILE=str(tmp / "token"),
                    SEEDANCE_STATE_DB=f"sqlite:///{tmp / 'state.db'}")
    log = tmp / "sidecar.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", str(NODE_SCRIPT), "sidecar"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        waited = node("wait", env, str(READY_TIMEOUT_S))
        assert waited.returncode == 0, f"{waited.stderr}\nsidecar log:\n{log.read_text()}"
        yield NodeSidecar(port=port, job=node("job", env).stdout.strip(), token=token, env=env)
    finally:
        proc.terminate()
        proc.wait(30)
