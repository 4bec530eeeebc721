"""NVML traces: the JSONL format, and the backends that record one and replay one.

A trace is one header line (where every value came from) and one line per raw poll, so a
recording of a live GPU, or a trace built from nvidia-smi captures, feeds the sampler exactly
as the GPU would.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from collectors._nvml_backends import (
    NvmlBackend,
    NvmlTraceError,
    NvmlUnavailable,
    RawGpu,
    RawPoll,
)
from collectors._nvml_live import ALL_FIELDS

TRACE_FORMAT = "seedance.nvml-trace/1"
"""The header's ``format``; a reader refuses any other."""


def _poll_record(poll: RawPoll, t_s: float) -> dict[str, Any]:
    return {"t_s": round(t_s, 6), "gpus": [
        {"index": g.index, "readings": dict(g.readings), "errors": dict(g.errors),
         "lost": g.lost} for g in poll.gpus
    ]}


def write_trace(out: IO[str], header: Mapping[str, Any], records: Iterator[dict[str, Any]] |
                list[dict[str, Any]]) -> None:
    """Write a trace: one header line, then one line per poll (see ``ReplayBackend``)."""
    out.write(json.dumps({"format": TRACE_FORMAT, **header}, sort_keys=True) + "\n")
    for record in records:
        out.write(json.dumps(record, sort_keys=True) + "\n")


class RecordingBackend(NvmlBackend):
    """Wraps another backend and appends every raw poll it returns to a JSONL trace.

    The header says the values came from the wrapped backend, so a recording of a live GPU
    replays as what it is. The file is flushed after each poll so a crash loses at most one.
    """

    def __init__(self, inner: NvmlBackend, path: Path, *, note: str = "") -> None:
        self._inner = inner
        self._path = Path(path)
        self._note = note
        self._file: IO[str] | None = None
        self._first_ns: int | None = None
        self.replayed = inner.replayed

    def open(self) -> None:
        self._inner.open()
        if self._file is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._path.open("w", encoding="utf-8")
            source = f"recorded by RecordingBackend from {type(self._inner).__name__}"
            write_trace(self._file, {
                "trace": self._path.stem, "note": self._note,
                "recorded_at_ns": time.time_ns(),
                "sources": {name: source for name in ALL_FIELDS},
            }, [])
            self._file.flush()

    def poll(self) -> RawPoll:
        poll = self._inner.poll()
        if self._file is not None:
            if self._first_ns is None:
                self._first_ns = poll.time_ns
            record = _poll_record(poll, (poll.time_ns - self._first_ns) / 1e9)
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
        return poll

    def close(self) -> None:
        self._inner.close()
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """A parsed trace: its header (where every value came from) and its polls in order."""

    header: Mapping[str, Any]
    polls: tuple[tuple[float, tuple[RawGpu, ...]], ...]


def read_trace(path: Path) -> Trace:
    """Parse a JSONL trace; raise ``NvmlTraceError`` naming the line that is wrong."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines:
        raise NvmlTraceError(f"{path}: empty trace")
    number = 1
    try:
        header = json.loads(lines[0])
        if header.get("format") != TRACE_FORMAT:
            raise NvmlTraceError(f"{path}:1: format {header.get('format')!r}, "
                                 f"expected {TRACE_FORMAT!r}")
        polls = []
        for number, line in enumerate(lines[1:], start=2):  # noqa: B007 (read in except)
            record = json.loads(line)
            polls.append((float(record["t_s"]), tuple(
                RawGpu(index=int(g["index"]), readings=g.get("readings", {}),
                       errors=g.get("errors", {}), lost=bool(g.get("lost", False)))
                for g in record["gpus"]
            )))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise NvmlTraceError(f"{path}:{number}: malformed trace record: {e}") from e
    return Trace(header=header, polls=tuple(polls))


class ReplayBackend(NvmlBackend):
    """Feeds a recorded trace to the sampler, one recorded poll per ``poll()``.

    A replayed poll is stamped with the time ``open()`` was called plus its recorded offset, so
    rates derived between polls are the recorded ones however fast the replay is stepped (and
    the stamps track the wall clock when the sampler polls at the recorded interval).
    ``replayed`` is True, so every point made from it carries ``seedance.replayed="true"``.
    With ``loop`` the trace starts over at its end, else the last poll is held.
    """

    replayed = True

    def __init__(self, path: Path, *, loop: bool = True) -> None:
        self.path = Path(path)
        self._loop = loop
        self._trace: Trace | None = None
        self._next = 0
        self._base_ns = 0
        self._cycle_s = 1.0
        self._lock = threading.Lock()

    @property
    def header(self) -> Mapping[str, Any]:
        """The trace header; read it to see where each replayed value came from."""
        if self._trace is None:
            self._trace = read_trace(self.path)
        return self._trace.header

    def open(self) -> None:
        try:
            self._trace = read_trace(self.path)
        except (OSError, NvmlTraceError) as e:
            raise NvmlUnavailable(f"cannot replay NVML trace {self.path}: {e}") from e
        if not self._trace.polls:
            raise NvmlUnavailable(f"cannot replay NVML trace {self.path}: it has no polls")
        times = [t_s for t_s, _ in self._trace.polls]
        step_s = times[1] - times[0] if len(times) > 1 else 1.0
        self._cycle_s = times[-1] - times[0] + step_s
        self._base_ns = time.time_ns() - round(times[0] * 1e9)

    def poll(self) -> RawPoll:
        if self._trace is None:
            raise NvmlUnavailable("poll() before open()")
        with self._lock:
            polls = self._trace.polls
            position = (self._next % len(polls) if self._loop
                        else min(self._next, len(polls) - 1))
            t_s, gpus = polls[position]
            cycle = self._next // len(polls) if self._loop else 0
            self._next += 1
        return RawPoll(time_ns=self._base_ns + round((cycle * self._cycle_s + t_s) * 1e9),
                       gpus=gpus)

    def close(self) -> None:
        self._next = 0
