"""A real sidecar on loopback that tunes one job fast (short windows, the search from the
start), and what the tests read back from it: the job's trials and its telemetry."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from collectors._store import TimeSeriesStore
from tests.seedancectl._live import Live, live_sidecar
from tuner.job import Session

JOB = "tiny"
JUDGED = ("kept", "rolled_back")
FAST_ROLLOUT = {"warmup_steps": 1, "min_steps": 3, "min_window_s": 0.3, "max_window_s": 5.0,
                "min_pairs": 1, "max_pairs": 4, "early_stop_pairs": 1, "trial_budget_s": 20.0,
                "loss_tolerance": 1.0}
"""Windows of a few tiny steps; a loose loss bound: the tiny models' loss is noise."""


@contextmanager
def tuning_sidecar(tmp_path: Path, *, tune: bool = True) -> Iterator[Live]:
    """A sidecar that auto-approves and searches ``threads`` for JOB from its first second."""
    with live_sidecar(tmp_path, approval={"mode": "auto"}, tuning_start_after_s=0,
                      jobs={JOB: {"tune": tune, "knobs": ["threads"]}},
                      rollout=FAST_ROLLOUT) as live:
        yield live


def needs_threads_knob(session: Session) -> None:
    """The trials search ``threads``, a knob only a process with two CPUs or more gets."""
    if "threads" not in session.knobs.knobs:
        pytest.skip("one CPU: no threads knob to search")


class TrialWatch:
    """Polls the sidecar's changes in a thread; ``done`` once a trial of JOB was judged."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.done = threading.Event()
        self.changes: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def trials(self) -> list[dict[str, Any]]:
        return [c for c in self.changes if c["source"] == "trial"]

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(30)
        self.changes = self.live.get("/v1/changes", job=JOB)
        return self.trials()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            self.changes = self.live.get("/v1/changes", job=JOB)
            if any(t["state"] in JUDGED for t in self.trials()):
                self.done.set()


def counted(frame: pd.DataFrame) -> float:
    """A cumulative counter's total over its series (one per config version)."""
    if frame.empty:
        return 0.0
    return float(frame.groupby("seedance.config.version")["value"].max().sum())


def job_series(tmp_path: Path, name: str,
               until: Callable[[pd.DataFrame], bool] = lambda frame: not frame.empty,
               timeout_s: float = 30.0) -> pd.DataFrame:
    """JOB's raw points of ``name`` in the sidecar's store once ``until`` holds for them (the
    last export lands after training ends: waits are bounded, no time is asserted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with TimeSeriesStore(tmp_path / "metrics.db", readonly=True) as store:
            frame = store.query(name, resolution="raw")
        if not frame.empty:
            frame = frame[frame["service.name"] == JOB]
        if until(frame) or time.monotonic() > deadline:
            return frame
        time.sleep(0.5)
