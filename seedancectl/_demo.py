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
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from collectors._errors import SeedanceError

SUMMARY_SCHEMA_VERSION = 2
SCHEMA_PATH = Path(__file__).with_name("demo_summary.schema.json")
TRAIN_JOB = "demo-train"
SERVE_JOB = "demo-serve"
OBJECTIVE = "tokens/s: mean over the trial's candidate windows (higher is better)"
REPO_ROOT = Path(__file__).resolve().parents[1]


class DemoError(SeedanceError):
    """The demo could not run to its end."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run: its folder, length, GPU trace to replay and serving load."""

    out: Path
    minutes: float = 4.0
    nvml_trace: Path | None = None
    replicas: int = 1
    serve_rate_rps: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.minutes <= 120:
            raise DemoError(f"--minutes must be in (0, 120], got {self.minutes}")
        if self.replicas not in (1, 2):
            raise DemoError(f"DemoConfig.replicas must be 1 or 2, got {self.replicas}")
        if not self.serve_rate_rps > 0:
            raise DemoError(f"DemoConfig.serve_rate_rps must be > 0, got {self.serve_rate_rps}")

    @property
    def seconds(self) -> float:
        return self.minutes * 60


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """What the live view shows, read once from the sidecar's API and store."""

    elapsed_s: float
    phase: str
    trials: list[dict[str, Any]] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    config_version: int | None = None
    baseline_version: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    serve_tokens_per_s: float | None = None
    error: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sidecar_toml(config: DemoConfig, *, port: int, store: Path, state_db: Path) -> str:
    """The sidecar's configuration: the training job tuned with approval auto; short policy
    and tuning intervals, so a short run still sees findings and trials."""
    nvml = f"replay:{config.nvml_trace}" if config.nvml_trace else "off"
    return "\n".join([
        "[sidecar]",
        'job = "demo"',
        f'listen = "127.0.0.1:{port}"',
        f"store = {json.dumps(str(store))}",
        f"state_db = {json.dumps(f'sqlite:///{state_db}')}",
        f"nvml = {json.dumps(nvml)}",
        "policy_interval_s = 3.0",
        "policy_window_s = 60.0",
        "tuning_interval_s = 0.5",
        "",
        "[sidecar.approval]",
        'mode = "auto"',
        "",
        f"[sidecar.jobs.{TRAIN_JOB}]",
        'mode = "auto"',
        "tune = true",
        "",
    ])


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGINT to the process's group, then SIGKILL to the group if it does not end in time."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            proc.wait()
    try:  # a grandchild that outlived its parent (a serving replica) goes too
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return int(proc.returncode)


