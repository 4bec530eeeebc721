"""In-memory snapshots of model and optimizer state, with full and local (module group) rollback.

The seed's section 3.3: when a group's gradients collapse after its precision was lowered,
restore that group from the snapshot taken before, move its precision back up and reset its
optimizer state, leaving the rest of the model alone. A full rollback restores everything.

Snapshots live on the tensors' own devices in one flat buffer per (device, dtype); taking and
restoring are ``torch._foreach_copy_`` calls over views, with Python work per tensor, never per
element. An evicted snapshot's buffers are reused by the next snapshot of the same layout.

Optimizer state is per-parameter state (``optimizer.state[p]``: ``momentum_buffer``,
``exp_avg``, ``exp_avg_sq``, ``step``, ...) plus the hyperparameters of ``param_groups``.
Optimizers that keep global state elsewhere (LBFGS) are out of scope. LR scheduler state is the
caller's to keep.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from collectors import SeedanceError
from tuner.precision import Precision, PrecisionHandle, match_modules

log = logging.getLogger(__name__)

GroupSpec = str | Sequence[str] | Iterable[nn.Parameter]
"""A precision group name, fnmatch patterns over module names, or the parameters themselves."""


class CheckpointError(SeedanceError):
    """A snapshot cannot be taken or restored."""


class CheckpointBudgetError(CheckpointError):
    """A snapshot would not fit in ``max_bytes``."""


_Key = tuple[torch.device, torch.dtype]


@dataclass(frozen=True, slots=True, kw_only=True)
class _StateEntry:
    param_index: int
    key: str
    value: Any  # a view into the snapshot's buffers for tensors, else a deep copy


class Snapshot:
    """One saved state; owned by its ``Checkpointer``. ``evicted`` ones cannot be restored."""

    def __init__(self, *, label: str, seq: int, buffers: dict[_Key, torch.Tensor],
                 params: list[torch.Tensor], model_buffers: list[torch.Tensor],
                 state: list[_StateEntry], hyperparameters: list[dict[str, Any]]) -> None:
        self.label = label
        self.seq = seq
        self.evicted = False
        self._buffers = buffers
        self._params = params
        self._model_buffers = model_buffers
        self._state = state
        self._hyperparameters = hyperparameters

    @property
    def nbytes(self) -> int:
        """Bytes its copies hold; 0 once discarded (its buffers go to the next snapshot)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __repr__(self) -> str:
        flag = ", evicted" if self.evicted else ""
        return f"Snapshot({self.label!r}, seq={self.seq}, {self.nbytes / 2**20:.1f} MiB{flag})"


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalRollback:
    """What a local rollback touched."""

    modules: tuple[str, ...]
    parameters: int
    elements: int
    optimizer_states_reset: int
    precision: str | None


