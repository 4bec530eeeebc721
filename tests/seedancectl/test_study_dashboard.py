"""`seedancectl study dashboard`: optuna-dashboard served on a real state database (a SQLite
file, then the session's PostgreSQL) holding a real Optuna study, fetched over HTTP on loopback
from a separate process, then stopped."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import httpx
import optuna
import pytest
from typer.testing import CliRunner

from seedancectl._state_schema import migrate
from seedancectl.cli import app

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STUDY = "seedance:train"
"""The study the sidecar names for job ``train`` when its config tunes it."""
START_S = 60.0


def write_config(tmp_path: Path, state_db_url: str) -> Path:
    path = tmp_path / "seedance.toml"
    path.write_text(f'state_db = "{state_db_url}"\n\n[jobs.train]\ntune = true\n')
    return path


@pytest.fixture
def study_db(state_db_url: str) -> str:
    """A state database as the sidecar leaves it, with a study of three finished trials."""
    migrate(state_db_url)
    study = optuna.create_study(study_name=STUDY, storage=state_db_url, direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda t: t.suggest_int("micro_batch", 1, 8) * 100.0, n_trials=3)
    return state_db_url


def test_dashboard_serves_the_jobs_study(study_db: str, tmp_path: Path) -> None:
    config = write_config(tmp_path, study_db)
    proc = subprocess.Popen(
        [sys.executable, "-m", "seedancectl.cli", "study", "dashboard", "train", "-c",
         str(config)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"})
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_S)
        assert ready, f"no URL printed within {START_S:g} s"
        line = proc.stdout.readline()  # printed once the server listens
        found = re.search(r"at (http://127\.0\.0\.1:(\d+))(/dashboard/studies/(\d+))", line)
        assert found, f"no URL in {line!r} (rc {proc.poll()})"
        base, _, path, study_id = found.groups()
        assert "password" not in line
        with httpx.Client(base_url=base, timeout=10) as http:
            page = http.get(path)
            assert page.status_code == 200 and "<html" in page.text.lower()
            studies = http.get("/api/studies").json()["study_summaries"]
            assert [s["study_name"] for s in studies] == [STUDY]
            assert studies[0]["study_id"] == int(study_id)
            detail = http.get(f"/api/studies/{study_id}", params={"after": 0}).json()
            assert len(detail["trials"]) == 3
            assert {p["name"] for t in detail["trials"] for p in t["params"]} == {"micro_batch"}
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode is not None


def test_unknown_job_is_one_line_with_the_studies_there(study_db: str, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'state_db = "{study_db}"\n\n[jobs.trian]\ntune = true\n')
    result = CliRunner().invoke(app, ["study", "dashboard", "trian", "-c", str(config)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "no study 'seedance:trian'" in lines[0] and STUDY in lines[0]

    untuned = CliRunner().invoke(app, ["study", "dashboard", "other", "-c", str(config)],
                                 env={"COLUMNS": "200"})
    assert untuned.exit_code == 2 and "not tuned" in untuned.output
    assert len(untuned.output.strip().splitlines()) == 1


def test_missing_state_db_is_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, f"sqlite:///{tmp_path / 'absent.db'}")
    result = CliRunner().invoke(app, ["study", "dashboard", "-c", str(config)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "no state database here" in result.output
