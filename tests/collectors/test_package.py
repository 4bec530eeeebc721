"""The collectors facade: every public name resolves, and importing it stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import collectors


def test_every_exported_name_resolves() -> None:
    for name in collectors.__all__:
        assert getattr(collectors, name) is not None


def test_importing_the_package_loads_neither_torch_nor_the_server_stack() -> None:
    code = ("import sys, collectors; "
            "print(sorted(m for m in ('torch', 'pandas', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


BLOCK_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked for this test")
        return None
sys.meta_path.insert(0, NoTorch())
"""


def test_the_sidecar_runs_without_torch() -> None:
    """Make torch unimportable: the sidecar, policies and the CLI must still load and build."""
    code = BLOCK_TORCH + (
        "import seedancectl._sidecar, seedancectl.cli, policies, policies.detectors, "
        "collectors._nvml, dashboards.web, dashboards.report\n"
        "from seedancectl._config import SidecarConfig\n"
        "seedancectl._sidecar.Sidecar(SidecarConfig(nvml='off'), environ={}).app()\n"
        "print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_tuner_facade_names_resolve_without_torch() -> None:
    code = ("import sys, tuner; [getattr(tuner, n) for n in tuner.__all__]; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_started_sidecar_leaves_scipy_stats_and_matplotlib_unloaded(tmp_path: Path) -> None:
    """Each costs every sidecar of a fleet tens of MiB (scipy.stats 47, matplotlib 31): the
    measurement takes its quantiles from scipy.special, and plots load when one is drawn."""
    code = (
        "import sys, time\n"
        "from fastapi.testclient import TestClient\n"
        "from seedancectl._config import SidecarConfig\n"
        "from seedancectl._sidecar import Sidecar\n"
        f"config = SidecarConfig(job='j', store={str(tmp_path / 'm.db')!r}, nvml='off',\n"
        f"    state_db='sqlite:///{tmp_path / 's.db'}', jobs={{'j': {{'tune': True}}}})\n"
        "with TestClient(Sidecar(config, environ={}).app()) as client:\n"
        "    assert client.get('/readyz').status_code == 200\n"
        "    assert client.get('/v1/status').status_code == 200\n"
        "    assert client.get('/v1/fleet').status_code == 200\n"
        "print(sorted(m for m in ('scipy.stats', 'matplotlib') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
