"""The sidecar's searches: one Optuna search per job its configuration tunes, fed with the
policy engine's suggestions, the job's compute priors and the fleet priors (the configs kept
by the past jobs nearest to it, ``tuner.FleetPriors``), and paused or resumed by an operator
(journaled, so a restart keeps it). Each attached job's fingerprint goes into the fleet's
table, where the searches of every sidecar sharing the state database find it. Everything here
runs on the tuning thread, except the reads the API makes (``tuning_state``, ``moves_left``)
and ``set_tuning``."""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable
from typing import Any, Literal

from collectors import SeedanceError, StoreReader
from policies import PolicyEngine, StoreWindow
from policies.detectors import ComputePriorsDetector
from seedancectl._config import SidecarConfig
from tuner import (
    STOPPED,
    Change,
    FleetJobs,
    FleetPriors,
    JobRegistry,
    JobStatus,
    RolloutController,
    SearchConfig,
    SearchDriver,
    TuningLoop,
    fleet_moves,
    observed_ceilings,
    suggestions,
    within_bounds,
)

log = logging.getLogger(__name__)

TuningState = Literal["off", "running", "paused"]
TUNING_EVENT = "tuning"

PRIORS_EVERY_S = 5.0
"""How often the sidecar reads a tuned job's compute priors (from its reader)."""


class TuningOffError(SeedanceError):
    """Pause or resume asked of a job the configuration does not tune."""


def auto_bounds(config: SidecarConfig) -> dict[str, Any]:
    """The operator's per-knob bounds, as the controller's auto-approval and the search use
    them (the search stays where changes may auto-approve)."""
    return {k: b.for_controller() for k, b in config.approval.bounds.items()}


def study_name(config: SidecarConfig, job: str) -> str | None:
    """The Optuna study that tunes ``job`` here; None when the configuration does not tune it."""
    job_config = config.job_config(job)
    return (job_config.study or f"seedance:{job}") if job_config.tune else None


