"""A Slurm step on one node, as seedance-node.sh sees it: its environment, and the script run
in it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.files import NODE_SCRIPT

READY_TIMEOUT_S = 90


@dataclass(frozen=True)
class NodeSidecar:
    """A node's sidecar started by seedance-node.sh: its port, its job and the job's token."""

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
    """``seedance-node.sh COMMAND ARGS`` in ``env``."""
    return subprocess.run(["bash", str(NODE_SCRIPT), command, *args], env=env,
                          capture_output=True, text=True, timeout=READY_TIMEOUT_S + 30)
