"""The deploy files as the tests read them: paths, the Kubernetes documents, the sidecar
settings each one ships, and the command of a probe pointed at another port."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from seedancectl._config import SidecarConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
IMAGE_CONFIG = DEPLOY / "sidecar.toml"
K8S_MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
SLURM = DEPLOY / "slurm"
NODE_SCRIPT = SLURM / "seedance-node.sh"
SBATCH = SLURM / "train.sbatch"
SLURM_CONFIG = SLURM / "sidecar.toml"
CONFIG_MOUNT = "/etc/seedance"
LOOPBACK_URL = re.compile(r"https?://(127\.0\.0\.1:\d+)(/\w+)")


def documents() -> list[dict[str, Any]]:
    """Every Kubernetes document in deploy/k8s, in file order."""
    return [doc for path in K8S_MANIFESTS for doc in yaml.safe_load_all(path.read_text())
            if doc is not None]


def the(kind: str) -> dict[str, Any]:
    found = [doc for doc in documents() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def pod_spec() -> dict[str, Any]:
    return the("Job")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def native_sidecar() -> dict[str, Any]:
    """The init container that runs for the pod's life (restartPolicy Always)."""
    found = [c for c in pod_spec().get("initContainers", []) if c.get("restartPolicy") == "Always"]
    assert len(found) == 1, f"expected one native sidecar, found {len(found)}"
    return found[0]


def trainer() -> dict[str, Any]:
    containers = pod_spec()["containers"]
    assert len(containers) == 1, "expected the trainer alone in containers"
    return containers[0]  # type: ignore[no-any-return]


def configmap_file(tmp_path: Path) -> Path:
    """The sidecar.toml the native sidecar reads: the ConfigMap mounted at /etc/seedance."""
    mounts = {m["name"]: m["mountPath"] for m in native_sidecar()["volumeMounts"]}
    volume = next(v for v in pod_spec()["volumes"] if mounts.get(v["name"]) == CONFIG_MOUNT)
    configmap = the("ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    path = tmp_path / "sidecar.toml"
    path.write_text(configmap["data"]["sidecar.toml"])
    return path


def settings(path: Path, **overrides: Any) -> SidecarConfig:
    """The file as the sidecar loads it, with no SEEDANCE_* variable of this process."""
    return load_config(path, overrides=overrides, environ={})


def probe_urls(command: list[str]) -> list[tuple[str, str]]:
    """The (HOST:PORT, path) pairs a probe's command asks for."""
    return LOOPBACK_URL.findall(" ".join(command))


def retarget(command: list[str], listen: str, port: int) -> list[str]:
    """The probe's command, asking 127.0.0.1:``port`` where it asked ``listen``."""
    return [part.replace(listen, f"127.0.0.1:{port}") for part in command]
