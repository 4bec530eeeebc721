"""Where raw NVML readings come from: the live library, a recording of it, or a replayed trace.

A backend returns *raw* readings, keyed by the NVML call that produced them and in NVML's own
units (mW, bytes, KB/s, MHz, a bitmask). Turning them into points is the sampler's job, so a
replayed trace goes through exactly the code a live GPU does. Vendor errors are translated here,
at the boundary, with one lookup table; nothing above this module sees a ``pynvml`` type.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from collectors._errors import SeedanceError

log = logging.getLogger(__name__)

TRACE_FORMAT = "seedance.nvml-trace/1"
ALL_LINKS_SCOPE = 0xFFFFFFFF
"""NVLink field scope that sums all links (nvml.h: "A scopeId of UINT_MAX returns aggregate
value summed up across all links"). pynvml sets a scope only when given a (field, scope) tuple;
a bare field id silently reads link 0 alone."""

Reading = int | float | str


class NvmlError(SeedanceError):
    """An NVML call failed; ``field`` names the raw reading it was for, if any."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NvmlUnavailable(NvmlError):
    """No NVML here (no library, no driver, no permission): the sampler becomes a null one."""


class NvmlNotSupported(NvmlError):
    """This GPU does not report this field; the reading is left out, which is not a fault."""


class NvmlGpuLost(NvmlError):
    """The GPU stopped answering (fell off the bus, needs a reset)."""


class NvmlTraceError(NvmlError):
    """A recorded NVML trace is malformed or of an unknown format."""


# pynvml error class name -> (our error, the kind a trace records). Names, not classes, so this
# module imports without pynvml; anything unlisted is an NvmlError of kind "error".
_ERROR_TABLE: dict[str, tuple[type[NvmlError], str]] = {
    "NVMLError_LibraryNotFound": (NvmlUnavailable, "unavailable"),
    "NVMLError_DriverNotLoaded": (NvmlUnavailable, "unavailable"),
    "NVMLError_LibRmVersionMismatch": (NvmlUnavailable, "unavailable"),
    "NVMLError_NoPermission": (NvmlUnavailable, "unavailable"),
    "NVMLError_Uninitialized": (NvmlUnavailable, "unavailable"),
    "NVMLError_NotSupported": (NvmlNotSupported, "not_supported"),
    "NVMLError_FunctionNotFound": (NvmlNotSupported, "not_supported"),
    "NVMLError_NotFound": (NvmlNotSupported, "not_supported"),
    "NVMLError_GpuIsLost": (NvmlGpuLost, "gpu_lost"),
    "NVMLError_Unknown": (NvmlGpuLost, "gpu_lost"),
    "NVMLError_ResetRequired": (NvmlGpuLost, "gpu_lost"),
}


def translate(error: Exception, *, field: str | None = None) -> NvmlError:
    """Map a pynvml (or import) error to ours; callers ``raise translate(e) from e``."""
    if isinstance(error, ImportError):
        return NvmlUnavailable(f"pynvml cannot be imported: {error}", field=field)
    cls, _ = _ERROR_TABLE.get(type(error).__name__, (NvmlError, "error"))
    return cls(f"{type(error).__name__}: {error}", field=field)


def _kind(error: NvmlError) -> str:
    for cls, kind in _ERROR_TABLE.values():
        if type(error) is cls:
            return kind
    return "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class RawGpu:
    """One GPU's raw readings from one poll.

    ``errors`` maps a field that gave no value to why ("not_supported", "error"); a field in
    neither map was not asked for. ``lost`` means the GPU stopped answering during this poll.
    """

    index: int
    readings: Mapping[str, Reading] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)
    lost: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RawPoll:
    """Every GPU's raw readings from one poll, stamped with the wall time they were taken."""

    time_ns: int
    gpus: tuple[RawGpu, ...]


class NvmlBackend(abc.ABC):
    """A source of raw NVML polls.

    Contract: ``open()`` either succeeds or raises ``NvmlUnavailable`` (nothing else), and is
    called once before ``poll()``. ``poll()`` never raises for a field or a GPU that fails: the
    failure is recorded in the ``RawGpu`` it returns; it raises only ``NvmlError`` for a failure
    of the whole library. ``close()`` is idempotent. Calls come from one thread at a time (the
    sampler serialises them); a backend owns its handles and files and nothing else.
    ``replayed`` is True when readings do not come from live hardware.
    """

    replayed: bool = False

    @abc.abstractmethod
    def open(self) -> None:
        """Attach to the source; raise ``NvmlUnavailable`` if it is not there."""

    @abc.abstractmethod
    def poll(self) -> RawPoll:
        """Read every field of every GPU once."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the source; harmless when already closed or never opened."""


