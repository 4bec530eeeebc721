"""`seedancectl`: the operator's command line.

Every user mistake ends in one red line and exit code 2, never a traceback: commands raise
SeedanceError subclasses and the app's group (``_app``) turns them into that line. Commands on
local files are in ``_local``, those that talk to a running sidecar in ``_remote``, those that
read the fleet's shared state database in ``_fleet``.
"""

from __future__ import annotations

from seedancectl.cli import (  # noqa: F401 (their commands register on import)
    _fleet,
    _local,
    _remote,
    _study,
)
from seedancectl.cli._app import app

__all__ = ["app", "main"]


def main() -> None:
    """Entry point: one line and exit 2 for a user mistake (``_Group`` and click see to it)."""
    app()
