"""`seedancectl demo`: a real CPU run of the sidecar watching a training and a serving job.

Every part is a separate process started here, talking to the others exactly as in production
(OTLP/HTTP and the knob lease over loopback): the sidecar, the small GPT training job holding a
knob lease (the sidecar tunes it: a tuning session of Optuna trials, then a staged fp16
incident that the policy engine detects and the controller rolls back locally), and the small
GPT serving job with its load generator. GPU counters come from a recorded trace of a real GPU
(there is none here); those points are labelled ``seedance.replayed=true``, and the summary's
``simulated`` list names everything that was replayed or staged.

Processes run in their own process groups, so the terminal's Ctrl-C reaches only this one; it
stops them in order (jobs first, the sidecar last, so the jobs' last spans land) and kills a
group that does not stop in time: no orphans.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from collectors import SeedanceError
from collectors.names import (
    ATTR_SERVICE_NAME,
    SERVE_TOKENS_PER_SECOND,
    TRAIN_LOSS,
    TRAIN_TOKENS_PER_SECOND,
)
from seedancectl._api_client import SidecarClient, SidecarError
from seedancectl._api_types import FindingJSON
from seedancectl._session import ACTIVE_STATES, FINAL_STATES, TrainingSession, stop_process
from seedancectl._session_config import SessionConfig

T = TypeVar("T")

SUMMARY_SCHEMA_VERSION = 2
SCHEMA_PATH = Path(__file__).with_name("demo_summary.schema.json")
TRAIN_JOB = "demo-train"
SERVE_JOB = "demo-serve"
OBJECTIVE = ("tokens/s of the training job (higher is better); the study's values are "
             "drift-cancelled, the windows' are raw means")
REPO_ROOT = Path(__file__).resolve().parents[1]
INCIDENT_KNOB = "precision.ffn"
INCIDENT_LOSS_SCALE = 2.0**-24
"""A loss scale backed off this far flushes fp16 gradients to zero; fp32 and bf16 keep them."""
INCIDENT_TRIALS = 4
TUNING_AT_LEAST_S = 240.0
IDLE_WAIT_S = 90.0
"""How long the trial in flight may take to finish once tuning is paused."""
OVERRUN_MARGIN_S = 240.0
"""Start-up (sidecar, job warm-up) and slack beyond the phases' own bounds before the demo
calls itself stuck."""


class DemoError(SeedanceError):
    """The demo could not run to its end."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run: its folder, length, GPU trace to replay and serving load."""

    out: Path
    minutes: float = 4.0
    nvml_trace: Path | None = None
    replicas: int = 1
    serve_rate_rps: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.minutes <= 120:
            raise DemoError(f"--minutes must be in (0, 120], got {self.minutes}")
        if self.replicas not in (1, 2):
            raise DemoError(f"DemoConfig.replicas must be 1 or 2, got {self.replicas}")
        if not self.serve_rate_rps > 0:
            raise DemoError(f"DemoConfig.serve_rate_rps must be > 0, got {self.serve_rate_rps}")

    @property
    def seconds(self) -> float:
        """The run's length in seconds."""
        return self.minutes * 60

    @property
    def incident_s(self) -> float:
        """The staged incident's share of the run (a quarter, at least 30 s)."""
        return max(30.0, 0.25 * self.seconds)

    @property
    def tuning_s(self) -> float:
        """A trial takes up to a minute and a half of the job's time (the sequential test's
        budget), so a short demo tunes for at least TUNING_AT_LEAST_S to show its trials."""
        return max(self.seconds - self.incident_s, TUNING_AT_LEAST_S)

    @property
    def incident_wait_s(self) -> float:
        """How long the staged incident may take to reach its verdict."""
        return max(60.0, self.incident_s)

    @property
    def overrun_s(self) -> float:
        """The phases' own bounds (tuning, the trial in flight, once more for the staged
        incident to start after it, the incident's verdict) plus a margin: past it the demo is
        stuck, not slow."""
        return self.tuning_s + 2 * IDLE_WAIT_S + self.incident_wait_s + OVERRUN_MARGIN_S


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """What the live view shows, read once from the sidecar's API and store."""

    elapsed_s: float
    phase: str
    trials: list[dict[str, Any]] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)
    findings: list[FindingJSON] = field(default_factory=list)
    config_version: int | None = None
    baseline_version: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    serve_tokens_per_s: float | None = None
    error: str | None = None


