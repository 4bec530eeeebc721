"""Shared fixtures: real servers on loopback."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import PROMETHEUS


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    if not os.access(PROMETHEUS, os.X_OK):
        reason = (f"no Prometheus server at {PROMETHEUS}; "
                  "install it with scripts/install-test-deps.sh (Debian package 'prometheus')")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return PROMETHEUS


@pytest.fixture
def prometheus_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="seedance-prometheus-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


