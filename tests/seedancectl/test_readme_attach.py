"""The README's attach snippet, run as it stands, around a model unlike the demo GPT (a small
BatchNorm CNN), against a real sidecar whose configuration says only ``mode = "auto"`` and
``tune = true``: the default settings must tune it, one knob at a time, and no trial may harm
the job. Real processes, loopback only; waits are bounded, no time is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# The job trains until the test has seen a trial judged (it then creates STOP in the job's
# folder), or for JOB_SECONDS at most: on a loaded box a trial takes longer, but no longer
# than its own 90 s budget after the first one starts (about 15 s in).
JOB_SECONDS = 600.0
STOP = "stop-training"

JOB_PRELUDE = """
import os
import time

import torch
from torch import nn

import tuner.job

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()


def batches():
    deadline = time.monotonic() + {seconds}
    while time.monotonic() < deadline and not os.path.exists({stop!r}):
        x = torch.randn(32, 3, 24, 24)
        yield x, (x.mean(dim=(1, 2, 3)) > 0).long()


loader = batches()
"""


def trial_changes(http: httpx.Client) -> list[dict[str, Any]]:
    changes = http.get("/v1/changes", params={"job": "my-llm"}).json()
    return [c for c in changes if c["source"] == "trial"]


def judged(trials: list[dict[str, Any]]) -> bool:
    return any(c["state"] in ("kept", "rolled_back", "failed") for c in trials)


def readme_snippet() -> str:
    """The python block under "Attach to your own training loop", verbatim."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Attach to your own training loop", 1)[1]
    found = re.search(r"~~~python\n(.*?)~~~", section, re.S)
    assert found, "the README has no python attach snippet"
    return found.group(1)


def test_the_readme_snippet_tunes_a_batchnorm_cnn_on_default_settings(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    snippet = readme_snippet()
    assert 'sidecar="http://127.0.0.1:4318"' in snippet and 'job="my-llm"' in snippet
    job_file = tmp_path / "job.py"
    job_file.write_text(JOB_PRELUDE.format(seconds=JOB_SECONDS, stop=STOP)
                        + snippet.replace("http://127.0.0.1:4318", url), encoding="utf-8")
    # store, state DB and token at their defaults under seedance-data/ (cwd is tmp_path):
    # the sidecar generates the token there, and the job, started in the same folder, finds
    # it there, as a newcomer's would
    config = tmp_path / "sidecar.toml"
    config.write_text(textwrap.dedent(f"""\
        listen = "127.0.0.1:{port}"
        nvml = "off"

        [approval]
        mode = "auto"

        [jobs."my-llm"]
        tune = true
        """))
    env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"}
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("sidecar", "job")}
    sidecar = subprocess.Popen([sys.executable, "-m", "seedancectl.sidecar", "--config",
                                str(config)], stdout=logs["sidecar"], stderr=subprocess.STDOUT,
                               env=env, cwd=tmp_path)
    job = None
    try:
        with httpx.Client(base_url=url, timeout=10.0) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and sidecar.poll() is None, "no sidecar"
                time.sleep(0.2)
            job = subprocess.Popen([sys.executable, str(job_file)], stdout=logs["job"],
                                   stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
            while job.poll() is None and not judged(changes := trial_changes(http)):
                time.sleep(1.0)
            (tmp_path / STOP).touch()
            assert job.wait(120) == 0, (tmp_path / "job.log").read_text()[-3000:]
            changes = trial_changes(http)
            knobs = http.get("/v1/jobs/my-llm/knobs").json()
    finally:
        for proc in (job, sidecar):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        for log in logs.values():
            log.close()
    assert judged(changes), (changes, (tmp_path / "sidecar.log").read_text()[-3000:])
    for change in changes:
        assert len(change["values"]) == 1, change  # one knob at a time
        if "fp16" in change["values"].values():  # no GradScaler given: a person decides
            assert change["state"] in ("proposed", "expired", "rejected"), change
    names = {k["name"] for k in knobs["knobs"]}
    assert {"threads", "micro_batch"} <= names
    # Sequential's children are the groups; the BatchNorm ones (1, 4) get no precision knob
    assert {"precision._0", "precision._3", "precision._8"} <= names
    assert not {"precision._1", "precision._4"} & names
    # what the job printed of a failed step would be a traceback: there is none
    assert "Traceback" not in (tmp_path / "job.log").read_text()
