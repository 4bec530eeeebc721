"""The demo's phase bounds: its stuck-run guard must never fire while a phase is still within
its own bound (a 1-minute demo once killed itself after tuning for its full allowed time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from seedancectl._demo import IDLE_WAIT_S, DemoConfig

START_UP_S = 120.0
"""What starting the sidecar and warming the training job up may take on a busy 2-core box."""


@pytest.mark.parametrize("minutes", [0.5, 1.0, 4.0, 30.0, 120.0])
def test_the_stuck_guard_leaves_every_phase_its_whole_bound(minutes: float) -> None:
    config = DemoConfig(out=Path("unused"), minutes=minutes)
    phases_s = config.tuning_s + IDLE_WAIT_S + max(60.0, config.incident_s)
    assert config.overrun_s >= START_UP_S + phases_s
    assert config.tuning_s >= config.seconds - config.incident_s  # tunes for its share at least
