"""The GPU sampler: one NVML poll per interval, shared by every reader.

Readers never touch NVML: ``snapshot()`` and the OpenTelemetry callbacks read the cached
points of the last poll, so ten readers cost what one does. Raw readings from any backend (live,
recording, replay) become points here, in one place, with the catalogue's names and units,
plus derived PCIe and memory bandwidth peaks.

docs/internals.md, 'The GPU sampler' derives the peaks and gives the units read from NVML.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from collectors._catalogue import GPU_METRICS
from collectors._errors import ConfigError
from collectors._nvml_backends import NvmlBackend, NvmlError, NvmlUnavailable, RawGpu, RawPoll
from collectors._nvml_live import XID_FIELD, LiveNvmlBackend
from collectors._points import REPLAYED_ATTR, MetricKind, Point
from collectors.names import (
    ATTR_ERROR_TYPE,
    ATTR_GPU_INDEX,
    ATTR_GPU_PCI_ADDRESS,
    ATTR_HOST_NAME,
    ATTR_HW_GPU_TASK,
    ATTR_HW_GPU_UUID,
    ATTR_HW_ID,
    ATTR_HW_NAME,
    ATTR_NETWORK_IO_DIRECTION,
    ATTR_NUMA_NODE,
    ATTR_SEEDANCE_JOB,
    GPU_CLOCK,
    GPU_CLOCK_MAX,
    GPU_INFO,
    GPU_MEMORY_BUS_WIDTH,
    GPU_MEMORY_PEAK_BANDWIDTH,
    GPU_NVLINK_THROUGHPUT,
    GPU_PCIE_LINK_GENERATION,
    GPU_PCIE_LINK_PEAK_BANDWIDTH,
    GPU_PCIE_LINK_WIDTH,
    GPU_POWER_LIMIT,
    GPU_THROTTLE_REASONS,
    HW_ERRORS,
    HW_GPU_IO,
    HW_GPU_MEMORY_LIMIT,
    HW_GPU_MEMORY_USAGE,
    HW_GPU_MEMORY_UTILIZATION,
    HW_GPU_UP,
    HW_GPU_UTILIZATION,
    HW_POWER,
    HW_TEMPERATURE,
)

log = logging.getLogger(__name__)

THROTTLE_REASONS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""Bits of nvmlDeviceGetCurrentClocksEventReasons (nvml.h nvmlClocksEventReason*)."""

PCIE_LANE_BYTES_PER_S: dict[int, float] = {
    1: 2.5e9 * 8 / 10 / 8,
    2: 5e9 * 8 / 10 / 8,
    3: 8e9 * 128 / 130 / 8,
    4: 16e9 * 128 / 130 / 8,
    5: 32e9 * 128 / 130 / 8,
    6: 64e9 * 242 / 256 / 8,
}
"""Peak payload bytes/s of one lane in one direction, by PCIe generation (see module doc)."""

PCIE_KB_BYTES = 1000
NVLINK_KIB_BYTES = 1024


def pcie_peak_bytes_per_s(generation: int, width: int) -> float | None:
    """One-direction peak of a PCIe link; None for a generation we have no rate for."""
    lane = PCIE_LANE_BYTES_PER_S.get(generation)
    return None if lane is None else lane * width


def memory_peak_bytes_per_s(bus_width_bits: int, max_memory_clock_mhz: float) -> float:
    """Peak device-memory bandwidth: bus width x max memory clock x 2 (double data rate)."""
    return bus_width_bits / 8 * max_memory_clock_mhz * 1e6 * 2


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSamplerConfig:
    """How often to poll NVML, and the host name the points carry."""

    interval_s: float = 1.0
    host_name: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ConfigError(f"interval_s must be a positive number, got {self.interval_s!r}")
        if not self.host_name:
            raise ConfigError("host_name must not be empty")


_SPEC_KIND = {spec.name: spec.kind for spec in GPU_METRICS}


