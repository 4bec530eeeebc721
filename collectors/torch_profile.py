"""Where a step's forward time goes, and what each dtype's matmul buys on this device.

These are the inputs of the compute-aware priors (``policies.detectors.ComputePriorsDetector``):
a group that holds most of the forward time and computes in fp32 on a device where bf16
matmuls are measured faster is the first thing worth trying. This module imports torch, so
only a job imports it.

- :func:`dtype_speedups`: a matmul micro-benchmark (fp32, bf16, fp16, and fp8 where the device
  has scaled fp8 matmuls) giving each dtype's speed relative to fp32, cached per device model.
- :class:`ModuleGroupProfiler`: every ``every_n_steps`` steps (and the first), forward hooks
  time each module group, each repeated block (``blocks.N``, ``layers.N``) and the root
  forward; they also note the order in which groups first run and the dtypes their parameters
  have while they run. The hooks exist only for a sampled step, so other steps cost nothing.

Usage, with the groups of the ``precision.<group>`` knobs (``Session.precision_groups``)::

    profiler = ModuleGroupProfiler(model, session.precision_groups, meter,
                                   config_version=lambda: session.version)
    for i, batch in enumerate(batches):
        with profiler.step(i):
            loss = model(batch); loss.backward(); optimizer.step()
    profiler.close()

Not for a ``torch.compile``-d model: hooks added and removed every sampled step change what
Dynamo traced.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from opentelemetry.metrics import Meter
from torch import nn
from torch.utils.hooks import RemovableHandle

from collectors._catalogue import BY_NAME
from collectors._errors import SeedanceError
from collectors._points import CONFIG_VERSION_ATTR
from collectors.torch_training import MODULE_GROUP_ATTR, _unwrap

log = logging.getLogger(__name__)

BLOCK_ATTR = "seedance.block"
DTYPE_ATTR = "seedance.dtype"
DTYPE_SOURCE_ATTR = "seedance.dtype.source"
DEVICE_MODEL_ATTR = "hw.model"

PRECISION_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
})
"""Keys of :func:`dtype_speedups` (the ``precision.<group>`` knob values) -> torch dtypes."""

CACHE_ENV = "SEEDANCE_CACHE_DIR"
_CACHE_FILE = "matmul_speedups.json"

_SIZES = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
"""Square matmul sizes tried, smallest first (multiples of 16, as fp8 matmuls need)."""
_TARGET_S = 1e-3  # grow until an fp32 matmul takes this long ...
_SLOWEST_CAP_S = 0.02  # ... or the slowest dtype takes this long (fp16 on a CPU: 20-100x fp32)
_ROUNDS = 5
_SAMPLE_S = 0.01  # a sample repeats a call (up to 3 in all) while under this
_BUDGET_S = 0.6  # the timed rounds stop after this much, once each dtype has one sample


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how metrics name a dtype."""
    return str(dtype).removeprefix("torch.")


