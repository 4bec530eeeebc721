"""A live session on the sidecar's default settings, for the generalisation benchmark: the
sidecar.toml's job section says only ``mode = "auto"`` and ``tune = true`` (plus the listen
address, store, state database and token file it needs to run), and the job is any command
that attaches to the sidecar's URL."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from seedancectl._session import TOKEN, TrainingSession
from seedancectl._session_config import SessionConfig


def code_revision() -> str:
    """The commit the sidecar and the jobs run (with "+changes" when tracked files differ), so a
    result names the code it measured: each family's processes load the code as it is then."""
    root = Path(__file__).resolve().parents[1]
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":(exclude)bench/results")  # the results being written are no code change
    return head + ("+changes" if changed else "")


class DefaultSettingsSession(TrainingSession):
    """``seedancectl._session.TrainingSession`` with the default sidecar settings; the job is
    ``python <job_args(sidecar URL)>``, its log ``logs/train.log`` (where ``steps()`` reads
    its progress lines)."""

    def __init__(self, out: Path, *, job: str, job_args: Callable[[str], list[str]]) -> None:
        super().__init__(SessionConfig(out=out, job=job, tune=True, mode="auto"))
        self._job_args = job_args

    def sidecar_toml(self) -> str:
        def q(value: object) -> str:
            return json.dumps(str(value))
        return "\n".join([
            "# only what the sidecar needs to run here; every other setting is the default",
            f"listen = {q(f'127.0.0.1:{self.port}')}",
            f"store = {q(self.out / 'metrics.db')}",
            f"state_db = {q('sqlite:///' + str(self.out / 'state.db'))}",
            f"token_file = {q(self.token_file)}",
            "", f"[jobs.{q(self.config.job)}]", 'mode = "auto"', "tune = true", ""])

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(TOKEN + "\n", encoding="utf-8")
        self.token_file.chmod(0o600)
        self.config_file.write_text(self.sidecar_toml(), encoding="utf-8")
        self.start_sidecar()
        self.train = self._spawn("train", self._job_args(self.url))
        self.wait(lambda: True if (self.job_status() or {}).get("state") == "attached"
                  else None, self.config.start_timeout_s, "the job to attach",
                  watch=(self.train,))
