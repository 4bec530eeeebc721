"""Reading the fleet: which sidecars share the state database, whether each is alive, and which
jobs each owns with the job's kept config (``tuner._fleet_tables``).

Apart from ``tuner._fleet`` (one sidecar's membership) because readers are not members: the
CLI, the fleet page and a sidecar looking up another's URL read here and never write. A reader
never creates the tables: a state database no sidecar of this version has used reads empty.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors import ConfigError, autocommit_reads, release_state_engine, shared_state_engine
from tuner._fleet_tables import jobs_table, sidecars_table
from tuner._knobs import Config
from tuner._lease_messages import JobKind

STALE_PERIODS = 3
"""A sidecar whose last heartbeat is older than this many heartbeat periods is taken as gone:
its jobs may be claimed by another, and the fleet view says it is down."""
DEFAULT_HEARTBEAT_S = 2.0


def stale_after_s(heartbeat_s: float) -> float:
    """How old a heartbeat may be before its sidecar counts as gone."""
    if not heartbeat_s > 0:
        raise ConfigError(f"heartbeat_s must be > 0, got {heartbeat_s}")
    return STALE_PERIODS * heartbeat_s


@dataclass(frozen=True, kw_only=True)
class FleetSidecar:
    """One sidecar as its row says; ``alive``: its heartbeat is fresh as of the read."""

    sidecar_id: str
    url: str
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    alive: bool


@dataclass(frozen=True, kw_only=True)
class FleetJob:
    """One job of the fleet: its owner (None when the owner's row is gone), what attached,
    when its owner last saw it attached, and its kept config (None until written)."""

    job: str
    kind: JobKind
    study: str | None
    attached_at: float
    seen_at: float
    owner_id: str
    owner: FleetSidecar | None
    baseline: Config | None


class FleetDirectory:
    """Read-only view of the fleet tables; thread-safe (one pooled engine), a context manager.

    ``heartbeat_s`` is the fleet's heartbeat period (every sidecar of a fleet shares it);
    ``clock`` (wall seconds, as the heartbeats are written) is injectable for tests.
    """

    def __init__(self, db_url: str, *, heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.stale_after_s = stale_after_s(heartbeat_s)
        self._engine: Engine = shared_state_engine(db_url)
        self._reads = autocommit_reads(self._engine)
        self._clock = clock
        self._exists = False

    def __enter__(self) -> FleetDirectory:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Release the connections (idempotent)."""
        release_state_engine(self._engine)

    def sidecars(self) -> list[FleetSidecar]:
        """Every sidecar that registered, oldest start first."""
        if not self._has_tables():
            return []
        now = self._clock()
        with self._reads.connect() as conn:
            rows = conn.execute(select(sidecars_table).order_by(
                sidecars_table.c.started_at, sidecars_table.c.sidecar_id)).mappings().all()
        return [FleetSidecar(**row, alive=now - row["heartbeat_at"] <= self.stale_after_s)
                for row in rows]

    def jobs(self) -> list[FleetJob]:
        """Every job of the fleet, by name."""
        return self._jobs(None)

    def job(self, job: str) -> FleetJob | None:
        """One job, None when no sidecar of the fleet ever claimed it."""
        found = self._jobs(job)
        return found[0] if found else None

    def _jobs(self, only: str | None) -> list[FleetJob]:
        if not self._has_tables():
            return []
        owners = {s.sidecar_id: s for s in self.sidecars()}
        query = select(jobs_table).order_by(jobs_table.c.job)
        if only is not None:
            query = query.where(jobs_table.c.job == only)
        with self._reads.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [FleetJob(job=r["job"], kind=r["kind"], study=r["study"],
                         attached_at=r["attached_at"], seen_at=r["seen_at"],
                         owner_id=r["sidecar_id"], owner=owners.get(r["sidecar_id"]),
                         baseline=_config(r["baseline"])) for r in rows]

    def _has_tables(self) -> bool:
        if not self._exists:  # tables once there stay there: ask until they are
            with self._reads.connect() as conn:
                self._exists = self._engine.dialect.has_table(conn, jobs_table.name)
        return self._exists


def config_json(config: Config) -> str:
    """A kept config as the ``baseline`` column holds it."""
    return json.dumps(config.to_json(), sort_keys=True)


def _config(text: str | None) -> Config | None:
    if text is None:
        return None
    body = json.loads(text)
    return Config(int(body["version"]), dict(body["values"]))


__all__ = ["DEFAULT_HEARTBEAT_S", "STALE_PERIODS", "FleetDirectory", "FleetJob", "FleetSidecar",
           "config_json", "stale_after_s"]
