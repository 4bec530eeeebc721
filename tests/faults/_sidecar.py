"""A real sidecar process on loopback for the fault suite, and what the tests send it.

``SidecarProcess`` writes a sidecar.toml from overrides, starts ``python -m seedancectl.sidecar``,
waits until it answers, and stops it (SIGTERM, then SIGKILL after a bound). ``gauge_request``
builds an OTLP protobuf request by hand, so a test controls exactly how many series and points
it sends."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "fault-suite-token"
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _toml(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


class SidecarProcess:
    """One sidecar process; ``url``, ``log()``, ``rss_mib()``, ``stop()``."""

    def __init__(self, tmp_path: Path, *, port: int | None = None, **settings: Any) -> None:
        self.dir = tmp_path
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        token = tmp_path / "token"
        token.write_text(TOKEN + "\n")
        base: dict[str, Any] = {
            "listen": f"127.0.0.1:{self.port}", "store": tmp_path / "metrics.db",
            "state_db": f"sqlite:///{tmp_path / 'state.db'}", "token_file": token,
            "nvml": "off", "export_interval_s": 0.5}
        base.update(settings)
        self.config = tmp_path / "sidecar.toml"
        self.config.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in base.items()))
        self._log = (tmp_path / "sidecar.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "seedancectl.sidecar", "--config", str(self.config)],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.http = httpx.Client(base_url=self.url, timeout=30.0)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                self.http.get("/healthz")
                break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the sidecar never answered"
            time.sleep(0.2)

    def log(self) -> str:
        return (self.dir / "sidecar.log").read_text(errors="replace")[-4000:]

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample of ``/metrics`` (the Prometheus name), None when absent."""
        for line in self.http.get("/metrics").text.splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                return float(value)
        return None

    def wait_for(self, what: str, found: Any, timeout_s: float = 30.0) -> Any:
        """Poll ``found()`` until truthy (a bounded wait, not a timing assertion)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = found()
            if got:
                return got
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{self.log()}"
            time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gauge_request(metric: str, series: range, *, times: int = 1, job: str = "flood",
                  t0_ns: int | None = None) -> bytes:
    """One OTLP request: ``metric`` as a gauge with one series per value of ``series``
    (attribute ``id``), ``times`` points each, one second apart."""
    t0 = time.time_ns() if t0_ns is None else t0_ns
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    attr = rm.resource.attributes.add()
    attr.key, attr.value.string_value = "service.name", job
    m = rm.scope_metrics.add().metrics.add()
    m.name = metric
    for i in series:
        for k in range(times):
            dp = m.gauge.data_points.add()
            dp.time_unix_nano = t0 + k * 1_000_000_000
            dp.as_double = float(i + k)
            a = dp.attributes.add()
            a.key, a.value.string_value = "id", str(i)
    return request.SerializeToString()


ARTIFACT = ROOT / "test-artifacts" / "faults.json"


def record(case: str, **figures: Any) -> None:
    """Add one case's measured figures to ``test-artifacts/faults.json`` (docs/reliability.md
    quotes them)."""
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    # Two pytest-xdist workers may record at once: one at a time, and a reader never sees a
    # half-written file.
    with open(ARTIFACT.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(ARTIFACT.read_text()) if ARTIFACT.exists() else {}
        data[case] = {**figures,
                      "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        written = ARTIFACT.with_suffix(f".{os.getpid()}.tmp")
        written.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        written.replace(ARTIFACT)
