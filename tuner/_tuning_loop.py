"""The sidecar's tuning thread: ticks the rollout controller and proposes each searched job's
next trial."""

from __future__ import annotations

import logging
import random
import threading

from collectors import background_thread
from tuner._change import ACTIVE
from tuner._rollout import RolloutController
from tuner._search import SearchDriver

log = logging.getLogger(__name__)
_phases = random.Random()  # each loop's place in the interval; a test seeds its own


class TuningLoop:
    """The sidecar's rollout thread: every ``interval_s`` it ticks the controller, renews the
    trial leases and, for each job with a search driver and nothing active, proposes the next
    trial. Loops never die (errors are logged); ``start``/``shutdown`` are idempotent.

    The first tick comes at a random point of the first interval: sidecars started together
    (a rollout, a node's restart) on one shared PostgreSQL would otherwise tick in the same
    instant of every second, their reads and lease renewals queueing on each other."""

    def __init__(self, controller: RolloutController, *, interval_s: float = 1.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.controller = controller
        self.interval_s = interval_s
        self._drivers: dict[str, SearchDriver] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_search(self, job: str, driver: SearchDriver) -> None:
        """Tune ``job`` with ``driver`` (also registered as the controller's observer)."""
        with self._lock:
            self._drivers[job] = driver
        self.controller.add_observer(driver)

    def step(self) -> None:
        """One round (the thread calls it; tests may call it directly).

        A job gets a new trial only while it is attached (a search never proposes to a job
        that is gone: it pauses until the job is back) and nothing of it is approved or in
        flight. A proposal waiting for a person does not stall the search: in auto mode the
        search goes on with low-risk moves (they auto-approve and run); the waiting one runs
        when approved, rebased on the baseline of that time."""
        self.controller.tick()
        with self._lock:
            drivers = dict(self._drivers)
        attached = {s.job for s in self.controller.registry.jobs() if s.state == "attached"}
        for job, driver in drivers.items():
            try:
                driver.heartbeat()
                mode = self.controller.mode(job)
                if mode == "off" or job not in attached:
                    continue
                active = self.controller.changes(job=job, states=sorted(ACTIVE))
                if any(c.state != "proposed" for c in active):
                    continue
                if not active:
                    driver.propose_next(self.controller, job)
                elif mode == "auto":
                    driver.propose_next(self.controller, job, low_risk_only=True)
            except Exception:
                log.exception("tuning loop: job %s failed; going on", job)

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = background_thread(self._run, name="rollout")
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout_s)

    def _run(self) -> None:
        wait_s = _phases.uniform(0.0, self.interval_s)
        while not self._stop.wait(wait_s):
            wait_s = self.interval_s
            try:
                self.step()
            except Exception:
                log.exception("tuning loop failed; going on")
