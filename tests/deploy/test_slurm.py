"""deploy/slurm: the scripts parse, every node's job has a name no other sidecar uses, and a
node's sidecar started by seedance-node.sh tunes that job with the Slurm job's token."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from tests.deploy.files import NODE_SCRIPT, SBATCH, settings
from tests.deploy.slurm_node import NodeSidecar, node, slurm_env
from tests.servers import free_port

KNOBS = [{"name": "threads", "default": 2, "low": 1, "high": 8, "integer": True}]


@pytest.mark.parametrize("script", [SBATCH, NODE_SCRIPT])
def test_the_scripts_parse(script: Path) -> None:
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_the_ranks_attach_where_the_node_script_says() -> None:
    """The sbatch script names no job and no port itself: both come from seedance-node.sh on
    each node, the same answers its sidecar was started with."""
    text = SBATCH.read_text()
    assert '--job "$("$2" job)" --sidecar "$("$2" url)"' in text
    assert '"$node" sidecar' in text and '"$node" wait' in text


def test_job_names_are_unique_per_slurm_job_and_node(tmp_path: Path) -> None:
    names = {(job_id, host): node("job", slurm_env(tmp_path, job_id=job_id, node=host))
             for job_id in ("90210", "90211") for host in ("gpu-017", "gpu-018")}
    assert all(done.returncode == 0 for done in names.values())
    assert len({done.stdout for done in names.values()}) == 4
    odd = node("job", {**slurm_env(tmp_path, node="gpu 017/a"), "SLURM_JOB_NAME": "my job"})
    assert odd.stdout.strip() == "my_job-90210-gpu_017_a"  # a path segment of the lease API


def test_a_port_per_slurm_job(tmp_path: Path) -> None:
    urls = {job_id: node("url", slurm_env(tmp_path, job_id=job_id)).stdout.strip()
            for job_id in ("90210", "90211")}
    assert urls["90210"] != urls["90211"]
    assert all(url.startswith("http://127.0.0.1:") for url in urls.values())
    assert node("url", slurm_env(tmp_path, node="gpu-018")).stdout.strip() == urls["90210"]


def test_the_node_config_tunes_the_node_job(tmp_path: Path) -> None:
    env = slurm_env(tmp_path)
    written = node("config", env)
    assert written.returncode == 0, written.stderr
    job = node("job", env).stdout.strip()
    config = settings(Path(written.stdout.strip()), job=job)
    assert config.job_config(job).tune
    assert config.state_db.startswith("postgresql+psycopg://")


def test_the_sidecar_needs_the_job_token(tmp_path: Path) -> None:
    refused = node("sidecar", slurm_env(tmp_path))
    assert refused.returncode != 0 and "SEEDANCE_TOKEN_FILE" in refused.stderr


@pytest.mark.integration
def test_the_node_sidecar_tunes_its_job_with_the_slurm_token(node_sidecar: NodeSidecar) -> None:
    url = f"http://127.0.0.1:{node_sidecar.port}"
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/readyz").json()["job"] == node_sidecar.job
        body = {"kind": "train", "knobs": KNOBS, "baseline": {}, "lease_ttl_s": 60}
        attach = f"/v1/jobs/{node_sidecar.job}/attach"
        wrong = http.post(attach, json=body, headers={"Authorization": "Bearer not-the-token"})
        assert wrong.status_code == 403
        right = http.post(attach, json=body,
                          headers={"Authorization": f"Bearer {node_sidecar.token}"})
        assert right.status_code == 200, right.text
        jobs = {j["job"]: j for j in http.get("/v1/status").json()["jobs"]}
    assert jobs[node_sidecar.job]["tuning"] == "running"


def test_wait_gives_up_on_a_sidecar_that_never_answers(tmp_path: Path) -> None:
    gave_up = node("wait", slurm_env(tmp_path, SIDECAR_PORT=str(free_port())), "1")
    assert gave_up.returncode == 1 and "was not ready within 1 s" in gave_up.stderr
