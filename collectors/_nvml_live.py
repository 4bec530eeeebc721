"""The live NVML backend: reads the local GPUs through ``pynvml`` (nvidia-ml-py).

``LIVE_FIELDS`` is the raw-field vocabulary every backend and trace shares: one query per
field, keyed as traces record it. ``pynvml`` is imported at ``open()``, never at import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from collectors._nvml_backends import (
    NvmlBackend,
    NvmlGpuLost,
    NvmlUnavailable,
    RawGpu,
    RawPoll,
    Reading,
    error_kind,
    translate,
)

log = logging.getLogger(__name__)

ALL_LINKS_SCOPE = 0xFFFFFFFF
"""NVLink field scope that sums all links (nvml.h: "A scopeId of UINT_MAX returns aggregate
value summed up across all links"). pynvml sets a scope only when given a (field, scope) tuple;
a bare field id silently reads link 0 alone."""

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
                errors[name] = error_kind(error)
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
