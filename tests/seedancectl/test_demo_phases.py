"""The demo's phase bounds: its stuck-run guard must never fire while a phase is still within
its own bound (a 1-minute demo once killed itself after tuning for its full allowed time)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from seedancectl._demo import IDLE_WAIT_S, DemoConfig, DemoRun

START_UP_S = 120.0
"""What starting the sidecar and warming the training job up may take on a busy 2-core box."""


@pytest.mark.parametrize("minutes", [0.5, 1.0, 4.0, 30.0, 120.0])
def test_the_stuck_guard_leaves_every_phase_its_whole_bound(minutes: float) -> None:
    config = DemoConfig(out=Path("unused"), minutes=minutes)
    # tuning; the trial in flight; the incident waiting for it once more; the incident
    phases_s = config.tuning_s + 2 * IDLE_WAIT_S + max(60.0, config.incident_s)
    assert config.overrun_s >= START_UP_S + phases_s
    assert config.tuning_s >= config.seconds - config.incident_s  # tunes for its share at least


class _AcceptAll(BaseHTTPRequestHandler):
    """Stands where the sidecar's OTLP receiver would: takes every export, keeps nothing."""

    def do_POST(self) -> None:  # noqa: N802 - the handler's name is http.server's
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.integration
def test_phases_that_end_early_leave_the_serving_job_its_load(tmp_path: Path) -> None:
    """The search may try every move long before the demo's length is up; the serving job,
    which replays that length of load from its own start, must then end by itself, not be
    interrupted (the 4-minute demo once failed with 'the serve process exited with code -2')."""
    run = DemoRun(DemoConfig(out=tmp_path, minutes=0.5))  # 30 s of load
    receiver = ThreadingHTTPServer(("127.0.0.1", run.session.port), _AcceptAll)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        run.logs.mkdir(parents=True)
        run.start_serving()
        run.finish(timeout_s=30.0)  # at once: the phases ended before the load did
        assert run._serve is not None and run._serve.returncode == 0, (
            (run.logs / "serve.log").read_text()[-2000:])
    finally:
        run.close()
        receiver.shutdown()
        receiver.server_close()
