"""The policy engine: runs every detector on every job on an interval, with hysteresis.

A finding opens after ``open_after`` consecutive bad evaluations of its (detector, job,
resource) and closes after ``close_after`` consecutive clean ones, so one noisy window neither
raises nor clears an alarm. Opened and closed findings are saved to the state database and
exported: an OpenTelemetry observable gauge ``seedance.findings.active`` (attributes
``detector`` and ``seedance.job``, the job's name, as the sidecar's own ``service.name`` is not)
and one OpenTelemetry log record per open and close.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from opentelemetry import metrics
from opentelemetry._logs import LoggerProvider, SeverityNumber, get_logger_provider
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from collectors import ConfigError, background_thread
from collectors.names import ATTR_DETECTOR, ATTR_SEEDANCE_JOB, FINDINGS_ACTIVE, POLICY_ERRORS
from policies._detector import Detector, SelfCheck
from policies._findings import Finding, more_severe
from policies._state_db import FindingStore
from policies._window import WindowSource

log = logging.getLogger(__name__)

ACTIVE_FINDINGS_METRIC = FINDINGS_ACTIVE
ERRORS_METRIC = POLICY_ERRORS
"""Observable gauge: findings currently open, attributes ``detector`` and ``seedance.job``."""
FINDING_OPENED_EVENT = "seedance.finding.opened"
FINDING_CLOSED_EVENT = "seedance.finding.closed"
_SCOPE = "seedance.policies"
_LOG_SEVERITY = {"info": SeverityNumber.INFO, "warning": SeverityNumber.WARN,
                 "critical": SeverityNumber.ERROR}

Key = tuple[str, str, str]
_phases = random.Random()  # each engine's place in the interval; a test seeds its own


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How often and over what span the engine evaluates, and its hysteresis."""

    interval_s: float = 15.0
    window_s: float = 300.0
    open_after: int = 3
    close_after: int = 3

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ConfigError(f"interval_s must be > 0, got {self.interval_s}")
        if not self.window_s > 0:
            raise ConfigError(f"window_s must be > 0, got {self.window_s}")
        if self.open_after < 1:
            raise ConfigError(f"open_after must be >= 1, got {self.open_after}")
        if self.close_after < 1:
            raise ConfigError(f"close_after must be >= 1, got {self.close_after}")


@dataclass(slots=True)
class _Track:
    """Hysteresis state of one key: consecutive bad/clean counts and the open finding."""

    bad: int = 0
    clean: int = 0
    finding: Finding | None = None
    saved: bool = True


@dataclass(slots=True)
class EvaluationReport:
    """What one evaluation pass changed (findings as saved) and which detectors failed."""

    opened: list[Finding] = field(default_factory=list)
    closed: list[Finding] = field(default_factory=list)
    updated: list[Finding] = field(default_factory=list)
    errors: dict[tuple[str, str], str] = field(default_factory=dict)


