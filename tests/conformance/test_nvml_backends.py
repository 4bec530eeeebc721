"""Every NVML backend keeps the ``NvmlBackend`` contract the GPU sampler relies on.

Parametrised over every backend in ``collectors`` (a new subclass fails the suite until it is
listed in BACKENDS): the live one on real ``pynvml`` (its polls are skipped, with the reason,
where no NVIDIA driver answers), the replay of every shipped trace (built from the real
nvidia-smi captures in tests/data) and of a two-GPU trace in which one GPU falls off the bus,
a recording of those replays, and the null one NVML turned off by configuration gives.

The contract: ``open()`` succeeds or raises ``NvmlUnavailable``, ``close()`` is harmless
twice; every GPU a poll reports accounts for every raw field once, as a reading in NVML's
units and range (``RANGES``) or as an error kind; an unsupported field is an error
``"not_supported"``, never a reading nor a raise, and the sampler leaves its metric out; a GPU
that stops answering is ``lost`` in the poll while the others read on, never an exception.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from collectors._nvml import PCIE_LANE_BYTES_PER_S, GpuSampler, GpuSamplerConfig
from collectors._nvml_backends import (
    DisabledBackend,
    NvmlBackend,
    NvmlError,
    NvmlGpuLost,
    NvmlNotSupported,
    NvmlUnavailable,
    RawGpu,
    RawPoll,
    error_kind,
)
from collectors._nvml_live import ALL_FIELDS, LiveNvmlBackend
from collectors._nvml_trace import RecordingBackend, ReplayBackend
from collectors._points import Point
from collectors.traces import trace_names, trace_path
from tests.collectors.test_nvml import write_two_gpu_trace_with_loss
from tests.conformance._product import product_subclasses

LOSS_TRACE = "two_gpu_loss"
"""Not shipped: GPU 0 of the H100 trace and GPU 1 of the L40S one, GPU 1 lost from poll 3."""

POLLS = 4  # the loss trace's GPU 1 is lost in its last two polls

MakeBackend = Callable[[Path, Path], NvmlBackend]
"""(trace to replay, a scratch directory) -> a fresh backend; the ones not replaying ignore
both."""

BACKENDS: dict[str, MakeBackend] = {
    "live": lambda trace, scratch: LiveNvmlBackend(),
    "replay": lambda trace, scratch: ReplayBackend(trace),
    "recording": lambda trace, scratch: RecordingBackend(ReplayBackend(trace),
                                                         scratch / "recorded.jsonl"),
    "disabled": lambda trace, scratch: DisabledBackend(),
}
REPLAYED = {"live": False, "replay": True, "recording": True, "disabled": False}
"""Whether the backend's readings come from a recording rather than live hardware."""

REPLAYING = ("replay", "recording")

TEXT_FIELDS = frozenset({"nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo.busId"})

