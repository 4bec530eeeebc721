"""Time DDP's gradient all-reduce per bucket, through a communication hook (NCCL or gloo).

The hook does exactly what DDP's default ``allreduce_hook`` does and times each bucket from
launch to completion without stalling the step, with algorithm and bus bandwidth per bucket.
Bucket indices change after the first step, so nothing is accumulated per bucket index.
Import this module only in the job: it imports torch.

docs/internals.md, 'All-reduce timing' explains the timing and the buckets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from collectors._catalogue import BY_NAME
from collectors._errors import SeedanceError
from collectors._points import CONFIG_VERSION_ATTR
from collectors.names import (
    ATTR_SEEDANCE_COMM_BACKEND,
    ATTR_SEEDANCE_COMM_BUCKET,
    COMM_ALLREDUCE_ALGBW,
    COMM_ALLREDUCE_BUSBW,
    COMM_ALLREDUCE_BYTES,
    COMM_ALLREDUCE_CALLS,
    COMM_ALLREDUCE_DURATION,
    COMM_STEP_BYTES,
)

__all__ = ["BucketStats", "CollectiveTimer", "StepStats", "bus_bandwidth", "install"]

_LOG = logging.getLogger(__name__)

BACKEND_ATTR = ATTR_SEEDANCE_COMM_BACKEND
BUCKET_ATTR = ATTR_SEEDANCE_COMM_BUCKET

_DURATION = COMM_ALLREDUCE_DURATION
_BYTES = COMM_ALLREDUCE_BYTES
_CALLS = COMM_ALLREDUCE_CALLS
_ALGBW = COMM_ALLREDUCE_ALGBW
_BUSBW = COMM_ALLREDUCE_BUSBW
_STEP_BYTES = COMM_STEP_BYTES

# Seconds: 10 us (a tiny intra-node bucket) to 10 s (a stalled collective).
_LATENCY_BOUNDS_S = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketStats:
    """One bucket's all-reduce in one step."""

    index: int
    size_bytes: int
    latency_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    """All buckets of one step, in launch order (the hook's ``step`` counts from 0)."""

    step: int
    config_version: int
    buckets: tuple[BucketStats, ...]

    @property
    def step_bytes(self) -> int:
        """Bytes all-reduced in this step (sum over buckets)."""
        return sum(b.size_bytes for b in self.buckets)

    @property
    def calls(self) -> int:
        """All-reduce calls in this step (one per bucket)."""
        return len(self.buckets)


@dataclass(slots=True, kw_only=True)
class _Launch:
    """One bucket in flight; ``latency_s`` stays None until its completion has been read."""

    index: int
    size_bytes: int
    started_s: float = 0.0
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None
    latency_s: float | None = None
    recorded: bool = False


@dataclass(slots=True, kw_only=True)
class _Step:
    step: int
    config_version: int
    attributes: Mapping[str, str | int]
    launches: list[_Launch] = field(default_factory=list)


def bus_bandwidth(algbw_bytes_per_s: float, world_size: int) -> float:
    """AllReduce bus bandwidth as nccl-tests defines it: ``algbw * 2(n-1)/n``."""
    return algbw_bytes_per_s * 2 * (world_size - 1) / world_size


