"""The change journal: the one owner of the changes, their append-only events (the audit log)
and each job's approval mode in the state database.

Opening a journal creates its tables and does nothing else, so any reader (the report, the
CLI, a second sidecar) may open one; recovering the changes a crash left in flight is the
controller's explicit ``recover()``. Each write is one transaction: a change and the event that
explains it are committed together or not at all.

Several sidecars may share the journal (one PostgreSQL): a move or a save changes a change only
in the state its writer read (compare-and-set; else ``IllegalTransition``), so an approval
racing the controller, or two controllers, never both win; a new change's place in the order
is read and written under a lock (``lock_transaction``); a mode is one upsert.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import func, insert, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from collectors import (
    autocommit_reads,
    lock_transaction,
    release_state_engine,
    shared_state_engine,
)
from tuner._change import Change, ChangeCursor, IllegalTransition, Mode, RolloutError
from tuner._change_tables import change_events_table, changes_table, metadata, modes_table

ORDER_LOCK = "seedance:changes:order"
"""Held while a new change reads the newest ``created_at_ns`` and writes its own above it."""


class ChangeJournal:
    """Reads and writes changes, events and approval modes; thread-safe (one engine)."""

    def __init__(self, db_url: str, *, clock: Callable[[], float] = time.time,
                 create: bool = True) -> None:
        """``create=False`` opens a journal that may not exist yet without creating it (a
        read-only reader: reads answer empty until a controller created the tables)."""
        self._engine: Engine = shared_state_engine(db_url)
        self._reads = autocommit_reads(self._engine)
        self._clock = clock
        self._created = create
        if create:
            metadata.create_all(self._engine)

    def close(self) -> None:
        """Release the database connections."""
        release_state_engine(self._engine)

    # ---- writes ------------------------------------------------------------------------------

    def add(self, change: Change, *, actor: str, reason: str, version_before: int | None,
            detail: Mapping[str, Any]) -> None:
        """Insert a new change with its ``proposed`` event."""
        with self._engine.begin() as conn:
            # Strictly increasing, so "oldest first" is the order of proposal even when the
            # clock does not move between two proposals, nor between two sidecars' proposals.
            lock_transaction(conn, ORDER_LOCK)
            last = conn.execute(select(func.max(changes_table.c.created_at_ns))).scalar()
            created_ns = max(_ns(change.created_at_s), (last or 0) + 1)
            conn.execute(insert(changes_table).values(
                id=change.id, job=change.job, state=change.state, created_at_ns=created_ns,
                updated_at_ns=_ns(self._clock()), body=change.to_json()))
            self._event(conn, change.id, change.job, "proposed", actor, reason,
                        to_state=change.state, version_before=version_before, detail=detail)

    def move(self, before: Change, moved: Change, *, actor: str, reason: str,
             version_before: int | None = None, version_after: int | None = None,
             detail: Mapping[str, Any] | None = None) -> None:
        """Persist a transition and its event, only if nobody moved the change meanwhile."""
        with self._engine.begin() as conn:
            result = conn.execute(update(changes_table).where(
                changes_table.c.id == before.id, changes_table.c.state == before.state).values(
                state=moved.state, updated_at_ns=_ns(self._clock()), body=moved.to_json()))
            if result.rowcount != 1:
                raise IllegalTransition(f"change {before.id} moved under us (was {before.state})")
            self._event(conn, moved.id, moved.job, moved.state, actor, reason,
                        from_state=before.state, to_state=moved.state,
                        version_before=version_before, version_after=version_after,
                        detail=detail or {})

    def save(self, change: Change, *, event: tuple[str, str, int | None] | None = None) -> None:
        """Persist a change's fields within its state, only if nobody moved it meanwhile;
        ``event``: (kind, reason, version)."""
        with self._engine.begin() as conn:
            result = conn.execute(update(changes_table).where(
                changes_table.c.id == change.id, changes_table.c.state == change.state).values(
                updated_at_ns=_ns(self._clock()), body=change.to_json()))
            if result.rowcount != 1:
                raise IllegalTransition(f"change {change.id} moved under us (was {change.state})")
            if event is not None:
                kind, reason, version = event
                self._event(conn, change.id, change.job, kind, "controller", reason,
                            version_after=version, detail={"plan": change.plan})

    def record(self, job: str, kind: str, actor: str, reason: str, *,
               change_id: str | None = None, version_before: int | None = None,
               version_after: int | None = None,
               detail: Mapping[str, Any] | None = None) -> None:
        """Append an event that moves no change (an apply, an attach, a notification)."""
        with self._engine.begin() as conn:
            self._event(conn, change_id, job, kind, actor, reason,
                        version_before=version_before, version_after=version_after,
                        detail=detail or {})

    def set_mode(self, job: str, mode: Mode, *, actor: str, reason: str, old: Mode) -> None:
        """Set the job's approval mode, with the event that says who and why."""
        dialect = postgresql if self._engine.dialect.name == "postgresql" else sqlite
        upsert = dialect.insert(modes_table).values(job=job, mode=mode)
        with self._engine.begin() as conn:
            conn.execute(upsert.on_conflict_do_update(index_elements=[modes_table.c.job],
                                                      set_={"mode": mode}))
            self._event(conn, None, job, "mode", actor, reason or f"{old} -> {mode}",
                        detail={"from": old, "to": mode})

    # ---- reads -------------------------------------------------------------------------------

    def mode(self, job: str) -> Mode | None:
        """The job's approval mode, None when nobody set one."""
        if not self._has_tables():
            return None
        with self._reads.connect() as conn:
            found = conn.execute(select(modes_table.c.mode).where(
                modes_table.c.job == job)).scalar_one_or_none()
        return found  # type: ignore[no-any-return]

    def get(self, change_id: str) -> Change:
        """One change; ``RolloutError`` when there is none by that id."""
        body = None
        if self._has_tables():
            with self._reads.connect() as conn:
                body = conn.execute(select(changes_table.c.body).where(
                    changes_table.c.id == change_id)).scalar_one_or_none()
        if body is None:
            raise RolloutError(f"no change {change_id!r}")
        return Change.from_json(body)

    def changes(self, *, job: str | None = None,
                states: Sequence[str] | None = None) -> list[Change]:
        """Changes, oldest first."""
        return self.changes_page(job=job, states=states)[0]

    def changes_page(self, *, job: str | None = None, states: Sequence[str] | None = None,
                     after: ChangeCursor | None = None, limit: int | None = None
                     ) -> tuple[list[Change], ChangeCursor | None]:
        """Up to ``limit`` changes after ``after``, oldest first, and the cursor of the next
        page (None on the last). A keyset, not an offset: a fleet's journal only grows, and
        an offset page re-reads every row before it."""
        if not self._has_tables():
            return [], None
        c = changes_table.c
        query = select(c.created_at_ns, c.id, c.body).order_by(c.created_at_ns, c.id)
        if job is not None:
            query = query.where(c.job == job)
        if states is not None:
            query = query.where(c.state.in_(list(states)))
        if after is not None:
            query = query.where(tuple_(c.created_at_ns, c.id) > (after.created_at_ns, after.id))
        if limit is not None:
            query = query.limit(limit + 1)  # one more says whether a next page exists
        with self._reads.connect() as conn:
            rows = conn.execute(query).all()
        more = limit is not None and len(rows) > limit
        rows = rows[:limit] if more else rows
        cursor = ChangeCursor(rows[-1].created_at_ns, rows[-1].id) if more else None
        return [Change.from_json(r.body) for r in rows], cursor

    def state_counts(self) -> dict[str, int]:
        """How many changes are in each state, counted by the database: a sidecar's status
        asks on every call, and decoding every change a fleet ever made grows with its
        history."""
        if not self._has_tables():
            return {}
        state = changes_table.c.state
        query = select(state, func.count()).group_by(state).order_by(state)
        with self._reads.connect() as conn:
            return {str(name): int(n) for name, n in conn.execute(query)}

    def events(self, *, change_id: str | None = None,
               job: str | None = None) -> list[dict[str, Any]]:
        """The audit log, oldest first, each event's ``detail`` decoded."""
        if not self._has_tables():
            return []
        query = select(change_events_table).order_by(change_events_table.c.seq)
        if change_id is not None:
            query = query.where(change_events_table.c.change_id == change_id)
        if job is not None:
            query = query.where(change_events_table.c.job == job)
        with self._reads.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [{**row, "detail": json.loads(row["detail"])} for row in rows]

    # ---- internals ---------------------------------------------------------------------------

    def _has_tables(self) -> bool:
        if not self._created:  # tables once there stay there: ask until they are
            with self._reads.connect() as conn:
                self._created = self._engine.dialect.has_table(conn, change_events_table.name)
        return self._created

    def _event(self, conn: Connection, change_id: str | None, job: str, kind: str, actor: str,
               reason: str, *, from_state: str | None = None, to_state: str | None = None,
               version_before: int | None = None, version_after: int | None = None,
               detail: Mapping[str, Any]) -> None:
        conn.execute(insert(change_events_table).values(
            change_id=change_id, job=job, at_ns=_ns(self._clock()), kind=kind,
            from_state=from_state, to_state=to_state, actor=actor, reason=reason,
            version_before=version_before, version_after=version_after,
            detail=json.dumps(_json_safe(detail), sort_keys=True)))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _json_safe(value: Any) -> Any:
    """``value`` with mappings as dicts and non-finite floats as strings ("nan"): the audit
    log is strict JSON, which an API client can parse."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value