_ANY = math.inf
RANGES: Mapping[str, tuple[float, float]] = {
    "nvmlDeviceGetMemoryAffinity.node": (0, 1023),  # a NUMA node id
    "nvmlDeviceGetUtilizationRates.gpu": (0, 100),  # percent
    "nvmlDeviceGetUtilizationRates.memory": (0, 100),  # percent
    "nvmlDeviceGetMemoryInfo.used": (0, _ANY),  # bytes
    "nvmlDeviceGetMemoryInfo.total": (1, _ANY),  # bytes
    "nvmlDeviceGetPcieThroughput.TX_BYTES": (0, _ANY),  # KB/s
    "nvmlDeviceGetPcieThroughput.RX_BYTES": (0, _ANY),  # KB/s
    # generations the sampler has a lane rate for; a new one needs its rate there
    "nvmlDeviceGetCurrPcieLinkGeneration": (min(PCIE_LANE_BYTES_PER_S),
                                            max(PCIE_LANE_BYTES_PER_S)),
    "nvmlDeviceGetMaxPcieLinkGeneration": (min(PCIE_LANE_BYTES_PER_S),
                                           max(PCIE_LANE_BYTES_PER_S)),
    "nvmlDeviceGetCurrPcieLinkWidth": (1, 32),  # lanes
    "nvmlDeviceGetMaxPcieLinkWidth": (1, 32),  # lanes
    "nvmlDeviceGetFieldValues.NVLINK_THROUGHPUT_DATA_TX": (0, _ANY),  # KiB, cumulative
    "nvmlDeviceGetFieldValues.NVLINK_THROUGHPUT_DATA_RX": (0, _ANY),  # KiB, cumulative
    "nvmlDeviceGetPowerUsage": (0, _ANY),  # mW
    "nvmlDeviceGetEnforcedPowerLimit": (1, _ANY),  # mW
    "nvmlDeviceGetClockInfo.SM": (0, _ANY),  # MHz
    "nvmlDeviceGetClockInfo.MEM": (0, _ANY),  # MHz
    "nvmlDeviceGetClockInfo.GRAPHICS": (0, _ANY),  # MHz
    "nvmlDeviceGetMaxClockInfo.SM": (1, _ANY),  # MHz
    "nvmlDeviceGetMaxClockInfo.MEM": (1, _ANY),  # MHz
    "nvmlDeviceGetMemoryBusWidth": (1, _ANY),  # bits
    "nvmlDeviceGetTemperature.GPU": (0, 150),  # degrees C (NVML's is unsigned)
    "nvmlDeviceGetCurrentClocksEventReasons": (0, 2**64 - 1),  # a 64-bit mask
    "nvmlDeviceGetTotalEccErrors.CORRECTED": (0, _ANY),  # count
    "nvmlDeviceGetTotalEccErrors.UNCORRECTED": (0, _ANY),  # count
    "nvmlEventSetWait.XidCriticalError": (0, _ANY),  # count since open
}
"""Each numeric raw field's documented range, in NVML's own units (the comment)."""

NOT_AS_AN_ERROR = error_kind(NvmlGpuLost("lost"))  # a lost GPU is ``lost``, not a field error
ERROR_KINDS = frozenset(error_kind(cls("x")) for cls in (
    NvmlError, NvmlUnavailable, NvmlNotSupported)) - {NOT_AS_AN_ERROR}
NOT_SUPPORTED = error_kind(NvmlNotSupported("x"))

FIELD_METRICS: Mapping[str, str] = {
    "nvmlDeviceGetUtilizationRates.gpu": "hw.gpu.utilization",
    "nvmlDeviceGetUtilizationRates.memory": "hw.gpu.memory.utilization",
    "nvmlDeviceGetMemoryInfo.used": "hw.gpu.memory.usage",
    "nvmlDeviceGetMemoryInfo.total": "hw.gpu.memory.limit",
    "nvmlDeviceGetPowerUsage": "hw.power",
    "nvmlDeviceGetEnforcedPowerLimit": "seedance.gpu.power.limit",
    "nvmlDeviceGetMemoryBusWidth": "seedance.gpu.memory.bus_width",
    "nvmlDeviceGetTemperature.GPU": "hw.temperature",
}
"""Raw fields the sampler turns into exactly one point of one metric per GPU."""


@dataclass(frozen=True, slots=True)
class Case:
    """One backend on one scenario (the trace a replaying backend plays; None: no trace)."""

    backend: str
    trace: str | None = None

    @property
    def id(self) -> str:
        """The test id: backend, and trace where it plays one."""
        return self.backend if self.trace is None else f"{self.backend}-{self.trace}"


POLLING_CASES = [Case("live"), Case("disabled"), *(
    Case(backend, trace) for backend in REPLAYING for trace in (*trace_names(), LOSS_TRACE))]
LOSS_CASES = [Case("live"), Case("disabled"), *(Case(b, LOSS_TRACE) for b in REPLAYING)]


class Tap(NvmlBackend):
    """Passes every call through to a backend and keeps the raw polls it returned."""

    def __init__(self, inner: NvmlBackend) -> None:
        self.inner = inner
        self.replayed = inner.replayed
        self.polls: list[RawPoll] = []

    def open(self) -> None:
        """Open the inner backend."""
        self.inner.open()

    def poll(self) -> RawPoll:
        """Poll the inner backend and keep what it returned."""
        self.polls.append(self.inner.poll())
        return self.polls[-1]

    def close(self) -> None:
        """Close the inner backend."""
        self.inner.close()