class PolicyEngine:
    """Runs detectors over windows of the store; owns hysteresis, dedup, persistence, export.

    Thread-safe: :meth:`evaluate_once` and the gauge callback share one lock. :meth:`start` runs
    evaluations on a daemon thread every ``config.interval_s`` (from a random phase); the loop
    never dies (an error is logged and the next tick runs). :meth:`shutdown` is idempotent.
    Active findings are reloaded from the database on start-up, so a restart neither reopens
    nor forgets them (pending bad counts of findings not yet open start again from zero).
    """

    def __init__(
        self,
        detectors: Sequence[Detector],
        source: WindowSource,
        *,
        db_url: str,
        config: EngineConfig | None = None,
        meter_provider: MeterProvider | None = None,
        logger_provider: LoggerProvider | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        self_checks: Sequence[SelfCheck] = (),
        owns: Callable[[str], bool] | None = None,
    ) -> None:
        """``owns(job)``: whether this engine judges ``job`` (default: every job). Sidecars
        sharing one state DB see each other's open findings there; each opens, refreshes and
        closes only those of the jobs it owns, its own self checks included."""
        names = [d.name for d in detectors] + [c.name for c in self_checks]
        if len(set(names)) != len(names):
            raise ValueError(f"detectors and self checks: names must be unique, got {names}")
        self.detectors = tuple(detectors)
        self.self_checks = tuple(self_checks)
        self.source = source
        self.config = config or EngineConfig()
        self.findings = FindingStore(db_url)
        self._owns = owns or (lambda _job: True)
        self._clock_ns = clock_ns
        self._lock = threading.Lock()  # the tracks: held briefly, never across a detector
        self._evaluating = threading.Lock()  # one evaluation at a time
        self._tracks: dict[Key, _Track] = {
            f.key: _Track(finding=f) for f in self.findings.active()}
        self._judged: frozenset[str] = frozenset()  # the jobs of the last pass
        meter = (meter_provider or metrics.get_meter_provider()).get_meter(_SCOPE)
        meter.create_observable_gauge(
            ACTIVE_FINDINGS_METRIC, callbacks=[self._observe_active], unit="{finding}",
            description="Findings currently open, per detector")
        self._errors = meter.create_counter(
            ERRORS_METRIC, unit="{error}",
            description="Evaluations that failed for one detector and job, by stage")
        self._logger = (logger_provider or get_logger_provider()).get_logger(_SCOPE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- evaluation -------------------------------------------------------------------------

    def evaluate_once(self, now_ns: int | None = None) -> EvaluationReport:
        """Evaluate every detector on every job over the window ending at ``now_ns``."""
        now = self._clock_ns() if now_ns is None else now_ns
        since = now - int(self.config.window_s * 1e9)
        report = EvaluationReport()
        # Detectors read the store for seconds on a loaded box; the tracks lock is taken only
        # to apply each verdict, so ``active()`` (a guardrail reads it every rollout tick)
        # never waits for an evaluation.
        with self._evaluating:
            for check in self.self_checks:  # first: they report what may break the rest
                self._check_self(check, now, report)
            with self._lock:
                tracked = {job for _, job, _ in self._tracks if self._owns(job)}
            try:
                jobs = {j for j in self.source.jobs(active_since_ns=since)
                        if self._owns(j)} | tracked
            except Exception as e:  # a store that cannot be read: no detector can run
                self._failed("*", "*", "jobs", e, report)
                return report
            with self._lock:
                self._judged = frozenset(jobs)
            for job in sorted(jobs):
                window = self.source.window(job, since, now)  # one per job: detectors share reads
                for detector in self.detectors:
                    try:
                        found = detector.evaluate(window)
                    except Exception as e:  # a detector bug must not stop the others
                        self._failed(detector.name, job, "evaluate", e, report)
                        continue
                    try:
                        with self._lock:
                            self._apply(detector.name, job, found, now, report)
                    except Exception as e:  # nor a state DB that cannot save its findings
                        self._failed(detector.name, job, "save", e, report)
        return report

    def _check_self(self, check: SelfCheck, now: int, report: EvaluationReport) -> None:
        """A self check's findings open and close at once, and are held even when the state DB
        cannot save them (that may be the very condition they report)."""
        try:
            found = [f for f in check.findings() if f.detector == check.name]
        except Exception as e:
            self._failed(check.name, "*", "evaluate", e, report)
            return
        with self._lock:
            jobs = {f.job for f in found} | {j for d, j, _ in self._tracks
                                             if d == check.name and self._owns(j)}
        for job in sorted(jobs):
            try:
                with self._lock:
                    self._apply(check.name, job, [f for f in found if f.job == job], now,
                                report, open_after=1, close_after=1, hold_unsaved=True)
            except Exception as e:
                self._failed(check.name, job, "save", e, report)

    def _failed(self, detector: str, job: str, stage: str, error: Exception,
                report: EvaluationReport) -> None:
        """Contained to this detector and job: logged, counted, reported. A finding that could
        not be saved is not open (or not closed) yet; the next pass tries again."""
        log.exception("detector %s failed on job %s (%s)", detector, job, stage)
        report.errors[(detector, job)] = f"{stage}: {type(error).__name__}: {error}"
        self._errors.add(1, {"detector": detector, "job": job, "stage": stage})

    def _apply(self, detector: str, job: str, found: Iterable[Finding], now: int,
               report: EvaluationReport, *, open_after: int | None = None,
               close_after: int | None = None, hold_unsaved: bool = False) -> None:
        open_after = self.config.open_after if open_after is None else open_after
        close_after = self.config.close_after if close_after is None else close_after
        bad: dict[Key, Finding] = {}
        for finding in found:
            if finding.detector != detector or finding.job != job:
                log.error("detector %s returned a finding for (%s, %s); dropped",
                          detector, finding.detector, finding.job)
                continue
            seen = bad.get(finding.key)
            if seen is None or more_severe(finding.severity, seen.severity) != seen.severity:
                bad[finding.key] = finding  # dedup: keep the most severe per resource
        for key, finding in bad.items():
            track = self._tracks.setdefault(key, _Track())
            track.bad, track.clean = track.bad + 1, 0
            if track.finding is not None:
                self._refresh(track, finding, report)
            elif track.bad >= open_after:
                self._open(track, finding, now, report, hold_unsaved=hold_unsaved)
        for key in [k for k in self._tracks if k[:2] == (detector, job) and k not in bad]:
            track = self._tracks[key]
            track.bad, track.clean = 0, track.clean + 1
            if track.finding is None:
                del self._tracks[key]
            elif track.clean >= close_after:
                self._close(key, track, now, report)

    def _open(self, track: _Track, finding: Finding, now: int, report: EvaluationReport, *,
              hold_unsaved: bool = False) -> None:
        opened = finding.replace(id=uuid.uuid4().hex, opened_at_ns=now, closed_at_ns=None)
        if not hold_unsaved:
            self.findings.save(opened)
        track.finding, track.saved = opened, not hold_unsaved
        report.opened.append(opened)
        self._emit(opened, FINDING_OPENED_EVENT, now)
        if hold_unsaved:  # open already: a save that fails is tried again at the next pass
            self.findings.save(opened)
            track.saved = True

    def _refresh(self, track: _Track, finding: Finding, report: EvaluationReport) -> None:
        assert track.finding is not None
        current = track.finding
        latest = finding.replace(id=current.id, opened_at_ns=current.opened_at_ns,
                                 closed_at_ns=None)
        if latest != current or not track.saved:
            self.findings.save(latest)
            track.finding, track.saved = latest, True
            if latest != current:
                report.updated.append(latest)

    def _close(self, key: Key, track: _Track, now: int, report: EvaluationReport) -> None:
        assert track.finding is not None
        closed = track.finding.replace(closed_at_ns=now)
        self.findings.save(closed)
        del self._tracks[key]
        report.closed.append(closed)
        self._emit(closed, FINDING_CLOSED_EVENT, now)

    # -- export -----------------------------------------------------------------------------

    def active(self) -> list[Finding]:
        """The findings open now, as the engine holds them."""
        with self._lock:
            return [t.finding for t in self._tracks.values()
                    if t.finding is not None and self._owns(t.finding.job)]

    def _observe_active(self, _options: CallbackOptions) -> Iterable[Observation]:
        """Per detector and job, zeros included for the jobs of the last pass, so a job's
        series exist (and read 0) before its first finding."""
        with self._lock:
            judged = self._judged
        counts = {(d.name, job): 0 for d in self.detectors for job in judged}
        for finding in self.active():
            key = (finding.detector, finding.job)
            counts[key] = counts.get(key, 0) + 1
        return [Observation(n, {ATTR_DETECTOR: name, ATTR_SEEDANCE_JOB: job})
                for (name, job), n in counts.items()]

    def _emit(self, finding: Finding, event: str, now: int) -> None:
        opened = event == FINDING_OPENED_EVENT
        attributes: dict[str, str | int] = {
            "seedance.finding.id": finding.id,
            "seedance.finding.detector": finding.detector,
            "seedance.finding.job": finding.job,
            "seedance.finding.severity": finding.severity,
            "seedance.finding.opened_at_ns": finding.opened_at_ns or 0,
        }
        attributes.update({f"seedance.finding.resource.{k}": v
                           for k, v in finding.resource.items()})
        if finding.closed_at_ns is not None:
            attributes["seedance.finding.closed_at_ns"] = finding.closed_at_ns
        try:
            self._logger.emit(
                timestamp=now,
                observed_timestamp=time.time_ns(),
                severity_number=_LOG_SEVERITY[finding.severity] if opened else SeverityNumber.INFO,
                severity_text=finding.severity.upper() if opened else "INFO",
                body=("Opened: " if opened else "Closed: ") + finding.render(),
                attributes=attributes,
                event_name=event,
            )
        except Exception:  # exporting is best effort; the finding is already saved
            log.exception("could not emit the %s log record of finding %s", event, finding.id)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Evaluate now, then after ``interval_s`` and a random part of it more, then every
        ``interval_s``, on a daemon thread (idempotent). Sidecars started together, as a
        gang-scheduled job's are, would otherwise evaluate in step, each pass's reads and
        writes arriving at the shared state DB (and at a shared CPU) at the same moment."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self._thread is None:
            self._thread = background_thread(self._loop, name="policy-engine")
            self._thread.start()

    def _loop(self) -> None:
        wait_s = self.config.interval_s * (1.0 + _phases.random())
        while True:
            try:
                self.evaluate_once()
            except Exception:  # the loop never dies
                log.exception("policy evaluation failed; retrying in %.1f s", wait_s)
            if self._stop.wait(wait_s):
                return
            wait_s = self.config.interval_s

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop (waiting up to ``timeout_s``) and close the database; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.findings.close()

    def __enter__(self) -> PolicyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
