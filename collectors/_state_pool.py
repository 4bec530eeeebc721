"""The PostgreSQL connection pool: a pooled connection is checked for life without a round trip.

SQLAlchemy's ``pool_pre_ping`` sends ``SELECT 1`` on every checkout, so every transaction a
sidecar runs on the shared PostgreSQL costs a round trip more, and on a busy fleet each round
trip waits for a core (issue #14's API and ask/tell tails). A server that restarted or dropped
the connection has closed its end of the socket (and usually sent a FATAL message first), so
the idle socket polls readable; one that has said nothing since its last reply polls quiet.
Checkout therefore polls the socket (a system call, no round trip) and pings only a
connection whose socket is not quiet: a dead one fails the ping and every connection pooled
before it is discarded, as ``pool_pre_ping`` does; anything else the server sent unasked (a
notice, a parameter change, a TLS session ticket) costs one ping and keeps the connection.
What no poll can see, a server host that vanished without a word, a ping could not see either
before its TCP timeout.
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
from sqlalchemy import event
from sqlalchemy.exc import DisconnectionError, InvalidatePoolError
from sqlalchemy.pool import QueuePool

_UNASKED = select.POLLIN | select.POLLPRI  # POLLHUP, POLLERR and POLLNVAL come anyway


def socket_is_quiet(connection: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection's socket has nothing waiting and is not closed."""
    poller = select.poll()
    poller.register(connection.fileno(), _UNASKED)
    return not poller.poll(0)


def _ping(connection: psycopg.Connection[Any]) -> None:
    """``SELECT 1`` outside any transaction, the connection's autocommit left as it was."""
    autocommit = connection.autocommit
    connection.autocommit = True
    try:
        connection.execute("SELECT 1")
    finally:
        connection.autocommit = autocommit


def _check_alive(connection: psycopg.Connection[Any], _record: object, _proxy: object) -> None:
    """Checkout listener: raise so the pool replaces a connection the server has dropped."""
    if connection.closed or connection.broken:
        raise DisconnectionError("the pooled connection is closed")
    if socket_is_quiet(connection):
        return
    try:
        _ping(connection)
    except psycopg.Error as exc:
        raise InvalidatePoolError(f"the server dropped a pooled connection: {exc}") from exc


class LivenessCheckedPool(QueuePool):
    """A QueuePool whose checkouts run :func:`_check_alive` (pass as ``poolclass``, so
    Optuna's engine, built from the same keyword arguments, gets it too)."""

    # SQLAlchemy names a pool's logger after its class: under ``sqlalchemy`` its routine
    # lines (pool disposed, recreated) stay at SQLAlchemy's level, not at ours
    _sqla_logger_namespace = "sqlalchemy.pool.impl.LivenessCheckedPool"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # recreate() (engine.dispose) hands the listeners on: add ours once
        if not event.contains(self, "checkout", _check_alive):
            event.listen(self, "checkout", _check_alive)