class JobSearches:
    """The searches of the jobs the sidecar tunes, set up as each job attaches."""

    def __init__(self, config: SidecarConfig, *, jobs: JobRegistry, reader: StoreReader,
                 engine: PolicyEngine, controller: RolloutController,
                 also: Callable[[], None]) -> None:
        """``also`` runs after each round's set-up, on the tuning thread (the sidecar
        announces waiting proposals there). Priors and ceilings are read from ``reader``."""
        self.config = config
        self._jobs = jobs
        self._reader = reader
        self._engine = engine
        self._controller = controller
        self._searches: dict[str, SearchDriver | None] = {}
        self._priors_from: dict[str, frozenset[str]] = {}
        self._first_seen_s: dict[str, float] = {}
        self._priors_at_s: dict[str, float] = {}
        self._has_priors: set[str] = set()
        self._priors = ComputePriorsDetector()
        self._paused: dict[str, bool] = {}
        self._fleet_jobs = FleetJobs(config.state_db)
        self._fleet = FleetPriors(self._fleet_jobs, controller.journal)
        self._fingerprinted: dict[str, str] = {}  # job -> the session whose fingerprint is in
        # who wrote a fleet row it had to create (whoever owns the row may rewrite it)
        self._sidecar_id = f"{socket.gethostname()}:{config.port}"
        self._also = also
        self.loop: TuningLoop = _SidecarLoop(controller, interval_s=config.tuning_interval_s,
                                             housekeeping=self._round)
        """The tuning thread: each round sets up searches, then ticks the controller and the
        searches, all on this one thread."""

    def _round(self) -> None:
        self.update()
        self._also()

    def close(self) -> None:
        """Release the fleet table's connections (the tuning thread has stopped)."""
        self._fleet_jobs.close()

    def update(self) -> None:
        """A search for every newly attached job the config tunes; the engine's new
        suggestions and the job's compute priors added to its priors; each attached job's
        fingerprint in the fleet's table."""
        for status in self._jobs.jobs():
            if status.state == "attached":
                try:
                    self._record_fingerprint(status)
                except Exception:
                    log.exception("fingerprint of job %s not recorded; going on", status.job)
            if status.state == "attached" and self.config.job_config(status.job).tune:
                try:
                    self._set_up_search(status)
                except Exception:
                    log.exception("tuning set-up of job %s failed; going on", status.job)

    def release(self) -> None:
        """At shutdown, after the controller drained: fail the trials the searches still run
        (a proposal not yet started), each free to be tried again, so none is left running."""
        for job, driver in self._searches.items():
            if driver is None:
                continue
            try:
                released = driver.release(reason=STOPPED)
            except Exception:  # the state DB is down: their leases expire, the next reap
                log.exception("job %s: could not release the search's trials", job)
                continue
            if released:
                log.info("job %s: trial(s) %s released: %s", job, released, STOPPED)

    def searching(self, job: str) -> bool:
        """Whether the job's search is set up (it may still wait to start)."""
        return self._searches.get(job) is not None

    def moves_left(self, job: str) -> int | None:
        """Single moves from the job's baseline its search has not tried (None: no search)."""
        driver = self._searches.get(job)
        if driver is None:
            return None
        return driver.moves_left(self._jobs.status(job).baseline.values)

    def tuning_state(self, job: str) -> TuningState:
        """off (the config does not tune it), paused (by an operator) or running."""
        if not self.config.job_config(job).tune:
            return "off"
        if job not in self._paused:
            last = [e for e in self._controller.events(job=job) if e["kind"] == TUNING_EVENT]
            self._paused[job] = bool(last) and last[-1]["detail"].get("action") == "pause"
        return "paused" if self._paused[job] else "running"

    def set_tuning(self, job: str, action: Literal["pause", "resume"], *, by: str) -> TuningState:
        """Pause or resume the job's search, journaled in the audit log (its source on restart)."""
        before = self.tuning_state(job)
        if before == "off":
            raise TuningOffError(f"job {job}: tuning is not enabled for it in the sidecar's "
                                 f"configuration (jobs.{job}.tune)")
        self._paused[job] = action == "pause"
        self._controller.journal.record(job, TUNING_EVENT, by,
                                        f"tuning {before} -> {self.tuning_state(job)}",
                                        detail={"action": action})
        return self.tuning_state(job)

    def _record_fingerprint(self, status: JobStatus) -> None:
        """The fingerprint of the job's session into the fleet's table, once a session."""
        job = status.job
        if status.fingerprint is None or self._fingerprinted.get(job) == status.session:
            return
        self._fleet_jobs.record_fingerprint(
            job, status.fingerprint, kind=status.kind, sidecar_id=self._sidecar_id,
            study=study_name(self.config, job))
        self._fingerprinted[job] = status.session

    def _set_up_search(self, status: JobStatus) -> None:
        job = status.job
        if job not in self._searches:
            self._first_seen_s[job] = time.monotonic()
            self._searches[job] = driver = self._new_search(status)
            if driver is not None:
                self.loop.add_search(job, driver)
                try:
                    self._add_fleet_priors(status, driver)
                except Exception:
                    log.exception("fleet priors of job %s not read; its search goes on "
                                  "without them", job)
        driver = self._searches[job]
        if driver is None:
            return
        self._add_compute_priors(status, driver)
        findings = [f for f in self._engine.active() if f.job == job]
        ids = frozenset(f.id for f in findings)
        if ids and self._priors_from.get(job) != ids:
            added = driver.add_priors(suggestions(findings, status.baseline.values, status.knobs))
            self._priors_from[job] = ids
            if added:
                log.info("job %s: %d suggestion(s) of the policy engine enqueued", job, added)

    def _add_fleet_priors(self, status: JobStatus, driver: SearchDriver) -> None:
        """The configs measured best on the past jobs nearest to this one, as its first trials (once,
        as its search is set up: what the fleet kept later is for the next job)."""
        if status.fingerprint is None:
            return
        sources = self._fleet.sources(status.job, status.fingerprint)
        moves = fleet_moves(sources, status.baseline.values, driver.distributions)
        if moves and driver.add_priors(moves):
            log.info("job %s: fleet priors: %s", status.job, "; ".join(
                f"{m.values} ({m.why})" for m in moves))

    def _add_compute_priors(self, status: JobStatus, driver: SearchDriver) -> None:
        """The compute priors of the job's profile, read straight from the reader every
        ``PRIORS_EVERY_S`` (the engine opens them as findings too, but only after its
        hysteresis, and the first trials should already follow them)."""
        job, now = status.job, time.monotonic()
        if now - self._priors_at_s.get(job, -math.inf) < PRIORS_EVERY_S:
            return
        self._priors_at_s[job] = now
        until_ns = time.time_ns()
        window = StoreWindow(self._reader, job=job, since_ns=until_ns - int(
            self.config.policy_window_s * 1e9), until_ns=until_ns)
        moves = suggestions(self._priors.evaluate(window), status.baseline.values, status.knobs)
        if moves:
            self._has_priors.add(job)
            if driver.add_priors(moves):
                log.info("job %s: compute priors: %s", job, "; ".join(
                    f"{m.values} expects {m.expected_gain:+.0%}" for m in moves
                    if m.expected_gain is not None))

    def _settled(self, job: str) -> bool:
        """The first trial waits ``tuning_start_after_s`` after the job attached (its first
        steps are warm-up: allocator, caches, a steep loss), or less once its compute priors
        are in: then the search knows which move to try first."""
        waited = time.monotonic() - self._first_seen_s.get(job, time.monotonic())
        start_after = self.config.tuning_start_after_s
        return waited >= start_after or (job in self._has_priors and waited >= start_after / 3)

    def _new_search(self, status: JobStatus) -> SearchDriver | None:
        job, job_config = status.job, self.config.job_config(status.job)
        reader = self._reader
        space = status.knobs.knobs
        searchable = status.knobs.searchable().knobs
        wanted = (list(job_config.knobs) if job_config.knobs is not None
                  else list(searchable))
        unknown = [n for n in wanted if n not in space]
        if unknown:
            log.warning("job %s: knob(s) %s named in the config are not declared by the job; "
                        "not searched", job, ", ".join(unknown))
        bounded = within_bounds(status.knobs, auto_bounds(self.config))
        names = [n for n in wanted if n in bounded.knobs and n in searchable]
        study = study_name(self.config, job)
        if not names or study is None:
            log.warning("job %s: no knobs to search; tuning stays off", job)
            return None
        return _PausableSearch(
            bounded, storage_url=self.config.state_db, knobs=names,
            config=SearchConfig(study_name=study,
                                seed=job_config.seed,
                                revisit_after_s=self.config.tuning_revisit_after_s),
            ceilings=lambda: observed_ceilings(reader, job),
            paused=lambda: self.tuning_state(job) == "paused" or not self._settled(job))


class _PausableSearch(SearchDriver):
    """A search an operator can pause: while ``paused()`` it proposes nothing; a change in
    flight still reports its windows and its end to the study."""

    def __init__(self, *args: Any, paused: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._paused = paused

    def propose_next(self, controller: RolloutController, job: str, *,
                     low_risk_only: bool = False) -> Change | None:
        return None if self._paused() else super().propose_next(
            controller, job, low_risk_only=low_risk_only)


class _SidecarLoop(TuningLoop):
    """The tuning loop with the sidecar's housekeeping first in each round, on the same
    thread, so the search drivers are only ever touched from it."""

    def __init__(self, controller: RolloutController, *, interval_s: float,
                 housekeeping: Callable[[], None]) -> None:
        super().__init__(controller, interval_s=interval_s)
        self._housekeeping = housekeeping

    def step(self) -> None:
        try:
            self._housekeeping()
        except Exception:
            log.exception("sidecar housekeeping failed; going on")
        super().step()
