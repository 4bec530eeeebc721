"""The fleet's tables in the state database: which sidecars share it, and which jobs each one
owns with the job's fingerprint. Several sidecars pointed at one PostgreSQL see each other's
jobs here; the fleet view and the fleet priors read them.

``baseline`` is the job's kept config as its owner holds it (JSON ``{"version", "values"}``),
written at attach and with each heartbeat: the registry keeps it in memory only, and the
journal cannot rebuild it (a job's first baseline is its launch config, never a change).
"""

from __future__ import annotations

from sqlalchemy import Column, Float, Index, Integer, MetaData, String, Table, Text

fleet_metadata = MetaData()
sidecars_table = Table(
    "fleet_sidecars", fleet_metadata,
    Column("sidecar_id", String(64), primary_key=True),
    Column("url", String(512), nullable=False),
    Column("host", String(256), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),
)
jobs_table = Table(
    "fleet_jobs", fleet_metadata,
    Column("job", String(256), primary_key=True),
    Column("sidecar_id", String(64), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("study", String(512), nullable=True),
    Column("fingerprint", Text, nullable=True),
    Column("baseline", Text, nullable=True),
    Column("attached_at", Float, nullable=False),
    Column("seen_at", Float, nullable=False),
    Index("fleet_jobs_by_sidecar", "sidecar_id"),
)
