"""The rollout controller's counters: what Grafana's Tuning dashboard reads.

Each is counted where the journal records the event (a change added or moved, a rollback
journaled), so the series say exactly what the audit log says. Every series names its job under
``seedance.job``: the sidecar's resource ``service.name`` is the sidecar's own.
"""

from __future__ import annotations

import math
from typing import get_args

from opentelemetry import metrics
from opentelemetry.metrics import MeterProvider

from collectors.names import (
    ATTR_CAUSE,
    ATTR_SCOPE,
    ATTR_SEEDANCE_JOB,
    ATTR_SEEDANCE_SOURCE,
    ATTR_STATE,
    TUNING_CHANGES,
    TUNING_OBJECTIVE,
    TUNING_ROLLBACKS,
    TUNING_TRIALS,
)
from tuner._change import ACTIVE, ENDED, IN_FLIGHT, Change, RollbackCause, RollbackKind, State

_SCOPE_NAME = "seedance.tuner"
JUDGED = frozenset({"kept", "rolled_back"})
"""The states a measured change is judged into: the objective gauge is set on entering one."""
STATES: tuple[str, ...] = get_args(State)


class TuningMetrics:
    """Counters of changes, trials and rollbacks, and the gain of the last judged change."""

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        meter = (meter_provider or metrics.get_meter_provider()).get_meter(_SCOPE_NAME)
        self._changes = meter.create_counter(
            TUNING_CHANGES, unit="{change}", description="Changes that entered a state")
        self._trials = meter.create_counter(
            TUNING_TRIALS, unit="{trial}", description="Search trials that ended, by state")
        self._rollbacks = meter.create_counter(
            TUNING_ROLLBACKS, unit="{rollback}", description="Rollbacks by scope and cause")
        self._objective = meter.create_gauge(
            TUNING_OBJECTIVE, unit="1",
            description="Relative tokens/s gain the last judged change measured")

    def entered(self, change: Change, was: str | None) -> None:
        """``change`` entered its state from ``was`` (None: it was just proposed)."""
        job = {ATTR_SEEDANCE_JOB: change.job}
        if was is None:
            self._zeros(change)
        self._changes.add(1, {**job, ATTR_STATE: change.state,
                              ATTR_SEEDANCE_SOURCE: change.source})
        if was not in ACTIVE or change.state in ACTIVE:
            return  # not a verdict: still under way, or a kept change undone, or a restore
        if change.source == "trial":
            self._trials.add(1, {**job, ATTR_STATE: change.state})
        gain = float((change.comparison or {}).get("gain", math.nan))
        if was in IN_FLIGHT and change.state in JUDGED and math.isfinite(gain):
            self._objective.set(gain, {**job, ATTR_STATE: change.state})

    def _zeros(self, change: Change) -> None:
        """Every state's series of the job at 0 before its first count: Prometheus sees no
        increase in a series that first appears at 1, and a dashboard's annotations and
        ``increase()`` would miss the first kept change or rollback."""
        job = {ATTR_SEEDANCE_JOB: change.job}
        for state in STATES:
            self._changes.add(0, {**job, ATTR_STATE: state, ATTR_SEEDANCE_SOURCE: change.source})
            if change.source == "trial" and (state in ENDED or state == "kept"):
                self._trials.add(0, {**job, ATTR_STATE: state})

    def rolled_back(self, job: str, scope: RollbackKind, cause: RollbackCause) -> None:
        self._rollbacks.add(1, {ATTR_SEEDANCE_JOB: job, ATTR_SCOPE: scope, ATTR_CAUSE: cause})