class GpuSampler:
    """Polls a backend at most once per ``interval_s`` and serves the cached points.

    Thread-safe. ``start()`` runs a daemon loop that polls every interval and never dies;
    without it, ``snapshot()`` polls on demand when the cache is older than ``interval_s``.
    When the backend is not there (no library, no driver) the sampler says so once and serves
    nothing: the sidecar runs on without GPU metrics.
    """

    def __init__(self, backend: NvmlBackend | None = None, *,
                 config: GpuSamplerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend if backend is not None else LiveNvmlBackend()
        self.config = config if config is not None else GpuSamplerConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._opened = False
        self.available = True
        self._points: list[Point] = []
        self._by_name: dict[str, list[Point]] = {}
        self._polled_at: float | None = None
        self._logged: set[tuple[int, str]] = set()
        self._identity: dict[int, dict[str, str]] = {}
        self._nvlink_prev: dict[tuple[int, str], tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_errors: set[str] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Open the backend and start the poll loop; a second call does nothing."""
        with self._lock:
            self._open_locked()
            if not self.available or self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="seedance-nvml", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and release the backend; harmless when repeated."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        with self._lock:
            if self._opened:
                self.backend.close()
                self._opened = False

    def __enter__(self) -> GpuSampler:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    def _open_locked(self) -> None:
        if self._opened or not self.available:
            return
        try:
            self.backend.open()
        except NvmlUnavailable as e:
            self.available = False
            log.warning("NVML unavailable, GPU metrics are off: %s", e)
            return
        self._opened = True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._refresh(force=False)
            except Exception as e:  # the loop never dies; say each kind of failure once
                if type(e).__name__ not in self._loop_errors:
                    self._loop_errors.add(type(e).__name__)
                    log.exception("NVML poll failed; going on")
            with self._lock:
                due = self.config.interval_s if self._polled_at is None else (
                    self._polled_at + self.config.interval_s - self._clock())
            self._stop.wait(max(due, 0.01))

    # -- reading -------------------------------------------------------------------------------

    def snapshot(self) -> list[Point]:
        """The points of the last poll, polling first if they are older than ``interval_s``."""
        self._refresh(force=False)
        with self._lock:
            return list(self._points)

    def poll_once(self) -> list[Point]:
        """Poll now whatever the age of the cache (tests, replays stepped by hand)."""
        self._refresh(force=True)
        with self._lock:
            return list(self._points)

    def cached(self, name: str) -> list[Point]:
        """The cached points of one metric; never polls."""
        with self._lock:
            return list(self._by_name.get(name, ()))

    def register(self, meter: Meter, *, job: Callable[[], str | None] = lambda: None) -> None:
        """Expose every GPU metric as an observable instrument whose callback reads the cache.

        ``job()``: the job these GPUs run now, if one is known, put on each observation as
        ``seedance.job`` (the sidecar's own ``service.name`` does not name it)."""
        for spec in GPU_METRICS:
            callback = self._callback(spec.name, job)
            if spec.kind is MetricKind.SUM:
                meter.create_observable_counter(spec.name, [callback], unit=spec.unit,
                                                description=spec.description)
            else:
                meter.create_observable_gauge(spec.name, [callback], unit=spec.unit,
                                              description=spec.description)

    def _callback(self, name: str, job: Callable[[], str | None]
                  ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            running = job()
            named = {} if running is None else {ATTR_SEEDANCE_JOB: running}
            return [Observation(p.value, {**p.attributes, **named}) for p in self.cached(name)]

        return observe

    def _refresh(self, *, force: bool) -> None:
        with self._lock:
            self._open_locked()
            if not self._opened:
                return
            now = self._clock()
            if not force and self._polled_at is not None and (
                    now - self._polled_at < self.config.interval_s):
                return
            self._polled_at = now
            try:
                poll = self.backend.poll()
            except NvmlError as e:
                self._set_points([])
                log.warning("NVML poll failed: %s", e)
                return
            self._set_points(self._to_points(poll))

    def _set_points(self, points: list[Point]) -> None:
        by_name: dict[str, list[Point]] = defaultdict(list)
        for point in points:
            by_name[point.name].append(point)
        self._points, self._by_name = points, dict(by_name)

    # -- raw readings -> points ----------------------------------------------------------------

    def _once(self, gpu: int, key: str, level: int, message: str, *args: object) -> None:
        if (gpu, key) not in self._logged:
            self._logged.add((gpu, key))
            log.log(level, message, *args)

    def _attributes(self, gpu: RawGpu) -> dict[str, str]:
        r = gpu.readings
        attrs = {ATTR_GPU_INDEX: str(gpu.index), ATTR_HOST_NAME: self.config.host_name}
        for attr, key in ((ATTR_HW_ID, "nvmlDeviceGetUUID"), (ATTR_HW_NAME, "nvmlDeviceGetName"),
                          (ATTR_GPU_PCI_ADDRESS, "nvmlDeviceGetPciInfo.busId")):
            if key in r:
                attrs[attr] = str(r[key])
        if self.backend.replayed:
            attrs[REPLAYED_ATTR] = "true"
        return attrs

    def _to_points(self, poll: RawPoll) -> list[Point]:
        points: list[Point] = []
        for gpu in poll.gpus:
            if gpu.lost:
                self._once(gpu.index, "(lost)", logging.WARNING,
                           "GPU %d is lost (NVML GpuIsLost/Unknown); reporting hw.gpu.up=0",
                           gpu.index)
                attrs = self._identity.get(gpu.index) or self._attributes(gpu)
                points.append(Point(HW_GPU_UP, 0.0, poll.time_ns, attrs))
                continue
            for key, kind in gpu.errors.items():
                level = logging.INFO if kind == "not_supported" else logging.WARNING
                self._once(gpu.index, key, level, "GPU %d: %s gives no value (%s); left out",
                           gpu.index, key, kind)
            attrs = self._attributes(gpu)
            self._identity[gpu.index] = attrs
            points.extend(self._gpu_points(gpu, poll.time_ns, attrs))
        return points

    def _gpu_points(self, gpu: RawGpu, time_ns: int, attrs: Mapping[str, str]) -> list[Point]:
        r = gpu.readings
        out: list[Point] = []

        def emit(name: str, value: float, **extra: str) -> None:
            assert name in _SPEC_KIND, name
            out.append(Point(name, float(value), time_ns, {**attrs, **extra}))

        def have(*keys: str) -> bool:
            return all(isinstance(r.get(k), int | float) for k in keys)

        emit(HW_GPU_UP, 1)
        if "nvmlDeviceGetUUID" in r:
            info = {ATTR_HW_GPU_UUID: str(r["nvmlDeviceGetUUID"])}
            if have("nvmlDeviceGetMemoryAffinity.node"):
                info[ATTR_NUMA_NODE] = str(r["nvmlDeviceGetMemoryAffinity.node"])
            emit(GPU_INFO, 1, **info)
        if have("nvmlDeviceGetUtilizationRates.gpu"):  # semconv: task general (not enc/dec)
            emit(HW_GPU_UTILIZATION, float(r["nvmlDeviceGetUtilizationRates.gpu"]) * 0.01,
                 **{ATTR_HW_GPU_TASK: "general"})
        for name, key, scale in (
            (HW_GPU_MEMORY_UTILIZATION, "nvmlDeviceGetUtilizationRates.memory", 0.01),
            (HW_GPU_MEMORY_USAGE, "nvmlDeviceGetMemoryInfo.used", 1),
            (HW_GPU_MEMORY_LIMIT, "nvmlDeviceGetMemoryInfo.total", 1),
            (HW_POWER, "nvmlDeviceGetPowerUsage", 0.001),
            (GPU_POWER_LIMIT, "nvmlDeviceGetEnforcedPowerLimit", 0.001),
            (GPU_MEMORY_BUS_WIDTH, "nvmlDeviceGetMemoryBusWidth", 1),
            (HW_TEMPERATURE, "nvmlDeviceGetTemperature.GPU", 1),
        ):
            if have(key):
                emit(name, float(r[key]) * scale)
        for direction, key in (("transmit", "nvmlDeviceGetPcieThroughput.TX_BYTES"),
                               ("receive", "nvmlDeviceGetPcieThroughput.RX_BYTES")):
            if have(key):
                emit(HW_GPU_IO, float(r[key]) * PCIE_KB_BYTES,
                     **{ATTR_NETWORK_IO_DIRECTION: direction})
        for state, gen_key, width_key in (
            ("current", "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth"),
            ("max", "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"),
        ):
            if have(gen_key):
                emit(GPU_PCIE_LINK_GENERATION, float(r[gen_key]), state=state)
            if have(width_key):
                emit(GPU_PCIE_LINK_WIDTH, float(r[width_key]), state=state)
        if have("nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth"):
            peak = pcie_peak_bytes_per_s(int(r["nvmlDeviceGetCurrPcieLinkGeneration"]),
                                         int(r["nvmlDeviceGetCurrPcieLinkWidth"]))
            if peak is not None:
                emit(GPU_PCIE_LINK_PEAK_BANDWIDTH, peak)
        for direction, key in (("transmit", "nvmlDeviceGetFieldValues.NVLINK_THROUGHPUT_DATA_TX"),
                               ("receive", "nvmlDeviceGetFieldValues.NVLINK_THROUGHPUT_DATA_RX")):
            if have(key):
                rate = self._nvlink_rate(gpu.index, direction, time_ns, int(r[key]))
                if rate is not None:
                    emit(GPU_NVLINK_THROUGHPUT, rate,
                         **{ATTR_NETWORK_IO_DIRECTION: direction})
        for clock, key in (("sm", "nvmlDeviceGetClockInfo.SM"),
                           ("memory", "nvmlDeviceGetClockInfo.MEM"),
                           ("graphics", "nvmlDeviceGetClockInfo.GRAPHICS")):
            if have(key):
                emit(GPU_CLOCK, float(r[key]), clock=clock)
        for clock, key in (("sm", "nvmlDeviceGetMaxClockInfo.SM"),
                           ("memory", "nvmlDeviceGetMaxClockInfo.MEM")):
            if have(key):
                emit(GPU_CLOCK_MAX, float(r[key]), clock=clock)
        if have("nvmlDeviceGetMemoryBusWidth", "nvmlDeviceGetMaxClockInfo.MEM"):
            emit(GPU_MEMORY_PEAK_BANDWIDTH, memory_peak_bytes_per_s(
                int(r["nvmlDeviceGetMemoryBusWidth"]), float(r["nvmlDeviceGetMaxClockInfo.MEM"])))
        if have("nvmlDeviceGetCurrentClocksEventReasons"):
            mask = int(r["nvmlDeviceGetCurrentClocksEventReasons"])
            for bit in (1 << i for i in range(mask.bit_length())):
                if mask & bit:
                    emit(GPU_THROTTLE_REASONS, 1,
                         reason=THROTTLE_REASONS.get(bit, f"bit_{bit:#x}"))
        for error_type, key in (("ecc_corrected", "nvmlDeviceGetTotalEccErrors.CORRECTED"),
                                ("ecc_uncorrected", "nvmlDeviceGetTotalEccErrors.UNCORRECTED"),
                                ("xid", XID_FIELD)):
            if have(key):
                emit(HW_ERRORS, float(r[key]), **{ATTR_ERROR_TYPE: error_type})
        return out

    def _nvlink_rate(self, gpu: int, direction: str, time_ns: int, kib: int) -> float | None:
        """Bytes/s between this cumulative KiB reading and the last; None on the first or a
        counter reset."""
        previous = self._nvlink_prev.get((gpu, direction))
        self._nvlink_prev[(gpu, direction)] = (time_ns, kib)
        if previous is None or kib < previous[1] or time_ns <= previous[0]:
            return None
        return (kib - previous[1]) * NVLINK_KIB_BYTES / ((time_ns - previous[0]) / 1e9)
