"""The NVML backend interface: raw readings, the errors a backend may raise, the null backend.

A backend returns *raw* readings, keyed by the NVML call that produced them and in NVML's own
units (mW, bytes, KB/s, MHz, a bitmask). Turning them into points is the sampler's job, so a
replayed trace goes through exactly the code a live GPU does. Vendor errors are translated at
the boundary, with the one lookup table here; nothing above the backends sees a ``pynvml``
type. The backends themselves: ``_nvml_live`` (the GPU), ``_nvml_trace`` (record, replay).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field

from collectors._errors import SeedanceError

Reading = int | float | str
"""One raw NVML reading: a count or measure in NVML's units, or a name/UUID/bus id."""


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


def error_kind(error: NvmlError) -> str:
    """The kind a trace records for ``error`` ("not_supported", "gpu_lost", ...)."""
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


class DisabledBackend(NvmlBackend):
    """The null backend: NVML turned off by configuration, so the sampler serves nothing."""

    def open(self) -> None:
        raise NvmlUnavailable("NVML is turned off in the configuration (nvml = 'off')")

    def poll(self) -> RawPoll:
        raise NvmlUnavailable("NVML is turned off in the configuration (nvml = 'off')")

    def close(self) -> None:
        return None
