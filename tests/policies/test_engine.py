"""The policy engine: hysteresis, dedup, persistence, the active gauge and the log records."""

from __future__ import annotations

import itertools
import random
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from policies import (
    ACTIVE_FINDINGS_METRIC,
    ERRORS_METRIC,
    Detector,
    EngineConfig,
    Evidence,
    Finding,
    FrameStore,
    PolicyEngine,
    SelfCheck,
    StoreWindow,
    WindowSource,
    sqlite_url,
)
from policies import _engine as engine_module
from tests.policies.example_detector import UTILISATION, LowUtilisationDetector

S = 10**9
DECADE = 10  # seconds per data segment; windows cover exactly one segment


def _store(pattern: str, job: str = "train-a") -> FrameStore:
    """One point a second per GPU; segment k of GPU 0 is bad ("b") or good ("g")."""
    return FrameStore({UTILISATION: _frame(pattern, job)})


def _frame(pattern: str, job: str) -> pd.DataFrame:
    rows = []
    for k, verdict in enumerate(pattern):
        for i in range(DECADE):
            t = (k * DECADE + i) * S
            rows.append({"time": t, "value": 0.2 if verdict == "b" else 0.9,
                         "gpu.index": "0", "service.name": job})
            rows.append({"time": t, "value": 0.9, "gpu.index": "1", "service.name": job})
    return pd.DataFrame(rows)


def _segment_end(k: int) -> int:
    return (k * DECADE + DECADE - 1) * S


class Telemetry:
    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.logs = InMemoryLogRecordExporter()
        self.loggers = LoggerProvider()
        self.loggers.add_log_record_processor(SimpleLogRecordProcessor(self.logs))

    def gauge(self) -> dict[tuple[str, str], int]:
        """Open findings by (detector, job)."""
        data = self.reader.get_metrics_data()
        out: dict[tuple[str, str], int] = {}
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == ACTIVE_FINDINGS_METRIC:
                        for p in metric.data.data_points:
                            out[(str(p.attributes["detector"]),
                                 str(p.attributes["seedance.job"]))] = int(p.value)
        return out


    def counter(self, name: str) -> dict[tuple[str, ...], int]:
        data = self.reader.get_metrics_data()
        return {(str(p.attributes["detector"]), str(p.attributes["job"]),
                 str(p.attributes["stage"])): int(p.value)
                for rm in (data.resource_metrics if data else ())
                for sm in rm.scope_metrics for metric in sm.metrics if metric.name == name
                for p in metric.data.data_points}


@pytest.fixture
def telemetry() -> Telemetry:
    return Telemetry()


def _engine(tmp_path: Path, store: FrameStore, telemetry: Telemetry,
            detectors: list[Detector] | None = None, **config: float) -> PolicyEngine:
    cfg = dict(interval_s=1.0, window_s=(DECADE - 1), open_after=3, close_after=3)
    cfg.update(config)
    return PolicyEngine(detectors or [LowUtilisationDetector()], WindowSource(store),
                        db_url=sqlite_url(tmp_path / "state.db"),
                        config=EngineConfig(**cfg),  # type: ignore[arg-type]
                        meter_provider=telemetry.meters, logger_provider=telemetry.loggers)


def _run(engine: PolicyEngine, segments: int) -> Iterator[tuple[int, list[str], list[str]]]:
    for k in range(segments):
        report = engine.evaluate_once(_segment_end(k))
        yield k, [f.resource["gpu"] for f in report.opened], [f.resource["gpu"] for f in report.closed]


def test_opens_after_n_bad_and_closes_after_m_clean(tmp_path: Path, telemetry: Telemetry) -> None:
    pattern = "bbbbbggggg"
    with _engine(tmp_path, _store(pattern), telemetry) as engine:
        events = {k: (o, c) for k, o, c in _run(engine, len(pattern)) if o or c}
    assert events == {2: (["0"], []), 7: ([], ["0"])}  # 3rd bad opens, 3rd clean closes
    with _engine(tmp_path, _store(pattern), telemetry) as engine:
        (finding,) = engine.findings.history()
    assert (finding.opened_at_ns, finding.closed_at_ns) == (_segment_end(2), _segment_end(7))
    assert finding.severity == "critical" and finding.resource == {"gpu": "0"}


