"""The rollout controller's tuning counters, read back from a real OpenTelemetry reader after
real changes (a simulated job's steps, the real controller, store and journal)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from collectors import sqlite_url
from collectors._store import TimeSeriesStore
from collectors.names import TUNING_CHANGES, TUNING_OBJECTIVE, TUNING_ROLLBACKS, TUNING_TRIALS
from tests.tuner._simjob import SimJob
from tests.tuner.test_rollout import CONFIG, Clock, drive, fast_micro_batch
from tuner._lease import JobRegistry
from tuner._rollout import RolloutController

Series = dict[tuple[tuple[str, str], ...], float]


class Parts:
    def __init__(self, tmp_path: Path) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.registry = JobRegistry(lease_ttl_s=30.0, clock=Clock())
        self.store = TimeSeriesStore(tmp_path / "metrics.db")
        self.controller = RolloutController(
            self.registry, self.store, db_url=sqlite_url(tmp_path / "state.db"),
            clock=Clock(), config=CONFIG, meter_provider=self.provider)

    def series(self, name: str) -> Series:
        """Every point of ``name``: sorted attributes -> value."""
        data = self.reader.get_metrics_data()
        return {tuple(sorted((k, str(v)) for k, v in p.attributes.items())): p.value
                for rm in data.resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name for p in m.data.data_points}


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    made = Parts(tmp_path)
    yield made
    made.controller.close()
    made.store.close()


def _value(series: Series, **attributes: str) -> float:
    key = tuple(sorted({"seedance.job": "train", **attributes}.items()))
    assert key in series, f"no series {key} in {sorted(series)}"
    return series[key]


def test_a_kept_trial_counts_its_states_its_trial_and_its_gain(parts: Parts) -> None:
    job = SimJob(parts.registry, parts.store, step_s=fast_micro_batch)
    ctl = parts.controller
    ctl.set_mode(job.job, "auto", by="alice")
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="trial", source="trial")
    changes = parts.series(TUNING_CHANGES)
    # Every state's series is there at 0 from the proposal on, so increase() sees the first.
    assert _value(changes, state="kept", **{"seedance.source": "trial"}) == 0
    assert _value(parts.series(TUNING_TRIALS), state="kept") == 0
    done = drive(ctl, job, change.id)
    assert done.state == "kept" and done.comparison is not None
    changes = parts.series(TUNING_CHANGES)
    for state in ("proposed", "approved", "applying", "observing", "kept"):
        assert _value(changes, state=state, **{"seedance.source": "trial"}) == 1, state
    assert _value(changes, state="rolled_back", **{"seedance.source": "trial"}) == 0
    assert _value(parts.series(TUNING_TRIALS), state="kept") == 1
    assert _value(parts.series(TUNING_OBJECTIVE), state="kept") == pytest.approx(
        done.comparison["gain"])
    assert parts.series(TUNING_ROLLBACKS) == {}
    # An operator undoing the kept change is a rollback, not a second end of the trial.
    ctl.rollback(job.job, "bob", "paged")
    assert _value(parts.series(TUNING_ROLLBACKS), scope="config", cause="operator") == 1
    assert _value(parts.series(TUNING_TRIALS), state="kept") == 1
    assert _value(parts.series(TUNING_TRIALS), state="rolled_back") == 0


def test_a_slower_config_counts_a_rollback_by_the_verdict(parts: Parts) -> None:
    job = SimJob(parts.registry, parts.store,
                 step_s=lambda v: 0.2 if v["micro_batch"] == 1 else 0.1)
    ctl = parts.controller
    change = ctl.propose(job.job, {"micro_batch": 1}, reason="trial", source="trial")
    ctl.approve(change.id, "alice")
    done = drive(ctl, job, change.id)
    assert done.state == "rolled_back" and done.comparison is not None
    assert parts.series(TUNING_ROLLBACKS) == {
        (("cause", "verdict"), ("scope", "config"), ("seedance.job", "train")): 1}
    assert _value(parts.series(TUNING_TRIALS), state="rolled_back") == 1
    gain = _value(parts.series(TUNING_OBJECTIVE), state="rolled_back")
    assert gain == pytest.approx(done.comparison["gain"]) and gain < 0