# -- live --------------------------------------------------------------------------------------

Query = Callable[[ModuleType, Any], Reading]


def _first_numa_node(nvml: ModuleType, handle: Any) -> int:
    mask = nvml.nvmlDeviceGetMemoryAffinity(handle, 1, nvml.NVML_AFFINITY_SCOPE_NODE)[0]
    if not mask:
        raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
    return (mask & -mask).bit_length() - 1


def _bus_id(nvml: ModuleType, handle: Any) -> str:
    bus_id = nvml.nvmlDeviceGetPciInfo(handle).busId
    return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)


def _field_value(field_name: str) -> Query:
    """One NVML field value summed over all NVLink links (a cumulative KiB counter)."""

    def query(nvml: ModuleType, handle: Any) -> int:
        fid = getattr(nvml, f"NVML_FI_DEV_{field_name}")
        value = nvml.nvmlDeviceGetFieldValues(handle, [(fid, ALL_LINKS_SCOPE)])[0]
        if value.nvmlReturn != nvml.NVML_SUCCESS:
            raise nvml.NVMLError(value.nvmlReturn)
        return int(value.value.ullVal)

    return query


LIVE_FIELDS: dict[str, Query] = {
    "nvmlDeviceGetName": lambda n, h: n.nvmlDeviceGetName(h),
    "nvmlDeviceGetUUID": lambda n, h: n.nvmlDeviceGetUUID(h),
    "nvmlDeviceGetPciInfo.busId": _bus_id,
    "nvmlDeviceGetMemoryAffinity.node": _first_numa_node,
    "nvmlDeviceGetUtilizationRates.gpu": lambda n, h: n.nvmlDeviceGetUtilizationRates(h).gpu,
    "nvmlDeviceGetUtilizationRates.memory":
        lambda n, h: n.nvmlDeviceGetUtilizationRates(h).memory,
    "nvmlDeviceGetMemoryInfo.used": lambda n, h: n.nvmlDeviceGetMemoryInfo(h).used,
    "nvmlDeviceGetMemoryInfo.total": lambda n, h: n.nvmlDeviceGetMemoryInfo(h).total,
    "nvmlDeviceGetPcieThroughput.TX_BYTES":
        lambda n, h: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES),
    "nvmlDeviceGetPcieThroughput.RX_BYTES":
        lambda n, h: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES),
    "nvmlDeviceGetCurrPcieLinkGeneration": lambda n, h: n.nvmlDeviceGetCurrPcieLinkGeneration(h),
    "nvmlDeviceGetMaxPcieLinkGeneration": lambda n, h: n.nvmlDeviceGetMaxPcieLinkGeneration(h),
    "nvmlDeviceGetCurrPcieLinkWidth": lambda n, h: n.nvmlDeviceGetCurrPcieLinkWidth(h),
    "nvmlDeviceGetMaxPcieLinkWidth": lambda n, h: n.nvmlDeviceGetMaxPcieLinkWidth(h),
    "nvmlDeviceGetFieldValues.NVLINK_THROUGHPUT_DATA_TX":
        _field_value("NVLINK_THROUGHPUT_DATA_TX"),
    "nvmlDeviceGetFieldValues.NVLINK_THROUGHPUT_DATA_RX":
        _field_value("NVLINK_THROUGHPUT_DATA_RX"),
    "nvmlDeviceGetPowerUsage": lambda n, h: n.nvmlDeviceGetPowerUsage(h),
    "nvmlDeviceGetEnforcedPowerLimit": lambda n, h: n.nvmlDeviceGetEnforcedPowerLimit(h),
    "nvmlDeviceGetClockInfo.SM": lambda n, h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
    "nvmlDeviceGetClockInfo.MEM": lambda n, h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
    "nvmlDeviceGetClockInfo.GRAPHICS":
        lambda n, h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_GRAPHICS),
    "nvmlDeviceGetMaxClockInfo.SM": lambda n, h: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
    "nvmlDeviceGetMaxClockInfo.MEM":
        lambda n, h: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_MEM),
    "nvmlDeviceGetMemoryBusWidth": lambda n, h: n.nvmlDeviceGetMemoryBusWidth(h),
    "nvmlDeviceGetTemperature.GPU":
        lambda n, h: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
    "nvmlDeviceGetCurrentClocksEventReasons":
        lambda n, h: n.nvmlDeviceGetCurrentClocksEventReasons(h),
    "nvmlDeviceGetTotalEccErrors.CORRECTED": lambda n, h: n.nvmlDeviceGetTotalEccErrors(
        h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC),
    "nvmlDeviceGetTotalEccErrors.UNCORRECTED": lambda n, h: n.nvmlDeviceGetTotalEccErrors(
        h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
}
"""Every raw field the live backend reads, keyed as traces record it (NVML call[.part])."""