class Checkpointer:
    """Bounded in-memory snapshots of one model and its optimizer.

    Not thread-safe; call between ``optimizer.step()`` and the next backward. When a new
    snapshot would push the total past ``max_bytes`` the oldest are evicted (``on_full=
    "evict_oldest"``, logged) or the snapshot is refused (``"refuse"``, raises
    ``CheckpointBudgetError``); a snapshot larger than ``max_bytes`` on its own always raises.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, max_bytes: int,
                 on_full: Literal["evict_oldest", "refuse"] = "evict_oldest") -> None:
        if max_bytes <= 0:
            raise CheckpointError(f"Checkpointer max_bytes must be positive, got {max_bytes}")
        if on_full not in ("evict_oldest", "refuse"):
            raise CheckpointError(
                f"Checkpointer on_full must be 'evict_oldest' or 'refuse', got {on_full!r}")
        self.model = model
        self.optimizer = optimizer
        self.max_bytes = max_bytes
        self.on_full = on_full
        self.snapshots: list[Snapshot] = []
        self._params = list(dict.fromkeys(model.parameters()))
        self._index = {id(p): i for i, p in enumerate(self._params)}
        stray = [p for g in optimizer.param_groups for p in g["params"]
                 if id(p) not in self._index]
        if stray:
            raise CheckpointError(f"the optimizer holds {len(stray)} tensors that are not "
                                  "parameters of the model")
        self._model_buffers = list(model.buffers())
        self._seq = 0
        self._spare: dict[_Key, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by live snapshots."""
        return sum(s.nbytes for s in self.snapshots)

    def latest(self) -> Snapshot:
        """The newest live snapshot; raises ``CheckpointError`` before the first one."""
        if not self.snapshots:
            raise CheckpointError("no snapshot has been taken")
        return self.snapshots[-1]

    # ---- taking ---------------------------------------------------------------------------

    def snapshot(self, label: str = "") -> Snapshot:
        """Copy every parameter, buffer and optimizer state tensor into a new snapshot."""
        sources, entries = self._sources()
        sizes: dict[_Key, int] = {}
        for t in sources:
            key = (t.device, t.dtype)
            sizes[key] = sizes.get(key, 0) + t.numel()
        need = sum(n * torch.empty((), dtype=k[1]).element_size() for k, n in sizes.items())
        self._make_room(need, label)
        buffers = {k: self._buffer(k, n) for k, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        views = []
        for t in sources:
            key = (t.device, t.dtype)
            views.append(buffers[key][offsets[key]:offsets[key] + t.numel()].view(t.shape))
            offsets[key] += t.numel()
        with torch.no_grad():
            torch._foreach_copy_(views, sources)
        n_params, n_bufs = len(self._params), len(self._model_buffers)
        state_views = iter(views[n_params + n_bufs:])
        state = [_StateEntry(param_index=i, key=k,
                             value=next(state_views) if tensor else copy.deepcopy(v))
                 for i, k, v, tensor in entries]
        self._seq += 1
        snap = Snapshot(
            label=label or f"snapshot-{self._seq}", seq=self._seq, buffers=buffers,
            params=views[:n_params], model_buffers=views[n_params:n_params + n_bufs],
            state=state, hyperparameters=[
                copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                for g in self.optimizer.param_groups])
        self.snapshots.append(snap)
        return snap

    def _sources(self) -> tuple[list[torch.Tensor], list[tuple[int, str, Any, bool]]]:
        sources: list[torch.Tensor] = [p.detach() for p in self._params]
        sources += [b.detach() for b in self._model_buffers]
        entries = []
        for i, p in enumerate(self._params):
            for key, value in self.optimizer.state.get(p, {}).items():
                tensor = isinstance(value, torch.Tensor)
                entries.append((i, key, value, tensor))
                if tensor:
                    sources.append(value.detach())
        return sources, entries

    def _make_room(self, need: int, label: str) -> None:
        if need > self.max_bytes:
            raise CheckpointBudgetError(
                f"snapshot {label!r} needs {need / 2**20:.1f} MiB, more than max_bytes "
                f"({self.max_bytes / 2**20:.1f} MiB) on its own; raise max_bytes")
        while self.nbytes + need > self.max_bytes:
            if self.on_full == "refuse":
                raise CheckpointBudgetError(
                    f"snapshot {label!r} ({need / 2**20:.1f} MiB) refused: "
                    f"{len(self.snapshots)} snapshots hold {self.nbytes / 2**20:.1f} MiB of "
                    f"max_bytes {self.max_bytes / 2**20:.1f} MiB; drop one with discard()")
            self.discard(self.snapshots[0], reason=f"evicted, the oldest, to make room for "
                                                   f"{label!r} within max_bytes")

    def discard(self, snapshot: Snapshot, *, reason: str = "discarded") -> None:
        """Free a snapshot; its buffers are kept for reuse by the next snapshot."""
        if snapshot.evicted:
            return
        self.snapshots.remove(snapshot)
        snapshot.evicted = True
        self._spare = snapshot._buffers
        snapshot._buffers = {}
        log.warning("dropped %s (%s); %d snapshots, %.1f MiB left", snapshot, reason,
                    len(self.snapshots), self.nbytes / 2**20)

    def _buffer(self, key: _Key, numel: int) -> torch.Tensor:
        spare = self._spare.pop(key, None)
        if spare is not None and spare.numel() == numel:
            return spare
        return torch.empty(numel, dtype=key[1], device=key[0])

    # ---- restoring ------------------------------------------------------------------------

    def _check(self, snapshot: Snapshot) -> None:
        if snapshot.evicted or snapshot not in self.snapshots:
            raise CheckpointError(f"{snapshot!r} was evicted or belongs to another Checkpointer")

    def full_rollback(self, snapshot: Snapshot) -> None:
        """Restore every parameter, buffer, optimizer state entry and hyperparameter in place.

        Parameters and buffers keep their identity; optimizer state tensors are overwritten in
        place when they still exist, recreated when the optimizer dropped them, and entries the
        snapshot did not have are deleted.
        """
        self._check(snapshot)
        dst: list[torch.Tensor] = [p.detach() for p in self._params]
        dst += [b.detach() for b in self._model_buffers]
        src: list[torch.Tensor] = snapshot._params + snapshot._model_buffers
        state = self.optimizer.state
        wanted: dict[int, set[str]] = {}
        for entry in snapshot._state:
            p = self._params[entry.param_index]
            wanted.setdefault(entry.param_index, set()).add(entry.key)
            slot = state[p]
            value = entry.value
            if not isinstance(value, torch.Tensor):
                slot[entry.key] = copy.deepcopy(value)
                continue
            current = slot.get(entry.key)
            if (isinstance(current, torch.Tensor) and current.shape == value.shape
                    and current.dtype == value.dtype and current.device == value.device):
                dst.append(current)
                src.append(value)
            else:
                slot[entry.key] = value.clone()
        for i, p in enumerate(self._params):
            keep = wanted.get(i)
            if keep is None:
                state.pop(p, None)
            elif p in state:
                for key in [k for k in state[p] if k not in keep]:
                    del state[p][key]
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
        for group, saved in zip(self.optimizer.param_groups, snapshot._hyperparameters, strict=True):
            group.update(copy.deepcopy(saved))

    def local_rollback(self, snapshot: Snapshot, group: GroupSpec,
                       precision_handle: PrecisionHandle | None = None, *,
                       precision: Precision = "fp32") -> LocalRollback:
        """Restore one module group from ``snapshot`` and reset its optimizer state.

        ``group``: a group name of ``precision_handle``, fnmatch patterns over module names
        (all parameters and buffers inside matched modules), or parameters. Its optimizer state
        is dropped, so the optimizer re-initialises it lazily exactly as at the start of
        training: zero moments with ``step`` back at 0, which makes Adam's bias correction right
        for the zeroed moments (zeroing in place instead would be wrong for optimizers whose
        initial state is not zero, e.g. Adagrad). With ``precision_handle`` the group's modules
        move to ``precision`` ("fp32", or "bf16"). Everything else is left untouched.
        """
        self._check(snapshot)
        if precision_handle is not None and precision not in ("fp32", "bf16"):
            raise CheckpointError(
                f"local rollback moves precision up to 'fp32' or 'bf16', got {precision!r}")
        modules, params = self._resolve(group, precision_handle)
        index = [self._index[id(p)] for p in params]
        dst = [p.detach() for p in params]
        src = [snapshot._params[i] for i in index]
        if modules:
            mine = {id(b) for m in modules for b in self.model.get_submodule(m).buffers()}
            for b, saved in zip(self._model_buffers, snapshot._model_buffers, strict=True):
                if id(b) in mine:
                    dst.append(b.detach())
                    src.append(saved)
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
        reset = sum(self.optimizer.state.pop(p, None) is not None for p in params)
        if precision_handle is not None:
            if isinstance(group, str) and group in precision_handle.groups:
                precision_handle.set_group(group, precision)
            else:
                precision_handle.set_modules(modules or self._owners(params), precision,
                                             why="local rollback")
        return LocalRollback(
            modules=modules, parameters=len(params), elements=sum(p.numel() for p in params),
            optimizer_states_reset=reset,
            precision=precision if precision_handle is not None else None)

    def _resolve(self, group: GroupSpec, handle: PrecisionHandle | None
                 ) -> tuple[tuple[str, ...], list[nn.Parameter]]:
        if handle is not None and handle.model is not self.model:
            raise CheckpointError("the precision handle belongs to another model")
        if isinstance(group, str) and handle is not None and group in handle.groups:
            modules = handle.groups[group]
        elif isinstance(group, str) or (isinstance(group, Sequence) and group
                                        and all(isinstance(g, str) for g in group)):
            patterns = [group] if isinstance(group, str) else list(group)
            hits = match_modules(self.model, patterns)
            modules = tuple(dict.fromkeys(n for ns in hits.values() for n in ns))
        else:
            params: list[nn.Parameter] = list(dict.fromkeys(group))  # type: ignore[arg-type]
            unknown = [p for p in params if id(p) not in self._index]
            if unknown or not params:
                raise CheckpointError("local rollback needs a non-empty set of the model's "
                                      f"parameters ({len(unknown)} are not the model's)")
            return (), params
        params = list(dict.fromkeys(
            p for m in modules for p in self.model.get_submodule(m).parameters()))
        if not params:
            raise CheckpointError(f"modules {list(modules)[:5]} hold no parameters")
        return modules, params

    def _owners(self, params: list[nn.Parameter]) -> tuple[str, ...]:
        ids = {id(p) for p in params}
        return tuple(name for name, m in self.model.named_modules()
                     if any(id(p) in ids for p in m.parameters(recurse=False)))
