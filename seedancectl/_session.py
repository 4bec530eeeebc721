"""A live tuning session: a real sidecar process tunes the real demo training job on CPU.

``TrainingSession`` starts ``seedancectl sidecar`` (a subprocess, with a generated TOML
configuration) and ``python -m workloads.train --sidecar URL`` (a subprocess that holds a knob
lease through ``tuner.job``), and talks to the sidecar only over its HTTP API, as an operator
would. ``run_training_session`` is the whole story the demo tells: the search runs N live
trials over precision x micro_batch x threads in approval mode ``auto``, then it is paused and
the config it kept is re-measured against the job's first baseline with the controller's own
interleaved windows (baseline and kept alternate, each a fresh config version).

Nothing here decides anything: the verdicts are the rollout controller's (``Change.comparison``)
and the search's; this module starts processes, waits and collects.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from seedancectl._api_client import SidecarClient, SidecarError
from seedancectl._api_types import ChangeDetailJSON, ChangeJSON, LeaseJobJSON
from seedancectl._session_config import SessionConfig, TuningSessionError
from seedancectl._session_result import SessionResult, Trial
from tuner import TOKEN_ENV, KnobValue

T = TypeVar("T")
_PROGRESS = re.compile(r"^step (?P<step>\d+) loss (?P<loss>\S+) ")

SEARCH_DONE = "the search tried every single move from the kept config"
FINAL_STATES = frozenset({"kept", "rolled_back", "rejected", "expired", "failed",
                          "manual_intervention_required"})
ACTIVE_STATES = frozenset({"proposed", "approved", "applying", "observing"})
TOKEN = "session-token-do-not-reuse"  # loopback only; the session's own sidecar


class TrainingSession:
    """The sidecar and the demo job as two processes, and an operator's view of them.

    A context manager: ``start()`` on enter, both processes stopped on exit (SIGINT, then
    SIGKILL after ``timeout_s``). Logs go to ``out/logs/{sidecar,train}.log``. ``api`` is the
    sidecar's operator API (each call bounded by ``api_timeout_s``), holding the session's token.
    """

    def __init__(self, config: SessionConfig, *, port: int | None = None,
                 api_timeout_s: float = 10.0) -> None:
        self.config = config
        self.out = config.out
        self.logs = self.out / "logs"
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = self.out / "token"
        self.config_file = self.out / "sidecar.toml"
        self.sidecar: subprocess.Popen[bytes] | None = None
        self.train: subprocess.Popen[bytes] | None = None
        self.api = SidecarClient(self.url, token=TOKEN, timeout_s=api_timeout_s)

    # ---- processes ---------------------------------------------------------------------------

    def __enter__(self) -> TrainingSession:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Sidecar first (until ready), then the job (until it holds its lease)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(TOKEN + "\n", encoding="utf-8")
        self.token_file.chmod(0o600)
        self.config_file.write_text(self.config.sidecar_toml(
            listen=f"127.0.0.1:{self.port}", token_file=self.token_file), encoding="utf-8")
        self.start_sidecar()
        if self.config.tune:
            self.set_tuning("pause")
        self.train = self._spawn("train", self.config.train_args(self.url))
        self.wait(lambda: s if (s := self.job_status()) and s["state"] == "attached" else None,
                  self.config.start_timeout_s, "the job to attach", watch=(self.train,))
        self.wait_steps(self.config.warm_steps, self.config.start_timeout_s)
        if self.config.tune:
            self.set_tuning("resume")

    def start_sidecar(self) -> None:
        """(Re)start the sidecar process on the session's port, store and state database."""
        self.sidecar = self._spawn("sidecar", ["-m", "seedancectl.sidecar", "--config",
                                               str(self.config_file)])
        self.wait(self._ready, self.config.start_timeout_s, "the sidecar to be ready",
                  watch=(self.sidecar,))

    def kill_sidecar(self) -> None:
        """SIGKILL the sidecar: no shutdown, no goodbye to the job."""
        _kill(self.sidecar)

    def kill_job(self) -> None:
        """SIGKILL the training job mid-step."""
        _kill(self.train)

    def close(self) -> None:
        """Stop the job, then the sidecar; release the API client (idempotent)."""
        for proc in (self.train, self.sidecar):
            stop_process(proc)
        self.api.close()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: TOKEN,  # the job's lease
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                              os.environ.get("PYTHONPATH", "")])}
        try:
            return subprocess.Popen([sys.executable, *args], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=self.out)
        finally:
            log.close()

    def _ready(self) -> bool | None:
        try:
            return self.api.readiness()["ready"] or None
        except SidecarError:
            return None

    # ---- the operator's view -----------------------------------------------------------------

    def wait(self, found: Callable[[], T | None], timeout_s: float, what: str, *,
             watch: Sequence[subprocess.Popen[bytes] | None] = (), poll_s: float = 0.2) -> T:
        """Poll ``found`` until it returns something; TuningSessionError after ``timeout_s`` or when
        a watched process exits (bounded waits, not timing assertions). A call the sidecar did
        not answer counts as nothing found yet; an answer that is an error is raised."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = found()
            except SidecarError as exc:
                if exc.status is not None:
                    raise
                value = None
            if value is not None:
                return value
            for proc in watch:
                if proc is not None and proc.poll() is not None:
                    raise TuningSessionError(f"waiting for {what}: a process exited with code "
                                       f"{proc.returncode}; see {self.logs}")
            if time.monotonic() > deadline:
                raise TuningSessionError(f"{what} did not happen within {timeout_s:g} s; "
                                   f"see {self.logs}")
            time.sleep(poll_s)

    def job_status(self) -> LeaseJobJSON | None:
        """The lease registry's view of the job (None before it attaches)."""
        found = [j for j in self.api.jobs() if j["job"] == self.config.job]
        return found[0] if found else None

    def baseline(self) -> dict[str, KnobValue]:
        """The job's baseline config's values (the last kept)."""
        return dict(self.api.knobs(self.config.job)["baseline"]["values"])

    def changes(self, *, source: str | None = None) -> list[ChangeJSON]:
        """The job's changes, oldest first; with ``source``, only those of that source."""
        found = self.api.changes(job=self.config.job)
        return [c for c in found if source is None or c["source"] == source]

    def change(self, change_id: str) -> ChangeDetailJSON:
        """One change with its audit trail."""
        return self.api.change(change_id)

    def trials(self) -> list[Trial]:
        """The search's changes that reached a verdict, oldest first."""
        return [Trial.from_change(c) for c in self.changes(source="trial")
                if c["state"] in FINAL_STATES]

    def wait_change(self, change_id: str, states: Sequence[str], timeout_s: float
                    ) -> ChangeDetailJSON:
        """Until the change is in one of ``states``; the change then."""
        return self.wait(lambda: (c if (c := self.change(change_id))["state"] in states
                                  else None),
                         timeout_s, f"change {change_id} to be {'|'.join(states)}",
                         watch=(self.sidecar,), poll_s=0.2)

    def search_done(self) -> bool:
        """The search tried every single move from the kept config and nothing is active."""
        moves_left = self.api.knobs(self.config.job)["moves_left"]
        return moves_left == 0 and not [c for c in self.changes()
                                        if c["state"] in ACTIVE_STATES]

    def set_tuning(self, action: str) -> None:
        """``pause`` or ``resume`` the job's search."""
        self.api.set_tuning(self.config.job, action, by="session")

    def stop_tuning(self, timeout_s: float) -> None:
        """Pause the search and roll back the change in flight (an operator's config rollback:
        the trial is told what its windows measured so far), then wait until none is active."""
        self.set_tuning("pause")
        for change in [c for c in self.changes() if c["state"] in ACTIVE_STATES]:
            try:
                self.api.rollback(self.config.job, by="session", reason="tuning session ends",
                                  change_id=change["id"])
            except SidecarError as exc:
                if exc.status != 409:  # 409: it ended meanwhile
                    raise
        self.wait_idle(timeout_s)

    def wait_idle(self, timeout_s: float) -> None:
        """Until no change of the job is active (the one in flight ends by itself)."""
        self.wait(lambda: True if not [c for c in self.changes()
                                       if c["state"] in ACTIVE_STATES] else None,
                  timeout_s, "the change in flight to end", watch=(self.sidecar,), poll_s=0.5)

    def propose(self, values: Mapping[str, KnobValue], reason: str) -> ChangeJSON:
        """An operator's change; approved at once when auto mode has not done it already."""
        change = self.api.propose(self.config.job, values, by="session", reason=reason)
        if change["state"] == "proposed":
            change = self.api.approve(change["id"], by="session", comment=reason)
        return change

    def remeasure(self, baseline: Mapping[str, KnobValue], timeout_s: float) -> Trial:
        """The controller's interleaved A/B of ``baseline`` (candidate arm) against the job's
        current baseline (the kept config); tuning must be paused."""
        change = self.propose(baseline, "re-measure the first baseline against the kept "
                                        "config")
        return Trial.from_change(self.wait_change(change["id"], sorted(FINAL_STATES),
                                                  timeout_s))

    def steps(self) -> list[tuple[int, float]]:
        """(step, loss) of the job's progress lines (every 10th step), oldest first."""
        found = []
        for line in self.log_lines():
            match = _PROGRESS.match(line)
            if match:
                found.append((int(match["step"]), float(match["loss"])))
        return found

    def wait_steps(self, n: int, timeout_s: float) -> int:
        """Until the job printed a progress line at step ``n`` or later; that step."""
        return self.wait(lambda: (s[-1][0] if (s := self.steps()) and s[-1][0] >= n
                                  else None),
                         timeout_s, f"the job to train {n} steps", watch=(self.train,),
                         poll_s=0.5)

    def log_lines(self, name: str = "train") -> list[str]:
        """The lines of a process's log (``train`` or ``sidecar``) so far."""
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []


def run_training_session(config: SessionConfig, *, timeout_s: float = 900.0,
                         on_progress: Callable[[list[Trial]], None] | None = None
                         ) -> SessionResult:
    """Tune the demo job for ``config.trials`` measured trials (fewer when the search has
    tried every single move from the kept config first), stop the search, re-measure the kept
    config against the first baseline; everything within ``timeout_s``."""
    started = time.monotonic()

    def left_s() -> float:
        return max(1.0, timeout_s - (time.monotonic() - started))

    with TrainingSession(config) as session:
        baseline = session.baseline()
        reported: list[int] = [-1]

        def enough() -> list[Trial] | None:
            trials = session.trials()
            if on_progress is not None and len(trials) != reported[0]:
                reported[0] = len(trials)
                on_progress(trials)
            if len([t for t in trials if t.measured]) >= config.trials:
                return trials
            return trials if session.search_done() else None

        session.wait(enough, left_s(), f"{config.trials} measured trials",
                     watch=(session.sidecar, session.train), poll_s=1.0)
        notes = []
        if session.search_done():
            notes.append(SEARCH_DONE)
        session.stop_tuning(left_s())
        trials = session.trials()
        kept = session.baseline()
        remeasure = None
        if kept != baseline:
            remeasure = session.remeasure(baseline, left_s())
        else:
            notes.append("no trial was kept: the kept config is the first baseline")
        return SessionResult(baseline=baseline, kept=kept, trials=trials,
                             changes=session.changes(), remeasure=remeasure,
                             wall_s=time.monotonic() - started, notes=notes)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 15.0, *,
                 group: bool = False) -> None:
    """SIGINT, then SIGKILL if it does not end in time; with ``group``, to the process group
    the process leads (the serving job and its replicas)."""
    if proc is None:
        return

    def send(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        except ProcessLookupError:
            pass

    if proc.poll() is None:
        send(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()
    if group:  # a replica that outlived its launcher goes too
        send(signal.SIGKILL)


__all__ = ["ACTIVE_STATES", "FINAL_STATES", "SEARCH_DONE", "TOKEN", "TrainingSession",
           "run_training_session", "stop_process"]