def test_flapping_never_opens_and_a_clean_blip_does_not_close(
        tmp_path: Path, telemetry: Telemetry) -> None:
    with _engine(tmp_path, _store("bgbgbgbg"), telemetry) as engine:
        assert not any(o or c for _, o, c in _run(engine, 8))
    with _engine(tmp_path / "2", _store("bbbgbbgbgg"), telemetry) as engine:
        events = {k: (o, c) for k, o, c in _run(engine, 10) if o or c}
    assert events == {2: (["0"], [])}  # never three clean in a row


def test_open_after_one_and_different_thresholds(tmp_path: Path, telemetry: Telemetry) -> None:
    with _engine(tmp_path, _store("bgg"), telemetry, open_after=1, close_after=2) as engine:
        events = {k: (o, c) for k, o, c in _run(engine, 3) if o or c}
    assert events == {0: (["0"], []), 2: ([], ["0"])}


class DuplicatingDetector(LowUtilisationDetector):
    """Returns every finding twice, the copy one severity lower (dedup must keep the worst)."""

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        found = super().evaluate(window)
        return [f.replace(severity="info") for f in found] + found


def test_duplicates_in_one_evaluation_count_once(tmp_path: Path, telemetry: Telemetry) -> None:
    with _engine(tmp_path, _store("bbbb"), telemetry, [DuplicatingDetector()]) as engine:
        opened = [o for _, o, _ in _run(engine, 4)]
        assert opened == [[], [], ["0"], []]
        (active,) = engine.active()
        assert active.severity == "critical"


def test_active_findings_survive_a_restart(tmp_path: Path, telemetry: Telemetry) -> None:
    store = _store("bbbbggg")
    with _engine(tmp_path, store, telemetry) as engine:
        for k in range(3):
            engine.evaluate_once(_segment_end(k))
        (before,) = engine.active()
    with _engine(tmp_path, store, telemetry) as engine:
        assert engine.active() == [before]
        assert not engine.evaluate_once(_segment_end(3)).opened  # still bad: no duplicate
        closed = [c for k in (4, 5, 6) for c in engine.evaluate_once(_segment_end(k)).closed]
    assert [c.id for c in closed] == [before.id]


def test_gauge_counts_active_findings_per_detector_and_job(tmp_path: Path,
                                                            telemetry: Telemetry) -> None:
    """Named by the job (the sidecar's service.name is not the job's), zeros for every
    detector on each job of the last pass."""
    detectors: list[Detector] = [LowUtilisationDetector("low"),
                                 LowUtilisationDetector("never", floor=0.0)]
    with _engine(tmp_path, _store("bbbggg"), telemetry, detectors) as engine:
        assert telemetry.gauge() == {}  # no job judged yet
        for k in range(3):
            engine.evaluate_once(_segment_end(k))
        assert telemetry.gauge() == {("low", "train-a"): 1, ("never", "train-a"): 0}
        for k in range(3, 6):
            engine.evaluate_once(_segment_end(k))
        assert telemetry.gauge() == {("low", "train-a"): 0, ("never", "train-a"): 0}


def test_one_log_record_per_open_and_close(tmp_path: Path, telemetry: Telemetry) -> None:
    with _engine(tmp_path, _store("bbbbbggg"), telemetry) as engine:
        list(_run(engine, 8))
    records = [r.log_record for r in telemetry.logs.get_finished_logs()]
    assert [r.event_name for r in records] == ["seedance.finding.opened", "seedance.finding.closed"]
    opened, closed = records
    assert opened.attributes is not None and closed.attributes is not None
    assert opened.attributes["seedance.finding.detector"] == "low_utilisation"
    assert opened.attributes["seedance.finding.resource.gpu"] == "0"
    assert opened.attributes["seedance.finding.id"] == closed.attributes["seedance.finding.id"]
    assert opened.timestamp == _segment_end(2) and closed.timestamp == _segment_end(7)
    assert isinstance(opened.body, str) and "busy 20%" in opened.body
    assert opened.severity_text == "CRITICAL"


class BrokenDetector(Detector):
    name = "broken"

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        raise RuntimeError("bug")


