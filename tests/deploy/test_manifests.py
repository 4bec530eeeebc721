"""deploy/k8s against the official Kubernetes schemas and against what the design needs, and
deploy/Dockerfile through Docker's own parser: an image without torch that runs the sidecar."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import tomllib
from pathlib import Path

import dockerfile
import kubernetes_validate
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from sqlalchemy.engine import make_url

from tests.deploy.files import (
    DEPLOY,
    DOCKERFILE,
    IMAGE_CONFIG,
    K8S_MANIFESTS,
    ROOT,
    SLURM_CONFIG,
    configmap_file,
    documents,
    native_sidecar,
    pod_spec,
    probe_urls,
    retarget,
    settings,
    trainer,
)
from tests.deploy.slurm_node import NodeSidecar
from tests.servers import free_port

NATIVE_SIDECARS_SINCE = "1.29.0"  # restartPolicy on an init container, on by default
SECRET_NAMES = re.compile(r"TOKEN|PASSWORD|STATE_DB|SECRET", re.IGNORECASE)
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


# ---- Kubernetes ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", [NATIVE_SIDECARS_SINCE, kubernetes_validate.latest_version()])
def test_every_document_is_valid_kubernetes(version: str) -> None:
    """Strict: a misspelt or misplaced field is an error, not a field Kubernetes drops."""
    assert K8S_MANIFESTS and documents()
    for doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_sidecar_is_a_native_sidecar_on_loopback(tmp_path: Path) -> None:
    sidecar = native_sidecar()
    config = settings(configmap_file(tmp_path))
    assert config.loopback, f"listen = {config.listen!r} is reachable from outside the pod"
    assert "ports" not in sidecar, "a loopback listener has no port to declare"
    assert {"startupProbe", "readinessProbe"} <= sidecar.keys()
    for probe in PROBES:
        command = sidecar[probe]["exec"]["command"]  # kubelet's httpGet would ask the pod IP
        assert probe_urls(command) and {hp for hp, _ in probe_urls(command)} == {config.listen}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= sidecar["resources"][kind].keys()


def test_the_trainer_attaches_to_its_sidecar_under_the_tuned_name(tmp_path: Path) -> None:
    config = settings(configmap_file(tmp_path))
    args = dict(zip(trainer()["args"][::2], trainer()["args"][1::2], strict=True))
    assert args["--sidecar"] == f"http://{config.listen}"
    assert args["--job"] == config.job and config.job_config(config.job).tune


def test_token_and_password_come_from_the_secret(tmp_path: Path) -> None:
    assert "Secret" not in {doc["kind"] for doc in documents()}, \
        "the Secret is created apart (deploy/README.md), its values never in a manifest"
    pod = pod_spec()
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        for var in container.get("env", []):
            if SECRET_NAMES.search(var["name"]):
                assert "value" not in var and "secretKeyRef" in var["valueFrom"], var["name"]
    config = settings(configmap_file(tmp_path))
    state = make_url(config.state_db)
    assert state.drivername == "postgresql+psycopg" and state.password is None
    sidecar_env = {v["name"]: v for v in native_sidecar().get("env", [])}
    trainer_env = {v["name"]: v for v in trainer().get("env", [])}
    password = sidecar_env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]  # libpq reads it
    token = trainer_env["SEEDANCE_TOKEN"]["valueFrom"]["secretKeyRef"]
    # the sidecar's token_file is the same key of the same Secret, mounted as a file
    mounts = {m["name"]: Path(m["mountPath"]) for m in native_sidecar()["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if "secret" in v
                  and config.token_file is not None
                  and config.token_file.parent == mounts.get(v["name"]))
    files = {item["path"]: item["key"] for item in volume["secret"]["items"]}
    assert volume["secret"]["secretName"] == token["name"] == password["name"]
    assert config.token_file is not None and files[config.token_file.name] == token["key"]
    # the how-to creates exactly that Secret with those keys
    howto = (DEPLOY / "README.md").read_text()
    created = re.search(r"kubectl create secret generic ([\w-]+)(.*?)(?:\n\n|$)", howto, re.S)
    assert created is not None and created.group(1) == token["name"]
    keys = set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", created.group(2)))
    assert {token["key"], password["key"]} <= keys


@pytest.mark.parametrize("which", ["k8s", "slurm"])
def test_fleet_configs_load_with_a_postgresql_state_db(which: str, tmp_path: Path) -> None:
    path = configmap_file(tmp_path) if which == "k8s" else SLURM_CONFIG
    state = make_url(settings(path).state_db)
    assert state.get_backend_name() == "postgresql" and state.drivername == "postgresql+psycopg"
    assert state.password is None, "the password comes from libpq's environment, not the URL"


@pytest.mark.integration
def test_the_probes_answer_only_when_the_sidecar_does(node_sidecar: NodeSidecar,
                                                       tmp_path: Path) -> None:
    """Each exec probe of the manifest and the image's HEALTHCHECK, run as kubelet and Docker
    run them (inside the sidecar's network namespace), at a live sidecar and at a dead port."""
    listen = settings(configmap_file(tmp_path)).listen
    commands = [native_sidecar()[probe]["exec"]["command"] for probe in PROBES]
    commands.append(healthcheck())
    dead = free_port()
    for command in commands:
        live = subprocess.run(retarget(command, listen, node_sidecar.port), capture_output=True,
                              text=True, timeout=30)
        assert live.returncode == 0, f"{command}: {live.stderr[-500:]}"
        gone = subprocess.run(retarget(command, listen, dead), capture_output=True, timeout=30)
        assert gone.returncode != 0, command


# ---- the image ------------------------------------------------------------------------------

def instructions(cmd: str) -> list[dockerfile.Command]:
    return [c for c in dockerfile.parse_file(str(DOCKERFILE)) if c.cmd == cmd.upper()]


def healthcheck() -> list[str]:
    (check,) = instructions("healthcheck")
    assert check.json and check.value[0] == "CMD", "exec form: no shell in the check"
    return list(check.value[1:])


def test_the_image_runs_the_sidecar_as_an_unprivileged_user() -> None:
    args = {c.value[0].split("=", 1)[0]: c.value[0].split("=", 1)[1]
            for c in instructions("arg") if "=" in c.value[0]}
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], c.value[0])
             for c in instructions("from")]
    assert bases and set(bases) == {"python:3.11-slim"}
    final = dockerfile.parse_file(str(DOCKERFILE))
    final = final[max(i for i, c in enumerate(final) if c.cmd == "FROM"):]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (entrypoint,) = instructions("entrypoint")
    assert entrypoint.json and entrypoint.value[:3] == ("seedancectl", "sidecar", "--config")
    copied = {c.value[-1]: c.value[0] for c in final if c.cmd == "COPY"}
    assert ROOT / copied[entrypoint.value[3]] == IMAGE_CONFIG


