"""A git worktree of another revision, for benches that run old code against new in one run."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree(rev: str, prefix: str) -> Path:
    """Check ``rev`` out into a new temporary folder (``git worktree remove`` it after)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT,
                   check=True, capture_output=True)
    return path
