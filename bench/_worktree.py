"""A git worktree of another revision, for benches that run old code against new in one run."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")

ROOT = Path(__file__).resolve().parents[1]


def worktree(rev: str, prefix: str) -> Path:
    """Check ``rev`` out into a new temporary folder (``git worktree remove`` it after)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT,
                   check=True, capture_output=True)
    return path


def base_and_new(base: str, prefix: str, rounds: int, run: Callable[[int, str, Path], _T]
                 ) -> tuple[str, dict[str, list[_T]]]:
    """``base`` as a short revision, and ``run(round, arm, tree)`` of each round, the arms
    alternating (base on a worktree of ``base``, then new on this tree); the worktree goes
    after, whatever happens."""
    rev = subprocess.run(["git", "rev-parse", "--short", base], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = worktree(rev, prefix)
    runs: dict[str, list[_T]] = {"base": [], "new": []}
    try:
        for r in range(rounds):
            for arm, where in (("base", tree), ("new", ROOT)):
                runs[arm].append(run(r, arm, where))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                       check=False, capture_output=True)
    return rev, runs