def _no_driver_reason() -> str | None:
    """Why the live backend cannot poll on this machine, or None where it can."""
    backend = LiveNvmlBackend()
    try:
        backend.open()
    except NvmlUnavailable as e:
        return f"no NVIDIA driver answers on this machine (LiveNvmlBackend.open: {e})"
    finally:
        backend.close()
    return None


def _backend(case: Case, scratch: Path) -> NvmlBackend:
    """A fresh backend for ``case``; skips the cases that cannot poll here."""
    if case.backend == "disabled":
        pytest.skip("NVML turned off has no polls; test_open_* and test_poll_* hold it")
    if case.backend == "live" and (reason := _no_driver_reason()):
        pytest.skip(reason)
    if case.trace == LOSS_TRACE:
        trace = scratch / f"{LOSS_TRACE}.jsonl"
        write_two_gpu_trace_with_loss(trace)
    else:
        trace = trace_path(case.trace or "h100_idle")
    return BACKENDS[case.backend](trace, scratch)


def _raw_polls(backend: NvmlBackend) -> list[RawPoll]:
    backend.open()
    try:
        return [backend.poll() for _ in range(POLLS)]
    finally:
        backend.close()


def _sampled(backend: NvmlBackend) -> tuple[list[RawPoll], list[list[Point]]]:
    """The raw polls and the points the sampler made of each."""
    tap = Tap(backend)
    sampler = GpuSampler(tap, config=GpuSamplerConfig(host_name="conformance"))
    try:
        points = [sampler.poll_once() for _ in range(POLLS)]
    finally:
        sampler.shutdown()
    assert len(tap.polls) == POLLS, "the sampler found the backend unavailable"
    return tap.polls, points


def _gpu_values(points: list[Point], name: str, gpu: RawGpu) -> list[float]:
    return [p.value for p in points
            if p.name == name and p.attributes["gpu.index"] == str(gpu.index)]


def test_every_backend_is_covered(tmp_path: Path) -> None:
    """A new NvmlBackend subclass must be added to BACKENDS (and so to this suite)."""
    made = {type(make(trace_path("h100_idle"), tmp_path)) for make in BACKENDS.values()}
    assert product_subclasses(NvmlBackend) == made
    assert set(REPLAYED) == set(BACKENDS)


def test_every_raw_field_has_a_documented_type_and_range() -> None:
    """A new raw field fails here until its type and range are written down above."""
    assert TEXT_FIELDS.isdisjoint(RANGES)
    assert TEXT_FIELDS | set(RANGES) == set(ALL_FIELDS)


@pytest.mark.parametrize("name", BACKENDS)
def test_open_succeeds_or_says_unavailable_and_close_is_idempotent(
        name: str, tmp_path: Path) -> None:
    """The sampler's only way to go null is NvmlUnavailable from open; it closes on shutdown."""
    backend = BACKENDS[name](trace_path("h100_idle"), tmp_path)
    assert backend.replayed is REPLAYED[name]
    try:
        backend.open()
    except NvmlUnavailable:  # the one failure open() may have: the sampler turns null
        with pytest.raises(NvmlError):
            backend.poll()
    else:
        assert isinstance(backend.poll(), RawPoll)
    backend.close()
    backend.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_poll_before_open_is_the_source_unavailable(name: str, tmp_path: Path) -> None:
    """A poll out of order is a failure of the whole source, never a stray error type."""
    backend = BACKENDS[name](trace_path("h100_idle"), tmp_path)
    with pytest.raises(NvmlUnavailable):
        backend.poll()
    backend.close()  # never opened: still harmless


