"""The module-group profiler: forward hooks on sampled steps, and the gauges they feed.

Every ``every_n_steps`` steps (and the first), forward hooks time each module group, each
repeated block and the root forward, and note the order groups first run in and the dtypes
their parameters have while they run. The hooks exist only for a sampled step, so other steps
cost nothing.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry.metrics import Meter
from torch import nn
from torch.utils.hooks import RemovableHandle

from collectors._catalogue import BY_NAME
from collectors._forward_profile import (
    ForwardProfile,
    ProfileError,
    ProfilerConfig,
    direct_groups,
    repeated_blocks,
)
from collectors._matmul_speedups import PRECISION_DTYPES, device_model, dtype_name, dtype_speedups
from collectors._points import CONFIG_VERSION_ATTR
from collectors.names import (
    ATTR_HW_MODEL,
    ATTR_SEEDANCE_BLOCK,
    ATTR_SEEDANCE_DTYPE,
    ATTR_SEEDANCE_DTYPE_SOURCE,
    DEVICE_MATMUL_SPEEDUP,
    TRAIN_BLOCK_TIME_SHARE,
    TRAIN_GROUP_FORWARD_RANK,
    TRAIN_GROUP_PARAM_DTYPE,
    TRAIN_GROUP_TIME_SHARE,
)
from collectors.torch_training import MODULE_GROUP_ATTR, _unwrap

log = logging.getLogger(__name__)

BLOCK_ATTR = ATTR_SEEDANCE_BLOCK
DTYPE_ATTR = ATTR_SEEDANCE_DTYPE
DTYPE_SOURCE_ATTR = ATTR_SEEDANCE_DTYPE_SOURCE
DEVICE_MODEL_ATTR = ATTR_HW_MODEL


@dataclass(frozen=True, slots=True)
class _Role:
    """What a hooked module is: the root, the outermost module of a group run, a block, and/or
    a parameter owner of a group (index -1: not that)."""

    root: bool
    group: int
    block: int
    owner_of: int

    @property
    def timed(self) -> bool:
        return self.root or self.group >= 0 or self.block >= 0


class _Frame:
    """One timed module call: its role, clock readings and the enclosing root or group frame."""

    __slots__ = ("end", "parent", "role", "start")

    def __init__(self, role: _Role, start: Any, parent: int) -> None:
        self.role, self.start, self.end, self.parent = role, start, None, parent


@dataclass(slots=True)
class _Sample:
    """The raw record of one sampled step, resolved once its clock readings are final."""

    step: int
    version: int
    frames: list[_Frame] = field(default_factory=list)
    dtypes: list[set[torch.dtype]] = field(default_factory=list)
    autocast: list[set[torch.dtype]] = field(default_factory=list)


class ModuleGroupProfiler:
    """Times each module group's and each repeated block's share of the forward, every
    ``config.every_n_steps`` steps, and exports it with the device's matmul speedups.

    ``groups`` maps a group name to fnmatch patterns over module names (exact names work, as
    ``tuner.job.default_precision_groups`` gives them); a module belongs to the first group
    matching it, and a module no pattern matches belongs to its parent's group, as under
    ``tuner.precision``. Name the groups as the ``precision.<group>`` knobs are named so a
    finding's suggestion hits a real knob. ``speedups`` defaults to :func:`dtype_speedups` of
    the model's device (measured now unless cached). Not thread-safe: call it from the
    training thread. Points are set on synchronous gauges of ``meter``, with the config
    version read when the sampled step begins.
    """

    def __init__(self, model: nn.Module, groups: Mapping[str, Sequence[str]], meter: Meter, *,
                 config_version: Callable[[], int] | int = 0,
                 config: ProfilerConfig | None = None,
                 speedups: Mapping[str, float] | None = None,
                 attributes: Mapping[str, str | int] | None = None) -> None:
        self.model = _unwrap(model)
        self.config = config or ProfilerConfig()
        self.config_version = config_version
        self.groups: tuple[str, ...] = tuple(groups)
        self.blocks: tuple[str, ...] = tuple(repeated_blocks(self.model))
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self.speedups: dict[str, float] = dict(
            dtype_speedups(self.device) if speedups is None else speedups)
        unknown = sorted(set(self.speedups) - set(PRECISION_DTYPES))
        if unknown:
            raise ProfileError(f"speedups: unknown precisions {unknown}; known: "
                               f"{sorted(PRECISION_DTYPES)}")
        self.device_model = device_model(self.device)
        self._base_attributes = dict(attributes or {})
        self._hooked = self._plan(direct_groups(self.model, groups))
        self._cuda = self.device.type == "cuda"
        self._clock: Callable[[], Any] = self._cuda_event if self._cuda else time.perf_counter
        self._instruments(meter)
        self._handles: list[RemovableHandle] = []
        self._sample: _Sample | None = None
        self._stack: list[tuple[_Frame, int]] = []
        self._top = -1  # index of the innermost open root or group frame
        self._pending: collections.deque[tuple[_Sample, Any]] = collections.deque()
        self.last_profile: ForwardProfile | None = None
        """The newest published profile (None before the first), for in-job readers."""

    # ---- configuration ---------------------------------------------------------------------

    @property
    def config_version(self) -> int:
        return int(self._version_source())

    @config_version.setter
    def config_version(self, value: Callable[[], int] | int) -> None:
        self._version_source = value if callable(value) else (lambda v=int(value): v)

    def _plan(self, direct: dict[str, int]) -> list[tuple[nn.Module, _Role]]:
        """Which modules get hooks on a sampled step, and in what role."""
        block_index = {name: i for i, name in enumerate(self.blocks)}
        inherited: dict[str, int] = {"": -1}
        plan = [(self.model, _Role(root=True, group=-1, block=-1, owner_of=-1))]
        for name, module in self.model.named_modules():
            if not name:
                continue
            parent = inherited[name.rpartition(".")[0]]
            group = direct.get(name, parent)
            inherited[name] = group
            owns = any(p is not None and p.is_floating_point()
                       for p in module._parameters.values())
            role = _Role(root=False,
                         group=group if name in direct and group != parent else -1,
                         block=block_index.get(name, -1),
                         owner_of=group if owns else -1)
            if role.timed or role.owner_of >= 0:
                plan.append((module, role))
        return plan

    def _instruments(self, meter: Meter) -> None:
        def gauge(name: str) -> Any:
            spec = BY_NAME[name]
            return meter.create_gauge(name, unit=spec.unit, description=spec.description)

        self._g_share = gauge(TRAIN_GROUP_TIME_SHARE)
        self._g_rank = gauge(TRAIN_GROUP_FORWARD_RANK)
        self._g_dtype = gauge(TRAIN_GROUP_PARAM_DTYPE)
        self._g_block = gauge(TRAIN_BLOCK_TIME_SHARE)
        self._g_speedup = gauge(DEVICE_MATMUL_SPEEDUP)

    # ---- the API a loop calls --------------------------------------------------------------

    def before_step(self, step_index: int) -> None:
        """Start of step ``step_index``: install the hooks if it is a sampled step."""
        self._poll()
        if self._handles:  # the previous sampled step never ended: drop it
            self._stop(publish=False)
        if step_index % self.config.every_n_steps:
            return
        n = len(self.groups)
        self._sample = _Sample(step=step_index, version=self.config_version,
                               dtypes=[set() for _ in range(n)],
                               autocast=[set() for _ in range(n)])
        self._stack.clear()
        self._top = -1
        for module, role in self._hooked:
            if role.timed:
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_hook(role), prepend=True))
            self._handles.append(module.register_forward_hook(
                self._post_hook(role), prepend=True, always_call=True))

    def after_step(self) -> None:
        """End of the step: remove the hooks and export what a sampled step measured."""
        self._stop(publish=True)

    @contextlib.contextmanager
    def step(self, step_index: int) -> Iterator[None]:
        """``before_step``/``after_step`` around a block; a step that raises is not exported."""
        self.before_step(step_index)
        try:
            yield
        except BaseException:
            self._stop(publish=False)
            raise
        self.after_step()

    def close(self) -> None:
        """Remove any hooks and export samples still waiting for their device (idempotent)."""
        self._stop(publish=False)
        while self._pending:
            sample, event = self._pending.popleft()
            event.synchronize()
            self._publish(sample)

    # ---- hooks -----------------------------------------------------------------------------

    def _cuda_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _pre_hook(self, role: _Role) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        device_type = self.device.type

        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            sample = self._sample
            if sample is None or (not self._stack and not role.root):
                return  # outside a root forward (a recomputation during backward, say)
            frame = _Frame(role, self._clock(), self._top)
            self._stack.append((frame, self._top))
            if role.root or role.group >= 0:
                self._top = len(sample.frames)
            sample.frames.append(frame)
            if role.group >= 0 and torch.is_autocast_enabled(device_type):
                sample.autocast[role.group].add(torch.get_autocast_dtype(device_type))
        return pre

    def _post_hook(self, role: _Role) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        device_type = self.device.type

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            sample = self._sample
            if sample is None or not self._stack:
                return
            if role.owner_of >= 0:  # prepended: runs before any hook swaps the weights back
                sample.dtypes[role.owner_of].update(
                    p.dtype for p in module._parameters.values()
                    if p is not None and p.is_floating_point())
                # an autocast a wrapper entered inside the group's outermost module (its
                # pre-hook ran before it) is still in force when an owner's forward returns
                if torch.is_autocast_enabled(device_type):
                    sample.autocast[role.owner_of].add(torch.get_autocast_dtype(device_type))
            if role.timed and self._stack[-1][0].role is role:
                frame, self._top = self._stack.pop()
                frame.end = self._clock()
        return post

    # ---- publishing ------------------------------------------------------------------------

    def _stop(self, *, publish: bool) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        sample, self._sample = self._sample, None
        self._stack.clear()
        if sample is None or not publish or not sample.frames:
            self._poll()
            return
        if self._cuda:
            self._pending.append((sample, self._cuda_event()))
            self._poll()
        else:
            self._publish(sample)

    def _poll(self) -> None:
        """Export the CUDA samples whose events have completed (never waits)."""
        while self._pending and self._pending[0][1].query():
            self._publish(self._pending.popleft()[0])

    def _elapsed(self, frame: _Frame) -> float:
        if self._cuda:
            return float(frame.start.elapsed_time(frame.end)) / 1e3
        return float(frame.end - frame.start)

    def _publish(self, sample: _Sample) -> None:
        if any(f.end is None for f in sample.frames):
            log.debug("step %d: a forward did not finish; its profile is dropped", sample.step)
            return
        spent = [self._elapsed(f) for f in sample.frames]
        exclusive = list(spent)
        group_s = [0.0] * len(self.groups)
        block_s = [0.0] * len(self.blocks)
        first: dict[int, int] = {}
        forward_s = 0.0
        for i, frame in enumerate(sample.frames):
            role = frame.role
            if role.root:
                forward_s += spent[i]
            if (role.root or role.group >= 0) and frame.parent >= 0:
                exclusive[frame.parent] -= spent[i]
            if role.block >= 0:
                block_s[role.block] += spent[i]
            if role.group >= 0:
                first.setdefault(role.group, i)
        if forward_s <= 0:
            return
        for i, frame in enumerate(sample.frames):
            if frame.role.group >= 0:
                group_s[frame.role.group] += exclusive[i]
        profile = ForwardProfile(
            step=sample.step, config_version=sample.version, forward_s=forward_s,
            group_shares={g: group_s[i] / forward_s for i, g in enumerate(self.groups)},
            block_shares={b: block_s[i] / forward_s for i, b in enumerate(self.blocks)},
            forward_order=tuple(self.groups[g] for g in sorted(first, key=first.__getitem__)),
            param_dtypes={g: tuple(sorted(dtype_name(d) for d in sample.dtypes[i]))
                          for i, g in enumerate(self.groups) if sample.dtypes[i]},
            autocast_dtypes={g: tuple(sorted(dtype_name(d) for d in sample.autocast[i]))
                             for i, g in enumerate(self.groups) if sample.autocast[i]})
        self._export(profile)
        self.last_profile = profile

    def _export(self, profile: ForwardProfile) -> None:
        attrs = {**self._base_attributes, CONFIG_VERSION_ATTR: profile.config_version}
        for group, share in profile.group_shares.items():
            self._g_share.set(share, {**attrs, MODULE_GROUP_ATTR: group})
        for rank, group in enumerate(profile.forward_order):
            self._g_rank.set(rank, {**attrs, MODULE_GROUP_ATTR: group})
        for source, by_group in (("parameters", profile.param_dtypes),
                                 ("autocast", profile.autocast_dtypes)):
            for group, dtypes in by_group.items():
                for dtype in dtypes:
                    self._g_dtype.set(1, {**attrs, MODULE_GROUP_ATTR: group, DTYPE_ATTR: dtype,
                                          DTYPE_SOURCE_ATTR: source})
        for block, share in profile.block_shares.items():
            self._g_block.set(share, {**attrs, BLOCK_ATTR: block})
        for precision, speedup in self.speedups.items():
            self._g_speedup.set(speedup, {
                **attrs, DTYPE_ATTR: dtype_name(PRECISION_DTYPES[precision]),
                DEVICE_MODEL_ATTR: self.device_model})
