"""A real sidecar started the way deploy/slurm starts one on each node: seedance-node.sh
`sidecar`, the Slurm sidecar.toml, the job's token in $SEEDANCE_TOKEN_FILE, on 127.0.0.1.
Only the state DB moves, from the fleet's PostgreSQL to a SQLite file (SEEDANCE_STATE_DB). As in
the image, torch cannot be imported: a `torch` first on PYTHONPATH fails as a missing one does."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.files import NODE_SCRIPT
from tests.deploy.slurm_node import READY_TIMEOUT_S, NodeSidecar, node, slurm_env
from tests.servers import free_port


def no_torch(folder: Path) -> Path:
    """A folder whose `torch` raises what importing an absent package raises."""
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'torch\'", name="torch")\n')
    return folder


@pytest.fixture(scope="package")
def node_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeSidecar]:
    tmp = tmp_path_factory.mktemp("node")
    token = secrets.token_urlsafe(24)
    (tmp / "token").write_text(token + "\n")
    port = free_port()
    env = slurm_env(tmp, SIDECAR_PORT=str(port), SEEDANCE_TOKEN_FILE=str(tmp / "token"),
                    SEEDANCE_STATE_DB=f"sqlite:///{tmp / 'state.db'}")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(no_torch(tmp / "no-torch")), *filter(None, [env.get("PYTHONPATH")])])
    log = tmp / "sidecar.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", str(NODE_SCRIPT), "sidecar"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S  # short waits: a dead sidecar fails fast
        while node("wait", env, "2").returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        yield NodeSidecar(port=port, job=node("job", env).stdout.strip(), token=token, env=env)
    finally:
        proc.terminate()
        proc.wait(30)