class CollectiveTimer:
    """Records per-bucket all-reduce size, latency and bandwidth into OpenTelemetry.

    Thread-safe: the hook runs on the autograd thread, gloo completions on gloo's threads and
    collection on the reader's thread; one lock guards the in-flight steps. Errors in the
    bookkeeping are logged and never reach DDP; errors of the collective itself do.

    ``config_version`` is an int or a callable returning one (as for the training
    instrumentation), read when a step's first bucket is launched; it can be assigned later.
    ``attributes`` (e.g. ``seedance.rank``) are added to every point.
    """

    def __init__(
        self,
        meter: Meter,
        *,
        world_size: int,
        backend: str,
        config_version: Callable[[], int] | int,
        attributes: Mapping[str, str | int] | None = None,
    ) -> None:
        if world_size < 1:
            raise SeedanceError(f"world_size must be >= 1, got {world_size}")
        if not backend:
            raise SeedanceError("backend must be a non-empty name such as 'nccl' or 'gloo'")
        self._world_size = world_size
        self._base_attributes = {**(attributes or {}), BACKEND_ATTR: backend}
        self._lock = threading.Lock()
        self.config_version = config_version
        self._open: _Step | None = None
        self._in_flight: list[_Step] = []
        self._last: StepStats | None = None
        self._next_step = 0
        self._duration = meter.create_histogram(
            _DURATION, unit=BY_NAME[_DURATION].unit, description=BY_NAME[_DURATION].description,
            explicit_bucket_boundaries_advisory=list(_LATENCY_BOUNDS_S),
        )
        self._bytes = meter.create_counter(
            _BYTES, unit=BY_NAME[_BYTES].unit, description=BY_NAME[_BYTES].description
        )
        self._calls = meter.create_counter(
            _CALLS, unit=BY_NAME[_CALLS].unit, description=BY_NAME[_CALLS].description
        )
        for name, callback in (
            (_ALGBW, self._observe_algbw),
            (_BUSBW, self._observe_busbw),
            (_STEP_BYTES, self._observe_step_bytes),
        ):
            meter.create_observable_gauge(
                name, callbacks=[callback], unit=BY_NAME[name].unit,
                description=BY_NAME[name].description,
            )

    @property
    def world_size(self) -> int:
        """Ranks in the process group the hook reduces over."""
        return self._world_size

    @property
    def config_version(self) -> int:
        """The config version in force now."""
        return int(self._version_source())

    @config_version.setter
    def config_version(self, value: Callable[[], int] | int) -> None:
        self._version_source = value if callable(value) else (lambda v=int(value): v)

    def last_step_stats(self) -> StepStats | None:
        """The last step whose every bucket has completed, or None before the first one."""
        self._poll()
        with self._lock:
            return self._last

    # -- called by the hook ------------------------------------------------------------------

    def _launch(self, index: int, is_last: bool, buffer: torch.Tensor) -> _Launch:
        self._poll()
        launch = _Launch(index=index, size_bytes=buffer.numel() * buffer.element_size())
        if buffer.is_cuda:
            launch.start_event = torch.cuda.Event(enable_timing=True)
            launch.start_event.record()
        else:
            launch.started_s = time.perf_counter()
        with self._lock:
            if self._open is None:
                version = self.config_version
                self._open = _Step(
                    step=self._next_step,
                    config_version=version,
                    attributes={**self._base_attributes, CONFIG_VERSION_ATTR: version},
                )
                self._next_step += 1
            self._open.launches.append(launch)
            if is_last:  # every bucket of the step is launched: it waits for completions
                self._in_flight.append(self._open)
                self._open = None
        return launch

    def _completed(self, launch: _Launch) -> None:
        if launch.start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            launch.end_event = end
            return  # read lazily by _poll
        launch.latency_s = time.perf_counter() - launch.started_s
        self._poll()

    # -- bookkeeping -------------------------------------------------------------------------

    def _poll(self) -> None:
        """Read finished CUDA events, record finished buckets, close finished steps."""
        try:
            with self._lock:
                steps = list(self._in_flight)
                if self._open is not None:
                    steps.append(self._open)
                for step in steps:
                    for launch in step.launches:
                        self._settle(step, launch)
                while self._in_flight and all(
                    launch.recorded for launch in self._in_flight[0].launches
                ):
                    step = self._in_flight.pop(0)
                    self._last = self._summarise(step)
                    # Once per step, not per bucket: each OTel measurement costs tens of us.
                    self._bytes.add(self._last.step_bytes, step.attributes)
                    self._calls.add(self._last.calls, step.attributes)
        except Exception:  # the job must never die of its telemetry
            _LOG.exception("collective timing bookkeeping failed; dropping this reading")

    def _settle(self, step: _Step, launch: _Launch) -> None:
        if launch.recorded:
            return
        if launch.latency_s is None:
            end = launch.end_event
            if end is None or not end.query():
                return
            assert launch.start_event is not None
            launch.latency_s = launch.start_event.elapsed_time(end) / 1e3
        launch.recorded = True
        self._duration.record(launch.latency_s, step.attributes)

    def _summarise(self, step: _Step) -> StepStats:
        buckets = []
        for launch in step.launches:
            assert launch.latency_s is not None
            algbw = launch.size_bytes / launch.latency_s if launch.latency_s > 0 else 0.0
            buckets.append(BucketStats(
                index=launch.index,
                size_bytes=launch.size_bytes,
                latency_s=launch.latency_s,
                algbw_bytes_per_s=algbw,
                busbw_bytes_per_s=bus_bandwidth(algbw, self._world_size),
            ))
        return StepStats(
            step=step.step, config_version=step.config_version, buckets=tuple(buckets)
        )

    # -- observable gauges -------------------------------------------------------------------

    def _observed_step(self) -> tuple[StepStats | None, dict[str, str | int]]:
        last = self.last_step_stats()
        if last is None:
            return None, {}
        return last, {**self._base_attributes, CONFIG_VERSION_ATTR: last.config_version}

    def _observe_algbw(self, options: CallbackOptions) -> Iterable[Observation]:
        last, attributes = self._observed_step()
        return [] if last is None else [
            Observation(b.algbw_bytes_per_s, {**attributes, BUCKET_ATTR: b.index})
            for b in last.buckets
        ]

    def _observe_busbw(self, options: CallbackOptions) -> Iterable[Observation]:
        last, attributes = self._observed_step()
        return [] if last is None else [
            Observation(b.busbw_bytes_per_s, {**attributes, BUCKET_ATTR: b.index})
            for b in last.buckets
        ]

    def _observe_step_bytes(self, options: CallbackOptions) -> Iterable[Observation]:
        last, attributes = self._observed_step()
        return [] if last is None else [Observation(last.step_bytes, attributes)]