def device_model(device: torch.device | str) -> str:
    """The device's model name: the GPU's name, or the CPU's from /proc/cpuinfo."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "cpu"


def _cache_key(device: torch.device) -> str:
    """What a measurement depends on besides the device: torch and the fp32 matmul mode."""
    return "|".join([device.type, device_model(device), f"torch={torch.__version__}",
                     f"fp32_matmul={torch.get_float32_matmul_precision()}"])


def _cache_path(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "seedance-tuner"
    return Path(cache_dir) / _CACHE_FILE


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        log.warning("matmul speedup cache %s is unreadable; measuring again", path)
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as tmp:
        json.dump(data, tmp, indent=1, sort_keys=True)
    os.replace(tmp.name, path)


def dtype_speedups(device: torch.device | str, *,
                   cache_dir: str | os.PathLike[str] | None = None) -> dict[str, float]:
    """Each dtype's square-matmul speed on ``device`` relative to fp32 (``{"fp32": 1.0, ...}``).

    Keys are precision knob values: ``fp32``, ``bf16``, ``fp16`` (absent where a matmul in it
    fails) and ``fp8`` (only on CUDA devices with scaled fp8 matmuls, compute capability 8.9+).
    Measured once per device model, torch version and fp32 matmul precision, then read from ``matmul_speedups.json`` under ``cache_dir`` (default ``$SEEDANCE_CACHE_DIR``
    or ``~/.cache/seedance-tuner``). A cold run takes well under a second on a 2-core CPU; it
    competes with whatever else the device runs, so call it before training starts.

    A CPU is measured on one thread, i.e. per core: on a shared box, multi-threaded matmuls
    wait for descheduled worker threads (a 0.3 ms fp32 matmul on 2 threads took 12-40 ms under
    load here, which made bf16, 50x slower, read 70x faster), and the cache keeps what the
    device can do, not how busy it was.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path, key = _cache_path(cache_dir), _cache_key(device)
    cached = _read_cache(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("speedups"), dict):
        return {str(k): float(v) for k, v in cached["speedups"].items()}
    speedups, size = _benchmark(device)
    entry = {"speedups": speedups, "size": size, "measured_unix_s": round(time.time())}
    try:
        _write_cache(path, {**_read_cache(path), key: entry})
    except OSError as e:
        log.warning("could not cache matmul speedups in %s (%s); measuring again next time",
                    path, e)
    return speedups


