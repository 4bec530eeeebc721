"""Rendezvous for the multi-rank tests: a file, not a TCP port.

A free port picked before ``mp.spawn`` can be taken by another process (another test, the
box's other jobs) before rank 0 binds it; a file in the test's own directory cannot.
"""

from __future__ import annotations

from pathlib import Path


def file_rendezvous(directory: str | Path) -> str:
    """An ``init_method`` URL for ``torch.distributed.init_process_group`` in ``directory``
    (which must be empty of a previous group's file: use a fresh directory per group)."""
    return (Path(directory).resolve() / "rendezvous").as_uri()
