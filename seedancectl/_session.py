"""A live tuning session: a real sidecar process tunes the real demo training job on CPU.

``TrainingSession`` starts ``seedancectl sidecar`` (a subprocess, with a generated TOML
configuration) and ``python -m workloads.train --sidecar URL`` (a subprocess that holds a knob
lease through ``tuner.client``), and talks to the sidecar only over its HTTP API, as an operator
would. ``run_training_session`` is the whole story the demo tells: the search runs N live
trials over precision x micro_batch x threads in approval mode ``auto``, then it is paused and
the config it kept is re-measured against the job's first baseline with the controller's own
interleaved windows (baseline and kept alternate, each a fresh config version).

Nothing here decides anything: the verdicts are the rollout controller's (``Change.comparison``)
and the search's; this module starts processes, waits and collects.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from collectors import SeedanceError
from tuner import TOKEN_ENV

T = TypeVar("T")
_PROGRESS = re.compile(r"^step (?P<step>\d+) loss (?P<loss>\S+) ")

SEARCH_DONE = "the search tried every single move from the kept config"
FINAL_STATES = frozenset({"kept", "rolled_back", "rejected", "expired", "failed",
                          "manual_intervention_required"})
ACTIVE_STATES = frozenset({"proposed", "approved", "applying", "observing"})
TOKEN = "session-token-do-not-reuse"  # loopback only; the session's own sidecar


class TuningSessionError(SeedanceError):
    """The tuning session could not reach the state it waited for."""


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """One session: the demo job's own settings and a sidecar on its DEFAULT tuning settings.

    The sidecar's configuration file says where it listens and keeps its files, the approval
    ``mode`` and ``tune``, nothing else: the measurement, the knobs searched and their bounds
    are the sidecar's defaults, as a new user would have them. A test that drills a failure
    may add top-level sidecar settings (``sidecar_settings``, e.g. a short ``lease_ttl_s``) or
    rollout settings (``rollout_settings``); the demo adds none.

    No change starts before the job trained ``warm_steps`` steps (the search is paused until
    then). ``loss_scale`` / ``loss_scale_growth_interval`` (with ``grad_scaler``) give the job a
    GradScaler whose scale has backed off and may not grow: the incident set-up."""

    out: Path
    job: str = "demo-train"
    tune: bool = True
    mode: str = "auto"
    trials: int = 8
    global_batch: int = 8
    micro_batch: int = 8
    seq_len: int = 32
    threads: int = 1
    warm_steps: int = 30
    lease_ttl_s: float | None = None
    sidecar_settings: Mapping[str, Any] = field(default_factory=dict)
    rollout_settings: Mapping[str, Any] = field(default_factory=dict)
    grad_scaler: bool = False
    loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "suggest", "off"):
            raise TuningSessionError(f"SessionConfig.mode must be auto, suggest or off, "
                               f"got {self.mode!r}")
        for name in ("trials", "global_batch", "micro_batch", "seq_len", "threads"):
            if getattr(self, name) < 1:
                raise TuningSessionError(f"SessionConfig.{name} must be >= 1")
        if self.global_batch % self.micro_batch:
            raise TuningSessionError("SessionConfig.global_batch must be a multiple of micro_batch")
        for name in ("start_timeout_s", "loss_scale"):
            if not getattr(self, name) > 0:
                raise TuningSessionError(f"SessionConfig.{name} must be > 0")
        if self.lease_ttl_s is not None and not self.lease_ttl_s > 0:
            raise TuningSessionError("SessionConfig.lease_ttl_s must be > 0")

    @property
    def study(self) -> str:
        """The Optuna study the sidecar runs the search in (the sidecar's default name)."""
        return f"seedance:{self.job}"

    def sidecar_toml(self, *, listen: str, token_file: Path) -> str:
        """The sidecar's configuration file for this session."""
        settings: dict[str, Any] = {
            "job": self.job + "-sidecar", "listen": listen,
            "store": str(self.out / "metrics.db"),
            "state_db": "sqlite:///" + str(self.out / "state.db"),
            "nvml": "off", "token_file": str(token_file), **self.sidecar_settings}
        lines = [f"{k} = {_toml(v)}" for k, v in settings.items()]
        lines += ["", "[approval]", f"mode = {_toml(self.mode)}"]
        if self.rollout_settings:
            lines += ["", "[rollout]", *(f"{k} = {_toml(v)}"
                                          for k, v in self.rollout_settings.items())]
        lines += ["", f"[jobs.{_toml(self.job)}]", f"tune = {_toml(self.tune)}",
                  f"mode = {_toml(self.mode)}"]
        return "\n".join(lines) + "\n"

    def train_args(self, url: str) -> list[str]:
        """``workloads.train`` arguments: trains until stopped, holding a lease at ``url``."""
        args = ["-m", "workloads.train", "--sidecar", url, "--job", self.job,
                "--seconds", "86400", "--global-batch", str(self.global_batch),
                "--micro-batch", str(self.micro_batch), "--seq-len", str(self.seq_len),
                "--threads", str(self.threads), "--seed", "0"]
        if self.lease_ttl_s is not None:
            args += ["--lease-ttl-s", str(self.lease_ttl_s)]
        if self.grad_scaler:
            args += ["--grad-scaler", "--loss-scale", repr(self.loss_scale),
                     "--loss-scale-growth-interval", str(self.loss_scale_growth_interval)]
        return args


def _toml(value: Any) -> str:
    """A TOML value for a string, number or bool (JSON writes these the way TOML reads)."""
    return json.dumps(value if isinstance(value, bool | int | float) else str(value))


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One live trial as the controller judged it: the candidate's knobs against the baseline
    in force then; tokens/s are the means of its candidate and baseline windows."""

    change_id: str
    trial: int | None
    state: str
    values: dict[str, Any]
    baseline: dict[str, Any]
    candidate_tokens_per_s: float
    baseline_tokens_per_s: float
    gain: float
    ci_low: float
    ci_high: float
    windows: int
    ended_because: str | None
    origin: str = ""
    """Why the search proposed it (``tuner.Proposal.origin``): "again: ...", "revisit: ..."."""

    @classmethod
    def from_change(cls, change: Mapping[str, Any]) -> Trial:
        comparison = change.get("comparison") or {}
        windows = change.get("windows") or []

        def mean(arm: str) -> float:
            values = [float(w["tokens_per_s"]) for w in windows if w["arm"] == arm]
            return sum(values) / len(values) if values else math.nan

        return cls(change_id=change["id"], trial=(change.get("meta") or {}).get("trial"),
                   state=change["state"], values={**change["baseline"], **change["values"]},
                   baseline=dict(change["baseline"]),
                   candidate_tokens_per_s=mean("candidate"),
                   baseline_tokens_per_s=mean("baseline"),
                   gain=_float(comparison.get("gain")),
                   ci_low=_float(comparison.get("ci_low")),
                   ci_high=_float(comparison.get("ci_high")), windows=len(windows),
                   ended_because=(change.get("plan") or {}).get("ended_because"),
                   origin=str((change.get("meta") or {}).get("origin") or ""))

    @property
    def measured(self) -> bool:
        """Judged on at least one candidate/baseline pair (not failed before measuring)."""
        return (self.state in ("kept", "rolled_back") and math.isfinite(self.gain)
                and math.isfinite(self.candidate_tokens_per_s))


@dataclass(frozen=True, kw_only=True)
class SessionResult:
    """What a session did. ``baseline``: the job's config when tuning began; ``kept``: its
    baseline when tuning stopped. ``remeasure``: the controller's interleaved comparison of the
    first baseline (candidate arm) against the kept config (baseline arm), None when nothing
    was kept (the two are the same config)."""

    baseline: dict[str, Any]
    kept: dict[str, Any]
    trials: list[Trial]
    changes: list[dict[str, Any]]
    remeasure: Trial | None
    wall_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def kept_tokens_per_s(self) -> float:
        return self.remeasure.baseline_tokens_per_s if self.remeasure else math.nan

    @property
    def baseline_tokens_per_s(self) -> float:
        return self.remeasure.candidate_tokens_per_s if self.remeasure else math.nan

    def to_json(self) -> dict[str, Any]:
        def trial(t: Trial | None) -> dict[str, Any] | None:
            return None if t is None else {k: _json_float(v) for k, v in t.__dict__.items()}
        return {"baseline": self.baseline, "kept": self.kept,
                "trials": [trial(t) for t in self.trials], "remeasure": trial(self.remeasure),
                "kept_tokens_per_s": _json_float(self.kept_tokens_per_s),
                "baseline_tokens_per_s": _json_float(self.baseline_tokens_per_s),
                "wall_s": round(self.wall_s, 1), "notes": self.notes}


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _json_float(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class TrainingSession:
    """The sidecar and the demo job as two processes, and an operator's view of them.

    A context manager: ``start()`` on enter, both processes stopped on exit (SIGINT, then
    SIGKILL after ``timeout_s``). Logs go to ``out/logs/{sidecar,train}.log``.
    """

    def __init__(self, config: SessionConfig, *, port: int | None = None) -> None:
        self.config = config
        self.out = config.out
        self.logs = self.out / "logs"
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = self.out / "token"
        self.config_file = self.out / "sidecar.toml"
        self.sidecar: subprocess.Popen[bytes] | None = None
        self.train: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=10.0)

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
        self.wait(lambda: self.job_status() if (self.job_status() or {}).get("state")
                  == "attached" else None, self.config.start_timeout_s, "the job to attach",
                  watch=(self.train,))
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
        for proc in (self.train, self.sidecar):
            _stop(proc)
        self.http.close()

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
            return self.http.get("/readyz").status_code == 200 or None
        except httpx.HTTPError:
            return None

    # ---- the operator's view -----------------------------------------------------------------

    def wait(self, found: Callable[[], T | None], timeout_s: float, what: str, *,
             watch: Sequence[subprocess.Popen[bytes] | None] = (), poll_s: float = 0.2) -> T:
        """Poll ``found`` until it returns something; TuningSessionError after ``timeout_s`` or when
        a watched process exits (bounded waits, not timing assertions)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = found()
            except httpx.HTTPError:
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

    def get(self, path: str, **params: Any) -> Any:
        reply = self.http.get(path, params=params)
        if reply.status_code != 200:
            raise TuningSessionError(f"GET {path}: {reply.status_code} {reply.text[:200]}")
        return reply.json()

    def post(self, path: str, body: Mapping[str, Any]) -> Any:
        reply = self.http.post(path, json=dict(body),
                               headers={"Authorization": f"Bearer {TOKEN}"})
        if reply.status_code not in (200, 201):
            raise TuningSessionError(f"POST {path}: {reply.status_code} {reply.text[:200]}")
        return reply.json()

    def job_status(self) -> dict[str, Any] | None:
        """The lease registry's view of the job (None before it attaches)."""
        found = [j for j in self.get("/v1/jobs") if j["job"] == self.config.job]
        return found[0] if found else None

    def baseline(self) -> dict[str, Any]:
        return dict(self.get(f"/v1/jobs/{self.config.job}/knobs")["baseline"]["values"])

    def changes(self, *, source: str | None = None) -> list[dict[str, Any]]:
        found = self.get("/v1/changes", job=self.config.job)
        return [c for c in found if source is None or c["source"] == source]

    def change(self, change_id: str) -> dict[str, Any]:
        return self.get(f"/v1/changes/{change_id}")  # type: ignore[no-any-return]

    def trials(self) -> list[Trial]:
        """The search's changes that reached a verdict, oldest first."""
        return [Trial.from_change(c) for c in self.changes(source="trial")
                if c["state"] in FINAL_STATES]

    def wait_change(self, change_id: str, states: Sequence[str], timeout_s: float
                    ) -> dict[str, Any]:
        return self.wait(lambda: (c if (c := self.change(change_id))["state"] in states
                                  else None),
                         timeout_s, f"change {change_id} to be {'|'.join(states)}",
                         watch=(self.sidecar,), poll_s=0.2)

    def search_done(self) -> bool:
        """The search tried every single move from the kept config and nothing is active."""
        moves_left = self.get(f"/v1/jobs/{self.config.job}/knobs")["moves_left"]
        return moves_left == 0 and not [c for c in self.changes()
                                        if c["state"] in ACTIVE_STATES]

    def set_tuning(self, action: str) -> None:
        self.post(f"/v1/jobs/{self.config.job}/tuning", {"by": "session", "action": action})

    def stop_tuning(self, timeout_s: float) -> None:
        """Pause the search and roll back the change in flight (an operator's config rollback:
        the trial is told what its windows measured so far), then wait until none is active."""
        self.set_tuning("pause")
        for change in [c for c in self.changes() if c["state"] in ACTIVE_STATES]:
            reply = self.http.post(f"/v1/jobs/{self.config.job}/rollback",
                                   json={"by": "session", "reason": "tuning session ends",
                                         "change": change["id"]},
                                   headers={"Authorization": f"Bearer {TOKEN}"})
            if reply.status_code not in (200, 409):  # 409: it ended meanwhile
                raise TuningSessionError(f"rollback: {reply.status_code} {reply.text[:200]}")
        self.wait_idle(timeout_s)

    def wait_idle(self, timeout_s: float) -> None:
        """Until no change of the job is active (the one in flight ends by itself)."""
        self.wait(lambda: True if not [c for c in self.changes()
                                       if c["state"] in ACTIVE_STATES] else None,
                  timeout_s, "the change in flight to end", watch=(self.sidecar,), poll_s=0.5)

    def propose(self, values: Mapping[str, Any], reason: str) -> dict[str, Any]:
        """An operator's change; approved at once when auto mode has not done it already."""
        change = self.post(f"/v1/jobs/{self.config.job}/changes",
                           {"values": dict(values), "by": "session", "reason": reason})
        if change["state"] == "proposed":
            change = self.post(f"/v1/changes/{change['id']}/approve",
                               {"by": "session", "comment": reason})
        return change  # type: ignore[no-any-return]

    def remeasure(self, baseline: Mapping[str, Any], timeout_s: float) -> Trial:
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


def _stop(proc: subprocess.Popen[bytes] | None, timeout_s: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


__all__ = ["SessionConfig", "TuningSessionError", "SessionResult", "Trial", "TrainingSession",
           "run_training_session"]
