"""`python -m tuner.sidecar ...` runs `seedancectl sidecar ...` (for scripts and benches)."""

from __future__ import annotations

import sys

from tuner.cli import main

if __name__ == "__main__":
    sys.argv = ["seedancectl", "sidecar", *sys.argv[1:]]
    main()