def test_the_image_loads_the_json_reader_its_build_stage_built_ahead() -> None:
    """No compiler in the image: the build stage (which has one) builds the C reader into a
    folder the final stage copies and names as the sidecar's cache."""
    commands = dockerfile.parse_file(str(DOCKERFILE))
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    build, final = commands[:last_from], commands[last_from:]
    runs = " ".join(" ".join(c.value) for c in build if c.cmd == "RUN")
    built_into = re.search(r"SEEDANCE_CACHE_DIR=(\S+) python -m collectors._native", runs)
    assert built_into and "gcc" in runs, runs
    env = {k: v for c in final if c.cmd == "ENV" for k, v in zip(c.value[::2], c.value[1::2],
                                                                  strict=True)}
    copied = [c.value for c in final if c.cmd == "COPY" and "--from=build" in c.flags]
    assert [built_into.group(1), env["SEEDANCE_CACHE_DIR"]] in [list(v) for v in copied]
    assert not any("gcc" in " ".join(c.value) for c in final if c.cmd == "RUN")


def test_the_healthcheck_asks_the_configured_listener() -> None:
    config = settings(IMAGE_CONFIG)
    assert config.loopback
    assert probe_urls(healthcheck()) == [(config.listen, "/healthz")]


def installed_extras() -> set[str]:
    """The extras of the project both stages install: `.[...]` and `seedance-tuner[...]`."""
    runs = " ".join(" ".join(c.value) for c in instructions("run"))
    built = re.findall(r"\"\.\[([\w,-]+)\]\"", runs)
    installed = re.findall(r"\"seedance-tuner\[([\w,-]+)\]\"", runs)
    assert len(built) == len(installed) == 1 and built == installed, runs
    return set(built[0].split(","))


def requirement_closure(extras: set[str]) -> set[str]:
    """Every distribution the project with ``extras`` pulls in, through the installed packages'
    own metadata (markers evaluated here; the image's platform is this one's)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = canonicalize_name(project["name"])

    def of_project(wanted: set[str]) -> list[Requirement]:
        lines = [*project["dependencies"],
                 *(r for e in wanted for r in project["optional-dependencies"][e])]
        return [Requirement(r) for r in lines]

    todo: list[tuple[Requirement, str]] = [(r, "") for r in of_project(extras)]
    seen: set[tuple[str, str]] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name == own:  # all = ["seedance-tuner[job,test]"]
            todo += [(r, "") for r in of_project(set(req.extras))]
            continue
        for wanted in req.extras or {""}:
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            requires = importlib.metadata.distribution(req.name).requires or []
            todo += [(Requirement(line), wanted) for line in requires]
    return {name for name, _ in seen}


def test_the_image_installs_no_torch() -> None:
    extras = installed_extras()
    assert "postgres" in extras, "the fleet's state DB needs psycopg"
    assert "psycopg" in requirement_closure(extras)
    assert "torch" in requirement_closure({"job"}), "the closure must see torch where it is"
    assert "torch" not in requirement_closure(extras)


def test_the_build_context_holds_what_the_build_reads() -> None:
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    copied = {c.value[0] for c in instructions("copy") if not c.flags and c.value[0] != "."}
    needed = {"pyproject.toml", "README.md", *(p.rstrip("*") for p in packages), *copied}
    assert needed <= allowed, f"left out of the build context: {sorted(needed - allowed)}"

