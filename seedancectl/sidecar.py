"""`python -m seedancectl.sidecar ...` runs `seedancectl sidecar ...` (for scripts and benches)."""

from __future__ import annotations

import sys

from seedancectl.cli import main

if __name__ == "__main__":
    sys.argv = ["seedancectl", "sidecar", *sys.argv[1:]]
    main()