def test_a_failing_detector_does_not_stop_the_others(tmp_path: Path, telemetry: Telemetry) -> None:
    with _engine(tmp_path, _store("bbb"), telemetry,
                 [BrokenDetector(), LowUtilisationDetector()]) as engine:
        reports = [engine.evaluate_once(_segment_end(k)) for k in range(3)]
    assert reports[0].errors == {("broken", "train-a"): "evaluate: RuntimeError: bug"}
    assert telemetry.counter(ERRORS_METRIC) == {("broken", "train-a", "evaluate"): 3}
    assert [f.resource["gpu"] for f in reports[2].opened] == ["0"]


def test_a_finding_that_cannot_be_saved_is_contained_counted_and_retried(
        tmp_path: Path, telemetry: Telemetry) -> None:
    # A real state DB that refuses one detector's rows (an SQLite trigger aborts the insert,
    # as a full disk would): the other detector's finding still opens in the same pass.
    detectors: list[Detector] = [LowUtilisationDetector(),
                                 LowUtilisationDetector("low_utilisation_too")]
    with _engine(tmp_path, _store("bbbbb"), telemetry, detectors, open_after=1) as engine:
        with sqlite3.connect(tmp_path / "state.db") as db:
            db.execute("CREATE TRIGGER refuse BEFORE INSERT ON findings "
                       "WHEN NEW.detector = 'low_utilisation' "
                       "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
        first = engine.evaluate_once(_segment_end(0))
        assert [f.detector for f in first.opened] == ["low_utilisation_too"]
        assert "disk is full" in first.errors[("low_utilisation", "train-a")]
        assert first.errors[("low_utilisation", "train-a")].startswith("save: ")
        assert [f.detector for f in engine.active()] == ["low_utilisation_too"]
        with sqlite3.connect(tmp_path / "state.db") as db:
            db.execute("DROP TRIGGER refuse")
        second = engine.evaluate_once(_segment_end(1))
        assert [f.detector for f in second.opened] == ["low_utilisation"] and not second.errors
    assert telemetry.counter(ERRORS_METRIC) == {("low_utilisation", "train-a", "save"): 1}


class DiskCheck(SelfCheck):
    """Reports what a test says holds now, as the sidecar's unwritable-store check would."""

    name = "store_unwritable"

    def __init__(self) -> None:
        self.error: str | None = None

    def findings(self) -> list[Finding]:
        return [] if self.error is None else [Finding(
            detector=self.name, job="(sidecar)", resource={"part": "store"},
            severity="critical", evidence=Evidence(summary=self.error, model="last write"))]


def test_a_self_check_opens_and_closes_at_once_even_when_its_finding_cannot_be_saved(
        tmp_path: Path, telemetry: Telemetry) -> None:
    disk = DiskCheck()
    with PolicyEngine([LowUtilisationDetector()], WindowSource(_store("ggg")),
                      db_url=sqlite_url(tmp_path / "state.db"), self_checks=[disk],
                      config=EngineConfig(interval_s=1.0, window_s=DECADE - 1, open_after=3),
                      meter_provider=telemetry.meters, logger_provider=telemetry.loggers
                      ) as engine:
        assert not engine.evaluate_once(_segment_end(0)).opened
        with sqlite3.connect(tmp_path / "state.db") as db:  # the state DB is full too
            db.execute("CREATE TRIGGER refuse BEFORE INSERT ON findings "
                       "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
        disk.error = "store not writable: database or disk is full"
        first = engine.evaluate_once(_segment_end(1))
        assert [f.detector for f in first.opened] == ["store_unwritable"]  # no hysteresis
        assert "disk is full" in first.errors[("store_unwritable", "(sidecar)")]
        assert [f.evidence.summary for f in engine.active()] == [disk.error]  # held unsaved
        assert any("store not writable" in str(r.log_record.body)
                   for r in telemetry.logs.get_finished_logs())
        with sqlite3.connect(tmp_path / "state.db") as db:
            db.execute("DROP TRIGGER refuse")
        engine.evaluate_once(_segment_end(2))
        assert [f.detector for f in engine.findings.active()] == ["store_unwritable"]  # saved
        disk.error = None
        closed = engine.evaluate_once(_segment_end(2))
        assert [f.detector for f in closed.closed] == ["store_unwritable"] and not engine.active()


def test_config_and_names_are_validated(tmp_path: Path, telemetry: Telemetry) -> None:
    with pytest.raises(ValueError, match="open_after"):
        EngineConfig(open_after=0)
    with pytest.raises(ValueError, match="interval_s"):
        EngineConfig(interval_s=0)
    with pytest.raises(ValueError, match="unique"):
        _engine(tmp_path, _store("b"), telemetry,
                [LowUtilisationDetector(), LowUtilisationDetector()])


def test_background_loop_opens_and_shuts_down(tmp_path: Path, telemetry: Telemetry) -> None:
    engine = PolicyEngine([LowUtilisationDetector()], WindowSource(_store("b")),
                          db_url=sqlite_url(tmp_path / "state.db"),
                          config=EngineConfig(interval_s=0.01, window_s=9, open_after=3),
                          meter_provider=telemetry.meters, logger_provider=telemetry.loggers,
                          clock_ns=lambda: _segment_end(0))
    engine.start()
    engine.start()  # idempotent
    deadline = time.monotonic() + 20
    while not engine.active() and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.shutdown(timeout_s=5)
    engine.shutdown()  # idempotent
    assert [f.resource for f in engine.active()] == [{"gpu": "0"}]


def test_engines_started_together_do_not_evaluate_in_step(
        tmp_path: Path, telemetry: Telemetry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sidecars of one gang-scheduled job start at once: from their second pass on, their
    engines spread over the interval, and none evaluates again sooner than ``interval_s``."""
    monkeypatch.setattr(engine_module, "_phases", random.Random(0))
    interval_s = 1.0
    passes: dict[int, list[float]] = {}
    engines = []
    for i in range(6):
        engine = PolicyEngine([LowUtilisationDetector()], WindowSource(_store("g")),
                              db_url=sqlite_url(tmp_path / f"state-{i}.db"),
                              config=EngineConfig(interval_s=interval_s, window_s=9),
                              meter_provider=telemetry.meters, clock_ns=lambda: _segment_end(0))
        times = passes.setdefault(i, [])

        def timed(evaluate: Any = engine.evaluate_once, times: list[float] = times) -> Any:
            times.append(time.monotonic())
            return evaluate()

        engine.evaluate_once = timed  # type: ignore[method-assign]
        engines.append(engine)
    for engine in engines:
        engine.start()
    deadline = time.monotonic() + 30
    while min(map(len, passes.values())) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    for engine in engines:
        engine.shutdown(timeout_s=5)
    assert min(map(len, passes.values())) >= 3, passes
    for times in passes.values():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) >= interval_s, gaps
    seconds = [times[1] for times in passes.values()]
    assert max(seconds) - min(seconds) >= 0.3 * interval_s, seconds


def test_engines_sharing_a_state_db_judge_only_the_jobs_they_own(
        tmp_path: Path, telemetry: Telemetry) -> None:
    """Two sidecars on one state DB: B loads A's open finding from it, and neither closes
    nor lists it, though B's own store has no bad data for that job."""
    db = sqlite_url(tmp_path / "state.db")
    config = EngineConfig(interval_s=1.0, window_s=DECADE - 1, open_after=1, close_after=1)
    a = PolicyEngine([LowUtilisationDetector()], WindowSource(_store("bbb", job="job-a")),
                     db_url=db, config=config, meter_provider=telemetry.meters,
                     owns=lambda job: job == "job-a")
    (opened,) = a.evaluate_once(_segment_end(0)).opened
    assert opened.job == "job-a"
    healthy = {UTILISATION: pd.concat([_frame("ggg", "job-a"), _frame("bbb", "job-b")])}
    b = PolicyEngine([LowUtilisationDetector()], WindowSource(FrameStore(healthy)), db_url=db,
                     config=config, meter_provider=telemetry.meters,
                     owns=lambda job: job == "job-b")
    for k in range(3):
        report = b.evaluate_once(_segment_end(k))
        assert all(f.job == "job-b" for f in report.opened + report.closed)
    assert {f.job for f in b.active()} == {"job-b"}
    assert {f.job for f in a.findings.active()} == {"job-a", "job-b"}  # A's is still open
    a.shutdown()
    b.shutdown()