@dataclass(frozen=True, slots=True)
class _HookState:
    process_group: dist.ProcessGroup
    timer: CollectiveTimer


# DDP's _check_comm_hook compares the ``bucket`` and return annotations with the real
# objects; postponed (string) annotations would fail that check, so those two stay bare.
def _timed_allreduce_hook(state: _HookState, bucket):  # type: ignore[no-untyped-def]
    """DDP's default averaging all-reduce, timed per bucket."""
    buffer = bucket.buffer()
    buffer.div_(state.process_group.size())
    try:
        launch: _Launch | None = state.timer._launch(bucket.index(), bucket.is_last(), buffer)
    except Exception:  # the job must never die of its telemetry
        _LOG.exception("collective timing failed at launch; reducing this bucket untimed")
        launch = None
    future = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]  # a failed collective raises here and reaches DDP
        if launch is not None:
            try:
                state.timer._completed(launch)
            except Exception:
                _LOG.exception("collective timing failed; the all-reduce itself succeeded")
        return reduced

    return future.then(done)


def install(ddp_model: torch.nn.parallel.DistributedDataParallel, timer: CollectiveTimer) -> None:
    """Register the timed all-reduce as ``ddp_model``'s communication hook (once, before backward).

    Raises:
        SeedanceError: the timer's world size differs from the model's process group size.
    """
    group = ddp_model.process_group
    if group.size() != timer.world_size:
        raise SeedanceError(
            f"timer world_size={timer.world_size} but the DDP process group has {group.size()} "
            "ranks"
        )
    ddp_model.register_comm_hook(_HookState(group, timer), _timed_allreduce_hook)