def session_config(config: DemoConfig) -> SessionConfig:
    """The demo's tuning session: the sidecar on its default settings (approval mode auto,
    tune on, nothing else), and a GradScaler whose scale has backed off and may not grow
    (harmless in fp32 and bf16; the staged fp16 change underflows under it)."""
    return SessionConfig(
        out=config.out.resolve(), job=TRAIN_JOB, trials=INCIDENT_TRIALS,
        sidecar_settings={"nvml": f"replay:{config.nvml_trace}"} if config.nvml_trace else {},
        warm_steps=30 if config.minutes < 2 else 60, grad_scaler=True,
        loss_scale=INCIDENT_LOSS_SCALE, loss_scale_growth_interval=10**6)


class DemoRun:
    """The session (sidecar + training job), the serving job, and the demo's phases: tuning,
    the staged incident, the end. ``close`` always stops every process."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.out = config.out.resolve()
        self.logs = self.out / "logs"
        self.store_path = self.out / "metrics.db"
        self.state_db_url = f"sqlite:///{self.out / 'state.db'}"
        self.session = TrainingSession(session_config(config),
                                       api_timeout_s=60.0)  # a starved sidecar answers late
        self.url = self.session.url
        self.started_at_ns = time.time_ns()
        self._started = time.monotonic()
        self._serve: subprocess.Popen[bytes] | None = None
        self._serve_started = 0.0
        self._serve_log: IO[bytes] | None = None
        self._view_api = SidecarClient(self.url, timeout_s=5.0)
        self._store: Any = None
        self.phase = "starting the sidecar and the training job"
        self.incident_change: str | None = None
        self.moves_left: int | None = None
        self.final: dict[str, Any] = {}

    # ---- processes -------------------------------------------------------------------------

    def start(self) -> None:
        """Sidecar and training job (warmed up, tuning on), then the serving job."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.db", "state.db"):
            for suffix in ("", "-wal", "-shm"):
                (self.out / (name + suffix)).unlink(missing_ok=True)
        for log in self.logs.glob("*.log"):
            log.unlink()
        self.session.start()
        self.start_serving()

    def start_serving(self) -> None:
        """The serving job: the demo's length of load, from now, exported to the sidecar."""
        self._serve_log = open(self.logs / "serve.log", "wb")  # noqa: SIM115 - closed in close()
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        self._serve_started = time.monotonic()
        self._serve = subprocess.Popen(
            [sys.executable, "-m", "workloads.serve", "--replicas", str(self.config.replicas),
             "--rate-rps", str(self.config.serve_rate_rps),
             "--duration-s", str(self.config.seconds), "--job", SERVE_JOB,
             "--otlp-endpoint", self.url],
            stdout=self._serve_log, stderr=subprocess.STDOUT, cwd=self.out,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
            start_new_session=True)  # its replicas are in its group: stopped with it

    def _check(self) -> None:
        """Raise if a process died or the run overran."""
        for name, proc in (("sidecar", self.session.sidecar), ("train", self.session.train),
                           ("serve", self._serve)):
            code = None if proc is None else proc.poll()
            if code not in (None, 0) or (code == 0 and name != "serve"):
                raise DemoError(f"the {name} process exited with code {code}; "
                                f"see {self.logs / (name + '.log')}")
        if self.elapsed_s() > self.config.overrun_s:
            raise DemoError(f"the demo ran past {self.config.overrun_s:.0f} s, the bound of "
                            f"its phases plus {OVERRUN_MARGIN_S:.0f} s; logs in {self.logs}")

    def _until(self, done: Callable[[], bool], deadline: float,
               on_tick: Callable[[Snapshot], None], interval_s: float) -> bool:
        """Show a snapshot every ``interval_s`` until ``done()`` or the monotonic
        ``deadline``; whether it was done."""
        while True:
            self._check()
            on_tick(self.snapshot())
            try:
                if done():
                    return True
            except SidecarError as exc:
                if exc.status is not None:  # answered with an error: not a slow sidecar
                    raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval_s)

    def follow(self, on_tick: Callable[[Snapshot], None], *, interval_s: float = 1.0) -> None:
        """The phases: tuning until its share of the time is up (or enough trials), the search
        paused and the trial in flight finished, then the staged incident to its verdict."""
        self.phase = "tuning"
        # until the trials are in or the search has nothing left to try from the kept config
        self._until(self._tuned, time.monotonic() + self.config.tuning_s, on_tick, interval_s)
        self.moves_left = self._moves_left()
        self.session.set_tuning("pause")
        self.phase = "tuning paused: the trial in flight finishes"
        self._until(self._idle, time.monotonic() + IDLE_WAIT_S, on_tick, interval_s)
        self.phase = f"incident (staged): {INCIDENT_KNOB} -> fp16 under a backed-off loss scale"
        change = self.session.propose({INCIDENT_KNOB: "fp16"}, reason=(
            "STAGED by the demo: fp16 on one module group under a backed-off loss scale"))
        self.incident_change = change["id"]
        # on a busy box the trial in flight can outlast the idle wait; the incident starts
        # after it, and its verdict's time counts from its start
        self._until(lambda: self.session.change(change["id"])["state"] != "approved",
                    time.monotonic() + IDLE_WAIT_S, on_tick, interval_s)
        self._until(lambda: self.session.change(change["id"])["state"] in FINAL_STATES,
                    time.monotonic() + self.config.incident_wait_s, on_tick, interval_s)
        self.phase = "done"
        on_tick(self.snapshot())

    def _tuned(self) -> bool:
        return (len(self.session.trials()) >= self.session.config.trials
                or self.session.search_done())

    def _moves_left(self) -> int | None:
        """Single moves from the kept config the search has not tried (0: it waits)."""
        found = self.session.api.knobs(self.session.config.job)["moves_left"]
        return None if found is None else int(found)

    def _idle(self) -> bool:
        return not [c for c in self.session.changes() if c["state"] in ACTIVE_STATES]

    def finish(self, timeout_s: float = 120.0) -> None:
        """Read the sidecar's final state, stop the training job (it flushes its spans), let
        the serving job end, then stop the sidecar.

        The serving job replays the demo's length of load from its own start; when the phases
        end early (the search tried every move) it still has that load to serve, so it gets
        until its planned end plus ``timeout_s`` (its replicas' start and its drain)."""
        self.final = {
            "changes": self._read(SidecarClient.changes) or [],
            "findings": self._read(lambda api: api.findings(include_closed=True)) or [],
            "status": self._read(SidecarClient.status) or {},
        }
        stop_process(self.session.train, 20.0)
        if self._serve is not None:
            try:
                planned_end = self._serve_started + self.config.seconds + timeout_s
                self._serve.wait(max(1.0, planned_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process(self._serve, 15.0, group=True)
        time.sleep(1.0)  # the job's last span export lands before the audit is read
        self.final["audit"] = self._read(SidecarClient.audit) or []
        self.close()
        code = None if self._serve is None else self._serve.returncode
        if code not in (0, None):
            raise DemoError(f"the serve process exited with code {code}; "
                            f"see {self.logs / 'serve.log'}")

    def close(self) -> None:
        """Stop every process still running (jobs first, the sidecar last); idempotent."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C waits
        try:
            stop_process(self.session.train, 20.0)
            if self._serve is not None:
                stop_process(self._serve, 20.0, group=True)
            self.session.close()
            if self._store is not None:
                self._store.close()
                self._store = None
            self._view_api.close()
            if self._serve_log is not None:
                self._serve_log.close()
        finally:
            signal.signal(signal.SIGINT, previous)

    def elapsed_s(self) -> float:
        """Seconds since the run was made (monotonic)."""
        return time.monotonic() - self._started

    # ---- the live view -----------------------------------------------------------------------

    def _read(self, read: Callable[[SidecarClient], T]) -> T | None:
        """``read`` on the view's own client (short timeout); None when it fails: the view
        shows what it could read and the run goes on."""
        try:
            return read(self._view_api)
        except SidecarError:
            return None

    def _latest(self, name: str, job: str) -> float | None:
        """The newest value of a metric of ``job`` in the store (None before the first)."""
        from collectors import StoreError, TimeSeriesStore

        if self._store is None:
            if not self.store_path.exists():
                return None
            try:
                self._store = TimeSeriesStore(self.store_path, readonly=True)
            except StoreError:
                return None
        since = time.time_ns() - 30 * 10**9
        frame = self._store.query(name, where={ATTR_SERVICE_NAME: job}, since_ns=since,
                                  resolution="raw")
        return None if frame.empty else float(frame["value"].iloc[-1])

    def snapshot(self) -> Snapshot:
        """One read of the sidecar's API and store; never raises (the error is shown)."""
        try:
            status = self._read(SidecarClient.status)
            changes = self._read(lambda api: api.changes(job=TRAIN_JOB)) or []
            findings = self._read(SidecarClient.findings) or []
            job = next((j for j in (status["jobs"] if status else []) if j["job"] == TRAIN_JOB),
                       None)
            return Snapshot(
                elapsed_s=self.elapsed_s(), phase=phase(self.phase, changes),
                trials=trial_rows(changes), changes=[change_row(c) for c in changes],
                findings=findings, config_version=None if job is None else job["acked_version"],
                baseline_version=None if job is None else job["baseline_version"],
                loss=self._latest(TRAIN_LOSS, TRAIN_JOB),
                tokens_per_s=self._latest(TRAIN_TOKENS_PER_SECOND, TRAIN_JOB),
                serve_tokens_per_s=self._latest(SERVE_TOKENS_PER_SECOND, SERVE_JOB))
        except Exception as exc:  # the view never stops the run
            return Snapshot(elapsed_s=self.elapsed_s(), phase=self.phase,
                            error=f"{type(exc).__name__}: {exc}")


def phase(current: str, changes: Sequence[Mapping[str, Any]]) -> str:
    """The demo's phase, with the change in flight if there is one."""
    active = [c for c in changes if c["state"] in ACTIVE_STATES]
    if not active:
        return current
    change = active[0]
    what = (f"trial {change['meta'].get('trial')}" if change["source"] == "trial"
            else f"{change['source']} change")
    return f"{current} · {what} {change['state']}"


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def objective(change: Mapping[str, Any], arm: str = "candidate") -> float | None:
    """Raw mean tokens/s over the change's windows of ``arm``."""
    return _mean([w["tokens_per_s"] for w in change.get("windows", []) if w["arm"] == arm])


def change_row(change: Mapping[str, Any]) -> dict[str, Any]:
    """A change as the summary and the view show it (from the API's change JSON)."""
    comparison = change.get("comparison") or {}
    plan = change.get("plan") or {}
    return {
        "id": change["id"], "job": change["job"], "source": change["source"],
        "state": change["state"], "values": dict(change["values"]),
        "baseline": dict(change["baseline"]), "reason": change["reason"],
        "risk": change["risk"], "approved_by": change.get("approved_by"),
        "trial": (change.get("meta") or {}).get("trial"),
        "objective": objective(change), "baseline_objective": objective(change, "baseline"),
        "gain": _finite(comparison.get("gain")), "ci_low": _finite(comparison.get("ci_low")),
        "ci_high": _finite(comparison.get("ci_high")),
        "rollback": plan.get("rollback"), "ended_because": plan.get("ended_because"),
        "traceparent": change.get("traceparent") or None,
    }


def trial_rows(changes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The search's trials as the rollout saw them (one change each), oldest first."""
    return [{"trial": row["trial"], "values": row["values"], "state": row["state"],
             "objective": row["objective"], "change_id": row["id"]}
            for row in map(change_row, changes) if row["source"] == "trial"]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def write_summary(out: Path, summary: Mapping[str, Any]) -> Path:
    """``out/summary.json``, replaced whole (a reader never sees half of it)."""
    path = out / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True), encoding="utf-8")
    tmp.replace(path)
    return path