@pytest.mark.parametrize("case", POLLING_CASES, ids=lambda c: c.id)
def test_every_gpu_accounts_for_every_field_once_with_its_type(
        case: Case, tmp_path: Path) -> None:
    """The sampler reads fields by name and type; a GPU that answers leaves none unexplained."""
    polls = _raw_polls(_backend(case, tmp_path))
    times = [poll.time_ns for poll in polls]
    assert all(isinstance(t, int) and t > 0 for t in times) and times == sorted(times)
    for poll in polls:
        indexes = [gpu.index for gpu in poll.gpus]
        assert indexes and len(set(indexes)) == len(indexes)
        assert all(isinstance(i, int) and i >= 0 for i in indexes)
        for gpu in poll.gpus:
            assert set(gpu.readings) <= set(ALL_FIELDS) and set(gpu.errors) <= set(ALL_FIELDS)
            assert not set(gpu.readings) & set(gpu.errors), gpu
            if not gpu.lost:
                assert set(gpu.readings) | set(gpu.errors) == set(ALL_FIELDS), gpu.index
            assert set(gpu.errors.values()) <= ERROR_KINDS, gpu.errors
            for field, value in gpu.readings.items():
                if field in TEXT_FIELDS:
                    assert isinstance(value, str) and value, (field, value)
                else:
                    assert isinstance(value, int | float) and not isinstance(value, bool), (
                        field, value)


@pytest.mark.parametrize("case", POLLING_CASES, ids=lambda c: c.id)
def test_readings_are_in_nvml_units_and_ranges(case: Case, tmp_path: Path) -> None:
    """Readings stay in NVML's units, so the sampler's one conversion holds for every source."""
    for poll in _raw_polls(_backend(case, tmp_path)):
        for gpu in poll.gpus:
            r = {k: v for k, v in gpu.readings.items() if not isinstance(v, str)}
            assert set(r) == set(gpu.readings) - TEXT_FIELDS  # numbers, as the type test says
            for field, (low, high) in RANGES.items():
                if field in r:
                    assert math.isfinite(r[field]) and low <= r[field] <= high, (field, r[field])
            for part, whole in (
                ("nvmlDeviceGetMemoryInfo.used", "nvmlDeviceGetMemoryInfo.total"),
                ("nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration"),
                ("nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth"),
            ):
                if part in r and whole in r:
                    assert r[part] <= r[whole], (part, r[part], whole, r[whole])


@pytest.mark.parametrize("case", POLLING_CASES, ids=lambda c: c.id)
def test_an_unsupported_field_is_an_error_the_sampler_leaves_out(
        case: Case, tmp_path: Path) -> None:
    """NVML_ERROR_NOT_SUPPORTED is a fact about the GPU: its metric is absent, the GPU is up."""
    polls, points = _sampled(_backend(case, tmp_path))
    unsupported = 0
    for poll, poll_points in zip(polls, points, strict=True):
        for gpu in (g for g in poll.gpus if not g.lost):
            assert _gpu_values(poll_points, "hw.gpu.up", gpu) == [1.0]
            for field, metric in FIELD_METRICS.items():
                if gpu.errors.get(field) == NOT_SUPPORTED:
                    unsupported += 1
                    assert field not in gpu.readings
                    assert _gpu_values(poll_points, metric, gpu) == [], field
                elif field in gpu.readings:
                    assert len(_gpu_values(poll_points, metric, gpu)) == 1, field
    if case.trace is not None:  # every recorded GPU lacks some field (bus width: no capture)
        assert unsupported


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: c.id)
def test_a_lost_gpu_is_reported_down_never_raised(case: Case, tmp_path: Path) -> None:
    """One GPU falling off the bus must not take the others' metrics with it."""
    if case.backend == "live":
        pytest.skip("a live GPU cannot be made to fall off the bus in a test")
    polls, points = _sampled(_backend(case, tmp_path))
    lost_polls = 0
    for poll, poll_points in zip(polls, points, strict=True):
        for gpu in poll.gpus:
            assert _gpu_values(poll_points, "hw.gpu.up", gpu) == [0.0 if gpu.lost else 1.0]
            if gpu.lost:
                assert _gpu_values(poll_points, "hw.power", gpu) == []
        if any(gpu.lost for gpu in poll.gpus):
            lost_polls += 1
            assert any(not gpu.lost and gpu.readings for gpu in poll.gpus)  # the rest read on
    assert lost_polls == 2
