"""Whether the sidecar can do its job, told truthfully: ``readiness`` for ``/readyz`` and the
API, findings for what an operator must act on (a store or state DB that cannot write, a
rollback the job could not carry out), and metrics of every part that can fail quietly
(scrapes, forwarding, the cardinality limit, the store), exported with the sidecar's own
telemetry."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from collectors.names import (
    ATTR_CPYTHON_GC_GENERATION,
    ATTR_DECODED_BY,
    CPYTHON_GC_COLLECTIONS,
    FORWARD_FAILURES,
    INGEST_ACCEPTED_REQUESTS,
    INGEST_DROPPED_POINTS,
    INGEST_REJECTED_REQUESTS,
    SCRAPE_ERRORS,
    SCRAPE_UP,
    STORE_BUFFERED_POINTS,
    STORE_WRITABLE,
)
from policies import Evidence, Finding, Measurement, SelfCheck
from tuner import MANUAL, Restore

if TYPE_CHECKING:
    from seedancectl._sidecar import Sidecar

STATE_DB_ERROR_TTL_S = 60.0
"""A state-DB write failure keeps the sidecar unready this long after it was last seen, or
until the fleet heartbeat (a write every ``fleet_heartbeat_s``) commits again."""
SIDECAR = "(sidecar)"
"""The ``job`` of findings about a sidecar itself (no job can be named so by a client),
followed by the sidecar's advertised URL: sidecars sharing a state DB each hold their own."""


def sidecar_job(sidecar: Sidecar) -> str:
    """The ``job`` of this sidecar's self-check findings."""
    return f"{SIDECAR} {sidecar.config.advertised_url}"
UNWRITABLE = "sidecar_unwritable"
ROLLBACK_FAILED = "rollback_failed"


def unwritable(sidecar: Sidecar) -> dict[str, str]:
    """Each part that cannot write now (``store``, ``state_db``): the reason."""
    parts = {}
    if sidecar.store is not None and sidecar.store.write_error is not None:
        parts["store"] = f"store not writable: {sidecar.store.write_error}"
    failed = sidecar.fleet.write_error or sidecar.state_db_error
    wrote_at = sidecar.fleet.wrote_at
    if (failed is not None and time.monotonic() - failed[0] < STATE_DB_ERROR_TTL_S
            and (wrote_at is None or wrote_at < failed[0])):
        parts["state_db"] = f"state DB not writable: {failed[1]}"
    return parts


def readiness(sidecar: Sidecar) -> list[str]:
    """Why the sidecar is not ready now; empty when it is."""
    if not sidecar.started or sidecar.store is None:
        return ["starting or stopping"]
    return list(unwritable(sidecar).values())


_CONSEQUENCE = {
    "store": "points wait in memory and ingest answers 503 once the buffer is full",
    "state_db": "no change can be journaled, so none starts, and findings may not be saved",
}


class UnwritableCheck(SelfCheck):
    """The store or the state DB cannot write (disk full, read-only): critical, as every
    decision the sidecar makes reads one and writes the other."""

    name = UNWRITABLE

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def findings(self) -> list[Finding]:
        buffered = 0 if self.sidecar.store is None else self.sidecar.store.buffered
        return [Finding(
            detector=UNWRITABLE, job=sidecar_job(self.sidecar), resource={"part": part}, severity="critical",
            evidence=Evidence(
                summary=f"{reason}; {_CONSEQUENCE[part]}",
                model="the part's last write failed (sidecar readiness, /readyz)",
                measurements=(Measurement(name="store_buffered_points", value=buffered,
                                          unit="{point}"),)))
            for part, reason in unwritable(self.sidecar).items()]