def _matmul(device: torch.device, precision: str, n: int) -> Callable[[], object]:
    """A closure running one n x n matmul in ``precision`` (inputs made once, off the job's
    random stream)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=generator) for _ in range(2))
    if precision != "fp8":
        dtype = PRECISION_DTYPES[precision]
        a, b = a.to(dtype), b.to(dtype)
        return lambda: torch.mm(a, b)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type != "cuda":
        def wall(fn: Callable[[], object]) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return wall

    def events(fn: Callable[[], object]) -> float:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return events


def _precisions(device: torch.device) -> list[str]:
    out = ["fp32", "bf16", "fp16"]
    if (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9)):
        out.append("fp8")
    return out


def _benchmark(device: torch.device) -> tuple[dict[str, float], int]:
    """Speed relative to fp32 per precision, and the matmul size measured at.

    The size grows until an fp32 matmul takes ~1 ms or the slowest dtype ~20 ms, so a dtype
    20-100x slower than fp32 (fp16 on most CPUs) stays bounded. Then up to five rounds take
    one sample per dtype, rotating their order so drift hits each alike; the median counts.
    A sample is the fastest of up to three back-to-back calls (the first pays for anything
    that went cold while other dtypes ran). A CPU runs it on one thread (see dtype_speedups).
    """
    timed = _timer(device)

    def sample(fn: Callable[[], object]) -> float:
        best = spent = timed(fn)
        for _ in range(2):
            if spent >= _SAMPLE_S:
                break
            t = timed(fn)
            best, spent = min(best, t), spent + t
        return best

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    live = _precisions(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        with torch.no_grad():
            size = _SIZES[0]
            for size in _SIZES:
                seconds: dict[str, float] = {}
                for precision in list(live):
                    try:
                        seconds[precision] = sample(_matmul(device, precision, size))
                    except (RuntimeError, TypeError) as e:
                        if precision == "fp32":
                            raise
                        log.info("no %s matmul on %s: %s", precision, device, e)
                        live.remove(precision)
                if seconds["fp32"] >= _TARGET_S or max(seconds.values()) >= _SLOWEST_CAP_S:
                    break
            fns = {p: _matmul(device, p, size) for p in live}
            samples: dict[str, list[float]] = {p: [] for p in live}
            start = time.perf_counter()
            for r in range(_ROUNDS):
                if r and time.perf_counter() - start > _BUDGET_S:
                    break
                for precision in live[r % len(live):] + live[:r % len(live)]:
                    samples[precision].append(sample(fns[precision]))
    finally:
        torch.set_num_threads(threads)
    fp32 = statistics.median(samples["fp32"])
    return {p: fp32 / statistics.median(s) for p, s in samples.items()}, size


# ---- forward profile ------------------------------------------------------------------------

class ProfileError(SeedanceError, ValueError):
    """The profiler cannot be set up as asked."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfilerConfig:
    """How often the forward is timed.

    A sampled step pays one pair of hooks per timed module (a few microseconds each) and,
    on CUDA, two events per pair; unsampled steps pay nothing. The first step is sampled too,
    so the forward order and dtypes are known from the start.
    """

    every_n_steps: int = 50

    def __post_init__(self) -> None:
        if isinstance(self.every_n_steps, bool) or not isinstance(self.every_n_steps, int) \
                or self.every_n_steps < 1:
            raise ProfileError(f"every_n_steps must be an int >= 1, got {self.every_n_steps!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardProfile:
    """What one sampled step measured. Shares are of the root module's forward time.

    ``group_shares`` has every group (0.0 when none of its modules ran) and sums to at most 1:
    time in modules of no group (and in the root's own code) belongs to none. A group's time
    excludes modules of other groups nested in it. ``block_shares`` are inclusive (a block's
    modules of every group) and follow the model's order. ``param_dtypes`` are the dtypes the
    group's floating parameters had while its modules ran (a compute-dtype copy when
    ``tuner.precision`` casts them), ``autocast_dtypes`` the autocast dtype in force when a
    group module was entered, where autocast was on.
    """

    step: int
    config_version: int
    forward_s: float
    group_shares: Mapping[str, float]
    block_shares: Mapping[str, float]
    forward_order: tuple[str, ...]
    param_dtypes: Mapping[str, tuple[str, ...]]
    autocast_dtypes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


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


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the outermost repeated blocks: numbered children of a ModuleList/Sequential.

    ``blocks.0``, ``layers.3``, ``encoder.layer.11``, ``features.3`` (a container needs two or
    more numbered children). Blocks inside a block (experts of a layer) are not listed.
    """
    blocks: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        if any(name == b or name.startswith(f"{b}.") for b in blocks):
            continue
        numbered = [child for child in module._modules if child.isdigit()]
        if len(numbered) >= 2:
            blocks += [f"{name}.{child}" if name else child for child in numbered]
    return blocks


def _direct_groups(model: nn.Module, groups: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Module name -> index of the first group with a pattern matching it (root excluded)."""
    names = [name for name, _ in model.named_modules() if name]
    direct: dict[str, int] = {}
    for index, (group, patterns) in enumerate(groups.items()):
        if isinstance(patterns, str) or not patterns:
            raise ProfileError(f"groups[{group!r}] must be a non-empty sequence of module "
                               f"name patterns, got {patterns!r}")
        for pattern in patterns:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ProfileError(f"groups[{group!r}]: pattern {pattern!r} matches no module")
            for name in hits:
                direct.setdefault(name, index)
    return direct


class ModuleGroupProfiler:
    """Times each module group's and each repeated block's share of the forward, every
    ``config.every_n_steps`` steps, and exports it with the device's matmul speedups.

    ``groups`` maps a group name to fnmatch patterns over module names (exact names work, as
    ``tuner.client.default_precision_groups`` gives them); a module belongs to the first group
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
        self._hooked = self._plan(_direct_groups(self.model, groups))
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
        """The version stamped on the next sampled step; its source is read as that step begins."""
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

        self._g_share = gauge("seedance.train.group.time_share")
        self._g_rank = gauge("seedance.train.group.forward_rank")
        self._g_dtype = gauge("seedance.train.group.param_dtype")
        self._g_block = gauge("seedance.train.block.time_share")
        self._g_speedup = gauge("seedance.device.matmul_speedup")

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


__all__ = [
    "BLOCK_ATTR",
    "CACHE_ENV",
    "DEVICE_MODEL_ATTR",
    "DTYPE_ATTR",
    "DTYPE_SOURCE_ATTR",
    "PRECISION_DTYPES",
    "ForwardProfile",
    "ModuleGroupProfiler",
    "ProfileError",
    "ProfilerConfig",
    "device_model",
    "dtype_name",
    "dtype_speedups",
    "repeated_blocks",
]
