"""The sidecar's log: each line with its time, level and source, a failure that repeats said
once a minute, not once per attempt, and a fault outside the sidecar in one line.

Without a handler, Python printed only the bare message of warnings and errors: no time to
match against a job's incident, and every ``info`` (a trial released, priors enqueued) lost.
And while the state database was down for 30 s, one sidecar wrote 5,594 lines with 86
tracebacks: every API call, every tuning round and every detector pass logged the same
refused connection, which buries the one line an on-call engineer needs.
"""

from __future__ import annotations

import logging
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from sqlalchemy.exc import OperationalError

OUR_PACKAGES = ("collectors", "policies", "tuner", "dashboards", "seedancectl", "workloads")
"""Loggers shown from ``info`` up; other libraries' from ``warning`` up."""
REPEAT_PERIOD_S = 60.0
"""A warning or error like one already shown is held back for this long, then shown again
with the count of those held back."""
LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OUTSIDE_FAULTS: tuple[type[BaseException], ...] = (ConnectionError, OperationalError,
                                                   sqlite3.OperationalError)
"""Exceptions that say something outside the sidecar failed (a database or peer refused,
dropped or filled up): logged as one line, since their traceback is the library's connect
path, the same every time, and says nothing the message does not."""
_KINDS_KEPT = 1024  # distinct repeated records remembered; the oldest are forgotten first

RecordKind = tuple[str, int, str, str]


def record_kind(record: logging.LogRecord) -> RecordKind:
    """What makes two records "the same": source, level, message and the exception's first
    line (the same refused connection, whichever thread hit it)."""
    error = ""
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return record.name, record.levelno, record.getMessage(), error


class RepeatedRecords(logging.Filter):
    """Shows the first warning or error of a kind, then at most one per ``period_s``, which
    says how many like it were held back; ``info`` and below always pass."""

    def __init__(self, period_s: float = REPEAT_PERIOD_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.period_s = period_s
        self._clock = clock
        self._shown: dict[RecordKind, tuple[float, int]] = {}  # kind -> (shown at, held back)
        self._lock = threading.Lock()  # a handler filters outside its own lock

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = record_kind(record)
        with self._lock:
            return self._admit(record, kind, self._clock())

    def _admit(self, record: logging.LogRecord, kind: RecordKind, now: float) -> bool:
        shown = self._shown.get(kind)
        if shown is not None and now - shown[0] < self.period_s:
            self._shown[kind] = (shown[0], shown[1] + 1)
            return False
        if shown is not None and shown[1]:
            record.msg = (f"{record.getMessage()} [{shown[1]} more like this in the last "
                          f"{now - shown[0]:.0f} s not shown]")
            record.args = None
        self._shown.pop(kind, None)  # re-inserted last: the dict stays oldest first
        self._shown[kind] = (now, 0)
        while len(self._shown) > _KINDS_KEPT:
            del self._shown[next(iter(self._shown))]
        return True


class SidecarFormatter(logging.Formatter):
    """``LINE_FORMAT``, with an outside fault (`OUTSIDE_FAULTS`) as one line, not a
    traceback."""

    def __init__(self) -> None:
        super().__init__(LINE_FORMAT)

    def formatException(self, ei: tuple[type[BaseException], BaseException, TracebackType | None]
                        | tuple[None, None, None]) -> str:
        exc = ei[1]
        if isinstance(exc, OUTSIDE_FAULTS):
            first = str(exc).splitlines()[0] if str(exc) else ""
            return f"{type(exc).__module__}.{type(exc).__qualname__}: {first} (no traceback: " \
                   "a fault outside the sidecar)"
        return super().formatException(ei)


_handler: logging.Handler | None = None


def configure_sidecar_logging(stream: TextIO | None = None) -> logging.Handler:
    """Route every log record of the sidecar process to ``stream`` (stderr) through one
    handler: timestamped lines, repeats held back. Returns the handler (a second call
    replaces it, so nothing is printed twice)."""
    global _handler
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(SidecarFormatter())
    handler.addFilter(RepeatedRecords())
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in OUR_PACKAGES:
        logging.getLogger(name).setLevel(logging.INFO)
    _handler = handler
    return handler
