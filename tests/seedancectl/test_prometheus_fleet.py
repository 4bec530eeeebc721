"""A fleet on one Prometheus: a real Prometheus scrapes the /metrics of three real sidecars (in
this process, on loopback), fed by real OTLP senders and a real torch job; sidecar C reads its
series back from Prometheus (``metrics_source``) while A and B keep the embedded store.

What shows a number came from Prometheus and not from C's own store: Prometheus drops job
``bad-2``'s series when it scrapes C (``metric_relabel_configs``), while C's store holds them;
and Prometheus stamps samples at its scrape times, to the millisecond.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pandas as pd
import pytest

from collectors import (
    CONFIG_VERSION_ATTR,
    ConfigError,
    PrometheusSource,
    Telemetry,
    TelemetryConfig,
    setup_telemetry,
)
from collectors.names import (
    TRAIN_GRAD_NONFINITE,
    TRAIN_LOSS,
    TRAIN_STEP,
    TRAIN_STEP_DURATION,
    TRAIN_TOKENS,
)
from policies import StoreWindow
from policies.detectors import NonFiniteDetector
from seedancectl._config import SidecarConfig
from seedancectl._sidecar import Sidecar
from tests.seedancectl._live import TOKEN, Live, live_sidecar
from tests.servers import free_port, start_prometheus
from tuner import Change, MeasureConfig, measure_window

JOB = "train-c"
"""The real torch job, attached to sidecar C."""
DROPPED = "bad-2"
"""A job sending to C whose series Prometheus drops when it scrapes C."""
JOB_SCRIPT = Path(__file__).with_name("prom_fleet_job.py")
DROP = ("    metric_relabel_configs:\n"
        f"      - source_labels: [service_name]\n        regex: {DROPPED}\n"
        "        action: drop\n")
MS = 1_000_000
NS = 1_000_000_000
MEASURE = MeasureConfig(warmup_steps=2, min_window_s=3.0, max_window_s=8.0)
T = TypeVar("T")


def _until(found: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll ``found`` until it returns other than None (bounded, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = found()
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.25)


class NonFiniteSender:
    """A job that reports non-finite gradient elements over OTLP (the project's own telemetry
    set-up, so the stock SDK exporter), a fresh step every quarter second until stopped."""

    def __init__(self, job: str, sidecar_url: str) -> None:
        self.telemetry: Telemetry = setup_telemetry(TelemetryConfig(
            job=job, otlp_endpoint=sidecar_url, export_interval_s=0.5))
        meter = self.telemetry.meter("tests.prometheus_fleet")
        self._step = meter.create_gauge(TRAIN_STEP, unit="{step}")
        self._nonfinite = meter.create_gauge(TRAIN_GRAD_NONFINITE, unit="{element}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = 0
        while not self._stop.wait(0.25):
            step += 1
            self._step.set(step)
            self._nonfinite.set(3, {"seedance.module_group": "ffn"})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.telemetry.shutdown(5)


@dataclass
class Fleet:
    api: str
    prometheus: PrometheusSource
    """A reader of the fleet's Prometheus, as the test's own eyes (no settle time)."""
    a: Live
    c: Live
    job: subprocess.Popen[bytes]
    job_log: Path


def _nonempty(frame: pd.DataFrame) -> pd.DataFrame | None:
    return frame if len(frame) else None


def _targets(api: str) -> int:
    """How many targets Prometheus lists (it lists them seconds after it is ready)."""
    try:
        return len(httpx.get(f"{api}/api/v1/targets", timeout=1).json()["data"]["activeTargets"])
    except (httpx.HTTPError, ValueError):
        return 0


@pytest.fixture(scope="module")
def fleet(prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    ports = {name: free_port() for name in ("a", "b", "c")}
    (root / "prometheus").mkdir()
    proc, api = start_prometheus(prometheus_binary, root / "prometheus",
                                 *(f"127.0.0.1:{p}" for p in ports.values()), scrape_extra=DROP)
    with ExitStack() as stack:
        stack.callback(lambda: (proc.terminate(), proc.wait(15)))
        _until(lambda: True if _targets(api) == len(ports) else None, 30,
               "Prometheus's targets")
        sidecars = {}
        for name, port in ports.items():
            (root / name).mkdir()
            overrides: dict[str, Any] = {"job": name, "listen": f"127.0.0.1:{port}"}
            if name == "c":
                overrides.update(
                    metrics_source=f"prometheus:{api}", policy_interval_s=1,
                    policy_open_after=1, policy_window_s=20, tuning_interval_s=0.5,
                    rollout={"warmup_steps": MEASURE.warmup_steps, "min_window_s":
                             MEASURE.min_window_s, "max_window_s": MEASURE.max_window_s,
                             "min_pairs": 1, "max_pairs": 1})
            sidecars[name] = stack.enter_context(live_sidecar(root / name, **overrides))
        a, c = sidecars["a"], sidecars["c"]
        for job, live in (("a-bad", a), ("bad-1", c), (DROPPED, c)):
            stack.callback(NonFiniteSender(job, live.url).stop)
        log = root / "job.log"
        with log.open("wb") as out:
            job_proc = subprocess.Popen([sys.executable, str(JOB_SCRIPT), c.url, JOB],
                                        stdout=out, stderr=subprocess.STDOUT,
                                        env={**os.environ, "SEEDANCE_TOKEN": TOKEN})
        stack.callback(lambda: (job_proc.terminate(), job_proc.wait(15)))
        prometheus = stack.enter_context(PrometheusSource(api, timeout_s=10))
        yield Fleet(api=api, prometheus=prometheus, a=a, c=c, job=job_proc, job_log=log)


@pytest.mark.integration
def test_the_sidecar_learns_the_scrape_interval_and_settles_by_it(fleet: Fleet) -> None:
    reader = fleet.c.sidecar.reader
    assert isinstance(reader, PrometheusSource) and reader.url == fleet.api
    assert reader.settle_s == fleet.prometheus.scrape_interval_s() == 1.0
    where = {"service.name": "bad-1"}
    _until(lambda: _nonempty(reader.query(TRAIN_GRAD_NONFINITE, where=where)), 30,
           "bad-1's points in Prometheus")
    # nothing from the last settle_s: a scrape stamped then may not have landed yet
    with PrometheusSource(fleet.api, settle_s=3600) as settled:
        assert settled.query(TRAIN_GRAD_NONFINITE, where=where,
                             since_ns=time.time_ns() - 3600 * NS).empty


@pytest.mark.integration
def test_the_engine_opens_a_finding_from_prometheus_for_its_own_jobs_only(fleet: Fleet) -> None:
    c = fleet.c

    def open_on(job: str) -> list[dict[str, Any]]:
        return [f for f in c.get("/v1/findings", job=job) if f["detector"] == "non_finite"]

    (finding,) = _until(lambda: open_on("bad-1") or None, 45, "non_finite finding on bad-1")
    assert finding["severity"] == "critical"
    # bad-2 sends C the same values, and C's store holds them: the store would judge it ...
    now_ns, store = time.time_ns(), c.sidecar.store
    assert store is not None
    assert NonFiniteDetector().evaluate(StoreWindow(
        store, job=DROPPED, since_ns=now_ns - 20 * NS, until_ns=now_ns))
    # ... but Prometheus dropped its series, and the engine reads Prometheus: no finding
    prometheus = fleet.prometheus
    assert prometheus.query(TRAIN_GRAD_NONFINITE, where={"service.name": DROPPED},
                            since_ns=now_ns - 60 * NS, until_ns=now_ns).empty
    assert open_on(DROPPED) == []
    # a-bad reports to sidecar A: Prometheus has it, yet C judges only the jobs that report to C
    assert len(prometheus.query(TRAIN_GRAD_NONFINITE, where={"service.name": "a-bad"},
                                since_ns=now_ns - 60 * NS, until_ns=now_ns)) > 0
    assert open_on("a-bad") == []


@pytest.mark.integration
def test_a_change_is_measured_per_config_version_from_prometheus(fleet: Fleet) -> None:
    c = fleet.c
    _until(lambda: True if any(s.job == JOB and s.state == "attached"
                               for s in c.sidecar.jobs.jobs()) else None,
           60, f"{JOB} attached ({fleet.job_log.read_text()[-2000:]})")
    proposed = c.post(f"/v1/jobs/{JOB}/changes", {"values": {"step_pause_ms": 5.0},
                                                  "reason": "shorter pause", "by": "test"})
    assert proposed.status_code == 201, proposed.text
    change_id = proposed.json()["id"]
    approved = c.post(f"/v1/changes/{change_id}/approve", {"by": "test"})
    assert approved.status_code == 200, approved.text
    controller, store = c.sidecar.controller, c.sidecar.store
    assert controller is not None and store is not None

    def measured() -> Change | None:
        change = controller.get(change_id)
        return change if len(change.windows) >= 2 else None

    candidate, baseline = _until(measured, 60, "candidate and baseline windows").windows[:2]
    assert (candidate.arm, baseline.arm) == ("candidate", "baseline")
    assert candidate.version != baseline.version
    for window in (candidate, baseline):
        # Prometheus' scrape stamps (ms); the job's own export times are to the ns
        assert window.start_ns % MS == 0 and window.end_ns % MS == 0
        # the same version read from C's store (which received the same exports) agrees
        stored = measure_window(store, JOB, window.version, window.arm, MEASURE)
        assert stored is not None
        assert window.tokens_per_s == pytest.approx(stored.tokens_per_s, rel=0.25)
    # 5 ms instead of 60 ms asleep in each step: faster, whatever the box's load adds to both
    assert candidate.tokens_per_s > 1.3 * baseline.tokens_per_s > 0


@pytest.mark.integration
def test_every_job_point_carries_its_config_version_as_a_label(fleet: Fleet) -> None:
    """The /metrics exporter turns ``seedance.config.version`` into a label on every sample
    of the job's series (buckets too), and Prometheus keeps it: each point read has one the
    job ran under."""
    c = fleet.c
    _until(lambda: c.get(f"/v1/jobs/{JOB}/acks") or None, 60, f"an ack from {JOB}")
    prometheus, now_ns = fleet.prometheus, time.time_ns()
    read = {}
    for name in (TRAIN_STEP_DURATION + ".count", TRAIN_STEP_DURATION + ".bucket", TRAIN_TOKENS,
                 TRAIN_LOSS):
        read[name] = _until(lambda n=name: _nonempty(prometheus.query(  # type: ignore[misc]
            n, where={"service.name": JOB}, since_ns=now_ns - 300 * NS, until_ns=now_ns)),
            30, f"{name} of {JOB} in Prometheus")
    # 0: the steps a job runs on its own defaults, before its first lease
    issued = {"0"} | {str(a["version"]) for a in c.get(f"/v1/jobs/{JOB}/acks")}
    for name, frame in read.items():
        assert CONFIG_VERSION_ATTR in frame.columns, name
        assert frame[CONFIG_VERSION_ATTR].notna().all(), name
        assert set(frame[CONFIG_VERSION_ATTR]) <= issued, (name, issued)


@pytest.mark.integration
def test_windows_not_longer_than_two_scrape_intervals_refuse_to_start(
        fleet: Fleet, tmp_path: Path) -> None:
    base = {"listen": f"127.0.0.1:{free_port()}", "store": tmp_path / "m.db",
            "state_db": f"sqlite:///{tmp_path / 's.db'}", "nvml": "off",
            "metrics_source": f"prometheus:{fleet.api}", "rollout": {"min_window_s": 3.0}}
    Sidecar(SidecarConfig.model_validate(base), environ={})  # over two scrapes: it builds
    for overrides, setting in (({"rollout": {"min_window_s": 2.0}}, "rollout.min_window_s"),
                               ({"policy_window_s": 1.5}, "policy_window_s")):
        config = SidecarConfig.model_validate({**base, **overrides})
        with pytest.raises(ConfigError, match=rf"^{setting} = .* not longer than 2 scrape "
                                              r"intervals .* \(2 x 1 s\)"):
            Sidecar(config, environ={})


@pytest.mark.integration
def test_the_report_reads_the_prometheus_its_configuration_names(
        fleet: Fleet, tmp_path: Path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text(f'[sidecar]\nmetrics_source = "prometheus:{fleet.api}"\n'
                      f'state_db = "{fleet.c.sidecar.config.state_db}"\n')
    done = subprocess.run(
        [sys.executable, "-m", "seedancectl.cli", "report", "--config", str(config),
         "--since", "10m", "--job", JOB, "--out", str(tmp_path / "report"),
         "--store", str(tmp_path / "no-store.db")],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["source"] == f"Prometheus at {fleet.api}"


def test_a_prometheus_the_sidecar_cannot_read_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text(f'[sidecar]\nlisten = "127.0.0.1:{free_port()}"\n'
                      f'store = "{tmp_path / "m.db"}"\nnvml = "off"\n'
                      f'state_db = "sqlite:///{tmp_path / "s.db"}"\n'
                      f'metrics_source = "prometheus:http://127.0.0.1:{free_port()}"\n')
    done = subprocess.run([sys.executable, "-m", "seedancectl.sidecar", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "metrics_source: Prometheus at http://127.0.0.1:" in line and "refused" in line