XID_FIELD = "nvmlEventSetWait.XidCriticalError"
"""XID critical-error events seen on this GPU since the backend opened (a running count)."""

ALL_FIELDS: tuple[str, ...] = (*LIVE_FIELDS, XID_FIELD)


def _import_pynvml() -> ModuleType:
    import pynvml

    return pynvml


class LiveNvmlBackend(NvmlBackend):
    """Reads the local GPUs through ``pynvml`` (nvidia-ml-py).

    XID errors arrive as NVML events, not as a field: the backend registers for critical XID
    events at ``open()`` and drains them without waiting at each poll.
    """

    def __init__(self, *, import_nvml: Callable[[], ModuleType] = _import_pynvml) -> None:
        self._import_nvml = import_nvml
        self._nvml: ModuleType | None = None
        self._handles: list[Any] = []
        self._events: Any = None
        self._xids: dict[int, int] = {}

    def open(self) -> None:
        if self._nvml is not None:
            return
        try:
            nvml = self._import_nvml()
        except ImportError as e:
            raise translate(e) from e
        try:
            nvml.nvmlInit()
            self._handles = [
                nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())
            ]
        except nvml.NVMLError as e:
            error = translate(e)
            raise NvmlUnavailable(str(error)) from e
        self._nvml = nvml
        self._register_xid_events()

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        assert nvml is not None
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as e:
            log.info("NVML events unavailable, no XID counts: %s", translate(e))
            return
        for index, handle in enumerate(self._handles):
            try:
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._events)
                self._xids[index] = 0
            except nvml.NVMLError as e:
                log.info("GPU %d: no XID events: %s", index, translate(e))

    def _drain_xid_events(self) -> None:
        nvml = self._nvml
        if nvml is None or self._events is None or not self._xids:
            return
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
                index = nvml.nvmlDeviceGetIndex(data.device)
            except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending
                return
            if index in self._xids:
                self._xids[index] += 1
                log.warning("GPU %d: XID %d", index, data.eventData)

    def poll(self) -> RawPoll:
        nvml = self._nvml
        if nvml is None:
            raise NvmlUnavailable("poll() before open()")
        self._drain_xid_events()
        now_ns = time.time_ns()
        return RawPoll(time_ns=now_ns, gpus=tuple(
            self._read_gpu(nvml, index, handle) for index, handle in enumerate(self._handles)
        ))

    def _read_gpu(self, nvml: ModuleType, index: int, handle: Any) -> RawGpu:
        readings: dict[str, Reading] = {}
        errors: dict[str, str] = {}
        for name, query in LIVE_FIELDS.items():
            try:
                readings[name] = query(nvml, handle)
            except nvml.NVMLError as e:
                error = translate(e, field=name)
                if isinstance(error, NvmlGpuLost):
                    return RawGpu(index=index, readings=readings, errors=errors, lost=True)
                errors[name] = _kind(error)
        if index in self._xids:
            readings[XID_FIELD] = self._xids[index]
        else:
            errors[XID_FIELD] = "not_supported"
        return RawGpu(index=index, readings=readings, errors=errors)

    def close(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        try:
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            log.warning("NVML shutdown failed: %s", translate(e))
        self._events = None
        self._handles = []


# -- traces ------------------------------------------------------------------------------------


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


class DisabledBackend(NvmlBackend):
    """The null backend: NVML turned off by configuration, so the sampler serves nothing."""

    def open(self) -> None:
        raise NvmlUnavailable("NVML is turned off in the configuration (nvml = 'off')")

    def poll(self) -> RawPoll:
        raise NvmlUnavailable("NVML is turned off in the configuration (nvml = 'off')")

    def close(self) -> None:
        return None
