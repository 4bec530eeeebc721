"""The fleet at a glance, from the state database several sidecars share: every job with its
owner and whether that owner is alive, its kept config, the gain its kept changes measured,
its open findings and the changes waiting for a person.

One function (``fleet_view``) gathers it for both faces: ``seedancectl fleet status`` and the
fleet page (``GET /v1/fleet``). It reads the fleet tables, the change journal and the findings;
it computes nothing those do not hold (the kept gains compound as the fleet priors read them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from policies import Finding, FindingStore
from tuner import (
    DEFAULT_HEARTBEAT_S,
    Change,
    ChangeJournal,
    FleetDirectory,
    FleetJob,
    FleetSidecar,
    compounded_gain,
)


@dataclass(frozen=True, kw_only=True)
class FleetJobView:
    """One job as the fleet view shows it.

    ``kept_gain`` compounds the measured throughput gains of the job's kept changes (+0.10 =
    10% more tokens/s than its first baseline), None when none was kept; ``waiting`` are its
    proposed changes, which wait for a person.
    """

    fleet: FleetJob
    kept: tuple[Change, ...]
    kept_gain: float | None
    findings: tuple[Finding, ...]
    waiting: tuple[Change, ...]

    @property
    def owner_alive(self) -> bool:
        """Whether the owning sidecar's heartbeat is fresh."""
        return self.fleet.owner is not None and self.fleet.owner.alive

    def to_json(self, now_s: float) -> dict[str, Any]:
        """The job as ``--json`` and ``GET /v1/fleet`` give it."""
        owner, baseline = self.fleet.owner, self.fleet.baseline
        return {
            "job": self.fleet.job, "kind": self.fleet.kind, "study": self.fleet.study,
            "owner": {"sidecar_id": self.fleet.owner_id,
                      "url": None if owner is None else owner.url,
                      "host": None if owner is None else owner.host,
                      "alive": self.owner_alive,
                      "heartbeat_age_s": None if owner is None else round(
                          now_s - owner.heartbeat_at, 3)},
            "attached_at_s": self.fleet.attached_at, "seen_at_s": self.fleet.seen_at,
            "kept_config": None if baseline is None else baseline.to_json(),
            "kept_changes": [c.id for c in self.kept], "kept_gain": self.kept_gain,
            "findings": [f.to_dict() for f in self.findings],
            "waiting": [json.loads(c.to_json()) for c in self.waiting],
        }


@dataclass(frozen=True, kw_only=True)
class FleetView:
    """The sidecars of the fleet and its jobs, as of ``at_s`` (wall seconds)."""

    at_s: float
    stale_after_s: float
    sidecars: tuple[FleetSidecar, ...]
    jobs: tuple[FleetJobView, ...]

    def to_json(self) -> dict[str, Any]:
        """The whole view as JSON."""
        return {
            "at_s": self.at_s, "stale_after_s": self.stale_after_s,
            "sidecars": [{"sidecar_id": s.sidecar_id, "url": s.url, "host": s.host,
                          "pid": s.pid, "started_at_s": s.started_at,
                          "heartbeat_age_s": round(self.at_s - s.heartbeat_at, 3),
                          "alive": s.alive} for s in self.sidecars],
            "jobs": [j.to_json(self.at_s) for j in self.jobs],
        }


def fleet_view(state_db: str, *, heartbeat_s: float = DEFAULT_HEARTBEAT_S,
               clock: Callable[[], float] = time.time) -> FleetView:
    """Gather the fleet view from the state database at ``state_db`` (read only, but for the
    findings table, which opening a finding store creates when missing)."""
    at_s = clock()
    with FleetDirectory(state_db, heartbeat_s=heartbeat_s, clock=lambda: at_s) as directory:
        sidecars, jobs = directory.sidecars(), directory.jobs()
        stale_after_s = directory.stale_after_s
    journal = ChangeJournal(state_db, create=False)
    try:
        changes = journal.changes(states=["kept", "proposed"])
    finally:
        journal.close()
    with FindingStore(state_db) as findings:
        active = findings.active()
    views = []
    for job in jobs:
        mine = [c for c in changes if c.job == job.job]
        kept = tuple(c for c in mine if c.state == "kept")
        views.append(FleetJobView(
            fleet=job, kept=kept, kept_gain=compounded_gain(kept),
            findings=tuple(f for f in active if f.job == job.job),
            waiting=tuple(c for c in mine if c.state == "proposed")))
    return FleetView(at_s=at_s, stale_after_s=stale_after_s, sidecars=tuple(sidecars),
                     jobs=tuple(views))


__all__ = ["FleetJobView", "FleetView", "fleet_view"]
