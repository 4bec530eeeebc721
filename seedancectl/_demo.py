"""`seedancectl demo`: a real CPU run of the sidecar watching a small GPT training job.

The sidecar and the job are separate processes, talking OTLP/HTTP over loopback, exactly as in
production. GPU counters come from a recorded trace of a real GPU (there is none here); those
points are labelled `seedance.replayed=true` and the summary says so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from collectors._errors import SeedanceError

SUMMARY_SCHEMA_VERSION = 1


class DemoError(SeedanceError):
    """The demo could not run to its end."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out: Path
    minutes: float = 3.0
    nvml_trace: Path | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.minutes <= 120:
            raise DemoError(f"--minutes must be in (0, 120], got {self.minutes}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the sidecar exited with code {proc.returncode}; see its log")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise DemoError(f"the sidecar was not ready at {url} within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


class DemoRun:
    """Starts the processes, follows them, and writes the summary; always cleans up."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.out = config.out
        self.logs = self.out / "logs"
        self.store_path = self.out / "metrics.db"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._procs: list[subprocess.Popen[bytes]] = []

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - owned by the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=self.out)
        self._procs.append(proc)
        return proc

    def start_sidecar(self) -> None:
        nvml = f"replay:{self.config.nvml_trace}" if self.config.nvml_trace else "off"
        proc = self._spawn("sidecar", [
            "-m", "seedancectl.sidecar", "--job", "demo", "--listen", f"127.0.0.1:{self.port}",
            "--store", str(self.store_path), "--nvml", nvml,
        ])
        _wait_ready(f"{self.url}/readyz", proc, timeout_s=60)

    def run_training(self, on_tick: Callable[[float], None]) -> int:
        duration_s = self.config.minutes * 60
        proc = self._spawn("train", [
            "-m", "workloads.train", "--job", "demo-train",
            "--otlp-endpoint", f"{self.url}/v1/metrics", "--seconds", str(duration_s),
            "--threads", str(self.config.threads), "--steps", "100000000",
        ])
        start = time.monotonic()
        while proc.poll() is None:
            on_tick(min(1.0, (time.monotonic() - start) / duration_s))
            if time.monotonic() - start > duration_s + 120:
                _stop(proc)
                raise DemoError("the training job overran its time by 2 minutes; stopped it")
            time.sleep(1.0)
        on_tick(1.0)
        if proc.returncode != 0:
            raise DemoError(f"the training job exited with code {proc.returncode}; "
                            f"see {self.logs / 'train.log'}")
        return int(proc.returncode)

    def close(self) -> None:
        for proc in reversed(self._procs):
            _stop(proc)

    def summarise(self) -> dict[str, Any]:
        from collectors._store import TimeSeriesStore

        with TimeSeriesStore(self.store_path, readonly=True) as store:
            catalogue = store.metrics()
            series = {name: store.query(name, resolution="raw") for name in (
                "seedance.train.loss", "seedance.train.tokens_per_second",
                "seedance.train.step", "seedance.train.grad.group_norm",
                "seedance.train.step.duration.sum", "seedance.train.step.duration.count",
            )}
            gpu = store.query("hw.gpu.utilization", resolution="raw")

        def stat(frame: Any, fn: str) -> float | None:
            return None if frame.empty else float(getattr(frame["value"], fn)())

        loss = series["seedance.train.loss"]
        groups = series["seedance.train.grad.group_norm"]
        step_sum, step_count = (series["seedance.train.step.duration.sum"],
                                series["seedance.train.step.duration.count"])
        mean_step_s = (
            float(step_sum["value"].max() / step_count["value"].max())
            if not step_sum.empty and step_count["value"].max() > 0 else None
        )
        return {
            "schema_version": SUMMARY_SCHEMA_VERSION,
            "minutes": self.config.minutes,
            "store": str(self.store_path),
            "metrics": {
                "names": int(len(catalogue)),
                "points": int(catalogue["points"].sum()) if not catalogue.empty else 0,
            },
            "training": {
                "steps": stat(series["seedance.train.step"], "max"),
                "first_loss": None if loss.empty else float(loss["value"].iloc[0]),
                "last_loss": None if loss.empty else float(loss["value"].iloc[-1]),
                "median_tokens_per_s": stat(series["seedance.train.tokens_per_second"],
                                            "median"),
                "mean_step_s": mean_step_s,
                "last_group_grad_norms": (
                    {} if groups.empty or "seedance.module_group" not in groups else
                    groups.groupby("seedance.module_group")["value"].last().astype(float)
                    .to_dict()
                ),
            },
            "gpu": {
                "source": ("replayed trace " + str(self.config.nvml_trace))
                if self.config.nvml_trace else "none (NVML off)",
                "replayed": self.config.nvml_trace is not None,
                "utilization_points": int(len(gpu)),
            },
        }


def write_summary(out: Path, summary: dict[str, Any]) -> Path:
    path = out / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
    tmp.replace(path)
    return path