class RollbackFailedCheck(SelfCheck):
    """A rollback the job could not carry out after its retries: the job may run a config or
    model state nobody checked, so a person must look (the change waits in
    ``manual_intervention_required``)."""

    name = ROLLBACK_FAILED

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def findings(self) -> list[Finding]:
        controller = self.sidecar.controller
        if controller is None:
            return []
        found = []
        for change in controller.changes(states=[MANUAL]):
            restore = Restore.from_plan(change.plan)
            attempts = 0 if restore is None else restore.attempt
            problem = "unknown" if restore is None else restore.problem
            found.append(Finding(
                detector=ROLLBACK_FAILED, job=change.job, resource={"change": change.id},
                severity="critical", evidence=Evidence(
                    summary=(f"the rollback of change {change.id} failed {attempts} times "
                             f"(the last: {problem}); nothing else is tried on this job until "
                             f"`seedancectl rollback {change.job}` gets the job's ack"),
                    model="restore confirmation: the job acks its baseline and the rollback "
                          "action (tuner._restore)",
                    measurements=(Measurement(name="restore_attempts", value=attempts,
                                              unit="{attempt}"),))))
        return found


def register_health_metrics(meter: Meter, sidecar: Sidecar) -> None:
    """Observable instruments read at each export (``docs/metrics.md``)."""

    def scrapes_up(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1 if s.stats.up else 0, {"source": s.source.url})
                for s in sidecar.scrapers if s.stats.up is not None]

    def scrape_errors(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s.stats.scrapes_failed, {"source": s.source.url})
                for s in sidecar.scrapers]

    def forwarding(_: CallbackOptions) -> Iterable[Observation]:
        out = []
        for signal, forwarder in sidecar.forwarders().items():
            out += [Observation(forwarder.failed, {"signal": signal, "outcome": "failed"}),
                    Observation(forwarder.dropped, {"signal": signal, "outcome": "dropped"})]
        return out

    def dropped(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(sidecar.limiter.dropped[reason], {"limit": reason})
                for reason in ("metric", "job")]

    def writable(_: CallbackOptions) -> Iterable[Observation]:
        store = sidecar.store
        return [] if store is None else [Observation(0 if store.write_error else 1)]

    def buffered(_: CallbackOptions) -> Iterable[Observation]:
        store = sidecar.store
        return [] if store is None else [Observation(store.buffered)]

    def accepted(_: CallbackOptions) -> Iterable[Observation]:
        stats = sidecar.stats
        return [Observation(stats.requests_accepted, {ATTR_DECODED_BY: "any"}),
                Observation(stats.requests_templated, {ATTR_DECODED_BY: "template"})]

    def rejected(_: CallbackOptions) -> Iterable[Observation]:
        stats = sidecar.stats
        return [Observation(stats.requests_rejected, {"reason": "any"}),
                Observation(stats.requests_unauthorised, {"reason": "unauthorised"}),
                Observation(stats.requests_throttled, {"reason": "throttled"})]

    def collections(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(stats["collections"], {ATTR_CPYTHON_GC_GENERATION: generation})
                for generation, stats in enumerate(gc.get_stats())]

    meter.create_observable_gauge(SCRAPE_UP, [scrapes_up], unit="1",
                                  description="1 when the last scrape of a source worked")
    meter.create_observable_counter(SCRAPE_ERRORS, [scrape_errors],
                                    unit="{scrape}", description="Failed scrapes, per source")
    meter.create_observable_counter(FORWARD_FAILURES, [forwarding], unit="{body}",
                                    description="Bodies the upstream did not take (failed) "
                                    "or that never reached it (dropped: queue full)")
    meter.create_observable_counter(INGEST_DROPPED_POINTS, [dropped],
                                    unit="{point}", description="Points of new series "
                                    "dropped by the cardinality limit (per metric, per job)")
    meter.create_observable_gauge(STORE_WRITABLE, [writable], unit="1",
                                  description="1 when the store's last flush committed")
    meter.create_observable_gauge(STORE_BUFFERED_POINTS, [buffered],
                                  unit="{point}", description="Points waiting for the store's "
                                  "next commit (the backlog)")
    meter.create_observable_counter(INGEST_ACCEPTED_REQUESTS, [accepted], unit="{request}",
                                    description="OTLP requests answered 200 (any) and the "
                                    "metric exports among them decoded from a template")
    meter.create_observable_counter(INGEST_REJECTED_REQUESTS, [rejected],
                                    unit="{request}",
                                    description="OTLP requests answered 4xx/5xx (any) and those "
                                    "without the ingest token (unauthorised)")
    meter.create_observable_counter(CPYTHON_GC_COLLECTIONS, [collections],
                                    unit="{collection}", description="Collections of each "
                                    "generation by the sidecar's garbage collector")