class DemoRun:
    """Starts the processes, follows them, gathers the summary; ``close`` always cleans up."""

    def __init__(self, config: DemoConfig, *, token: str | None = None) -> None:
        self.config = config
        self.out = config.out.resolve()
        self.logs = self.out / "logs"
        self.store_path = self.out / "metrics.db"
        self.state_db_path = self.out / "state.db"
        self.state_db_url = f"sqlite:///{self.state_db_path}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.started_at_ns = time.time_ns()
        self._started = time.monotonic()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._log_files: list[IO[bytes]] = []
        self._http = httpx.Client(base_url=self.url, timeout=5.0)
        self._store: Any = None
        self.final: dict[str, Any] = {}

    # ---- processes -------------------------------------------------------------------------

    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        self._log_files.append(log)
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=self.out, start_new_session=True)
        self._procs[name] = proc
        return proc

    def start(self) -> None:
        """Sidecar (ready), then the serving job and the training job."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for stale in (self.store_path, self.state_db_path):
            for path in (stale, stale.with_name(stale.name + "-wal"),
                         stale.with_name(stale.name + "-shm")):
                path.unlink(missing_ok=True)
        config_path = self.out / "sidecar.toml"
        config_path.write_text(sidecar_toml(self.config, port=self.port, store=self.store_path,
                                            state_db=self.state_db_path), encoding="utf-8")
        sidecar = self._spawn("sidecar", ["-m", "seedancectl.sidecar", "--config",
                                          str(config_path)])
        self._wait_ready(sidecar, timeout_s=90.0)
        self._spawn("serve", [
            "-m", "workloads.serve", "--replicas", str(self.config.replicas),
            "--rate-rps", str(self.config.serve_rate_rps),
            "--duration-s", str(self.config.seconds), "--job", SERVE_JOB,
            "--otlp-endpoint", self.url])
        self._spawn("train", [
            "-m", "workloads.train", "--job", TRAIN_JOB, "--sidecar", self.url,
            "--seconds", str(self.config.seconds), "--export-interval-s", "1.0"])

    def _wait_ready(self, proc: subprocess.Popen[bytes], *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DemoError(f"the sidecar exited with code {proc.returncode}; "
                                f"see {self.logs / 'sidecar.log'}")
            try:
                if self._http.get("/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise DemoError(f"the sidecar was not ready within {timeout_s:.0f} s; "
                        f"see {self.logs / 'sidecar.log'}")

    def running(self) -> bool:
        """True while the training job runs; raises when a process failed."""
        for name, proc in self._procs.items():
            code = proc.poll()
            if code not in (None, 0):
                raise DemoError(f"the {name} process exited with code {code}; "
                                f"see {self.logs / (name + '.log')}")
        if self.elapsed_s() > self.config.seconds + 180:
            raise DemoError(f"the demo overran its {self.config.minutes:g} minutes by 3 "
                            f"minutes; logs in {self.logs}")
        return self._procs["train"].poll() is None

    def follow(self, on_tick: Callable[[Snapshot], None], *, interval_s: float = 1.0) -> None:
        """Until the training job ends: a snapshot to ``on_tick`` every ``interval_s``."""
        while self.running():
            on_tick(self.snapshot())
            time.sleep(interval_s)
        on_tick(self.snapshot())

    def finish(self, timeout_s: float = 120.0) -> None:
        """After the training job: let the serving job drain, read the sidecar's final state,
        then stop the sidecar (it flushes its spans to the state DB on the way out)."""
        serve = self._procs.get("serve")
        if serve is not None:
            try:
                serve.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _stop(serve, 15.0)
        self.final = {
            "changes": self._get("/v1/changes") or [],
            "findings": self._get("/v1/findings", all=True) or [],
            "audit": self._get("/v1/audit") or [],
            "status": self._get("/v1/status") or {},
        }
        self.close()
        for name in ("train", "serve"):
            code = self._procs[name].returncode
            if code not in (0, None):
                raise DemoError(f"the {name} process exited with code {code}; "
                                f"see {self.logs / (name + '.log')}")

    def close(self) -> None:
        """Stop every process still running (jobs first, the sidecar last); idempotent."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C waits
        try:
            for name in ("train", "serve", "sidecar"):
                proc = self._procs.get(name)
                if proc is not None:
                    _stop(proc, 20.0)
            if self._store is not None:
                self._store.close()
                self._store = None
            self._http.close()
            for log in self._log_files:
                log.close()
        finally:
            signal.signal(signal.SIGINT, previous)

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    # ---- the live view -----------------------------------------------------------------------

    def _get(self, path: str, **params: Any) -> Any:
        try:
            reply = self._http.get(path, params=params)
        except httpx.HTTPError:
            return None
        return reply.json() if reply.is_success else None

    def _latest(self, name: str, job: str) -> float | None:
        """The newest value of a metric of ``job`` in the store (None before the first)."""
        from collectors._store import StoreError, TimeSeriesStore

        if self._store is None:
            if not self.store_path.exists():
                return None
            try:
                self._store = TimeSeriesStore(self.store_path, readonly=True)
            except StoreError:
                return None
        since = time.time_ns() - 30 * 10**9
        frame = self._store.query(name, where={"service.name": job}, since_ns=since,
                                  resolution="raw")
        return None if frame.empty else float(frame["value"].iloc[-1])

    def snapshot(self) -> Snapshot:
        """One read of the sidecar's API and store; never raises (the error is shown)."""
        try:
            status = self._get("/v1/status") or {}
            changes = self._get("/v1/changes", job=TRAIN_JOB) or []
            findings = self._get("/v1/findings") or []
            job: dict[str, Any] = next(
                (j for j in status.get("jobs", []) if j["job"] == TRAIN_JOB), {})
            return Snapshot(
                elapsed_s=self.elapsed_s(), phase=phase(job, changes),
                trials=trial_rows(changes), changes=[change_row(c) for c in changes],
                findings=findings, config_version=job.get("acked_version"),
                baseline_version=job.get("baseline_version"),
                loss=self._latest("seedance.train.loss", TRAIN_JOB),
                tokens_per_s=self._latest("seedance.train.tokens_per_second", TRAIN_JOB),
                serve_tokens_per_s=self._latest("seedance.serve.tokens_per_second", SERVE_JOB))
        except Exception as exc:  # the view never stops the run
            return Snapshot(elapsed_s=self.elapsed_s(), phase="?",
                            error=f"{type(exc).__name__}: {exc}")


def phase(job: Mapping[str, Any], changes: Sequence[Mapping[str, Any]]) -> str:
    """In words, where the run is: starting, tuning (trial N), incident, watching."""
    if not job or job.get("state") != "attached":
        return "starting the jobs"
    active = [c for c in changes if c["state"] in ("proposed", "approved", "applying",
                                                   "observing")]
    if not active:
        return "watching (no change in flight)"
    current = active[0]
    if current["source"] == "trial":
        return f"tuning: trial {current['meta'].get('trial')} {current['state']}"
    return f"{current['source']} change {current['state']}"


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def objective(change: Mapping[str, Any], arm: str = "candidate") -> float | None:
    """Mean tokens/s over the change's windows of ``arm`` (the search's objective)."""
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
    path = out / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True), encoding="utf-8")
    tmp.replace(path)
    return path
