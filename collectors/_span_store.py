"""Where the sidecar keeps spans: a ``spans`` table in the state database.

Kept next to the changes they explain (same SQLAlchemy URL), so "show me the trace of change C"
is one query, and a sidecar without a tracing backend still has every decision's trace. A span
sent twice (an exporter retrying after a 503) is stored once: (trace id, span id) is the key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    MetaData,
    String,
    Table,
    Text,
    insert,
    select,
    tuple_,
)

from collectors._otlp_traces import SpanRecord
from collectors._state_engine import autocommit_reads, release_state_engine, shared_state_engine

_metadata = MetaData()
spans_table = Table(
    "spans", _metadata,
    Column("trace_id", String(32), primary_key=True),
    Column("span_id", String(16), primary_key=True),
    Column("parent_span_id", String(16), nullable=False),
    Column("name", String(256), nullable=False),
    Column("start_ns", BigInteger, nullable=False),
    Column("end_ns", BigInteger, nullable=False),
    Column("status", String(8), nullable=False),
    Column("status_message", Text, nullable=False),
    Column("service", String(256), nullable=False),
    Column("attributes", Text, nullable=False),
    Column("resource", Text, nullable=False),
    Index("spans_by_start", "start_ns"),
)


class SpanStore:
    """Saves and reads spans. Thread-safe (one pooled engine); ``close`` is idempotent."""

    def __init__(self, db_url: str) -> None:
        self._engine = shared_state_engine(db_url)
        self._reads = autocommit_reads(self._engine)
        _metadata.create_all(self._engine)

    def write(self, spans: Sequence[SpanRecord]) -> int:
        """Insert the spans not stored yet; returns how many were new."""
        rows = {(s.trace_id, s.span_id): s for s in spans}
        if not rows:
            return 0
        with self._engine.begin() as conn:
            known = set(conn.execute(select(spans_table.c.trace_id, spans_table.c.span_id).where(
                tuple_(spans_table.c.trace_id, spans_table.c.span_id).in_(list(rows)))).all())
            new = [_row(s) for key, s in rows.items() if key not in known]
            if new:
                conn.execute(insert(spans_table), new)
        return len(new)

    def spans_for_trace(self, trace_id: str) -> list[SpanRecord]:
        """Every stored span of the trace (hex id), by start time."""
        query = select(spans_table).where(spans_table.c.trace_id == trace_id.lower()).order_by(
            spans_table.c.start_ns, spans_table.c.end_ns, spans_table.c.span_id)
        with self._reads.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [SpanRecord(**{**row, "attributes": json.loads(row["attributes"]),
                              "resource": json.loads(row["resource"])}) for row in rows]

    def close(self) -> None:
        release_state_engine(self._engine)


def _row(span: SpanRecord) -> dict[str, Any]:
    return {**span.to_dict(), "attributes": json.dumps(dict(span.attributes), sort_keys=True),
            "resource": json.dumps(dict(span.resource), sort_keys=True)}


__all__ = ["SpanStore", "spans_table"]
