"""The training session's own actuators: ``precision.<group>`` and ``threads``, and their knobs.

Precision groups are named like the instrumentation's gradient groups, so ``precision.ffn`` acts
on exactly the parameters whose norms are reported as ``ffn``. A precision not faster than fp32
on the job's device stays a legal value but is in the knob's ``search_excludes``; fp16 is a risky
value (a person approves it) unless the job has a GradScaler.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from collectors.torch_profile import FAST_SPEEDUP
from collectors.torch_training import _unwrap, assign_groups
from tuner._knobs import Knob, KnobSpace, KnobValue
from tuner.precision import PrecisionHandle, PrecisionPolicy, apply_precision

PRECISION_CHOICES: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""The values of every ``precision.<group>`` knob."""


def knob_group_name(group: str) -> str:
    """``group`` as the last part of a knob name (an identifier)."""
    name = re.sub(r"\W", "_", group)
    return name if name.isidentifier() else f"_{name}"


def default_precision_groups(model: nn.Module, module_groups: Mapping[str, Sequence[str]] | None
                             ) -> dict[str, tuple[str, ...]]:
    """Precision groups named like the instrumentation's gradient groups: each group is the
    modules that own its parameters (exact names), so ``precision.ffn`` acts on exactly the
    parameters whose norms are reported as ``ffn``. Parameters of the root module are left out
    (casting the root would cast everything)."""
    names = [n for n, p in _unwrap(model).named_parameters() if p.requires_grad]
    groups: dict[str, list[str]] = {}
    seen: set[str] = set()
    for name, group in zip(names, assign_groups(names, module_groups), strict=True):
        owner = name.rpartition(".")[0]
        if owner and owner not in seen:
            seen.add(owner)
            groups.setdefault(group, []).append(owner)
    return {g: tuple(m) for g, m in groups.items()}


MIN_SEARCHED_SPEEDUP = FAST_SPEEDUP
"""A precision is searched only where it is fast (``collectors.torch_profile.FAST_SPEEDUP``:
its matmuls measured at least this much faster than fp32's)."""


def precision_knobs(groups: Iterable[str], speedups: Mapping[str, float], *,
                    grad_scaler: bool) -> tuple[Knob, ...]:
    """One ``precision.<group>`` knob per group, fp32 by default.

    ``speedups``: what each dtype's matmul buys on the device (empty: not measured, nothing
    excluded); a precision not ``MIN_SEARCHED_SPEEDUP`` faster there is never searched. fp16
    without a loss scaler underflows, so without ``grad_scaler`` it is a value a person
    approves (bf16 keeps fp32's range).
    """
    slower = tuple(p for p in PRECISION_CHOICES if p != "fp32" and speedups
                   and speedups.get(p, 0.0) < MIN_SEARCHED_SPEEDUP)
    risky = () if grad_scaler else ("fp16",)
    return tuple(Knob(name=f"precision.{group}", default="fp32", choices=PRECISION_CHOICES,
                      risky_values=risky, search_excludes=slower,
                      description=f"compute precision of module group {group}")
                 for group in groups)


def threads_knob() -> Knob | None:
    """``threads`` from 1 to the CPUs this process may use; None when that is one."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    cpus = max(usable, torch.get_num_threads())
    if cpus <= 1:
        return None
    return Knob(name="threads", default=torch.get_num_threads(), low=1, high=cpus, integer=True,
                description="torch.set_num_threads")


class PrecisionActuator:
    """``precision.<group>``: the dtype each module group computes in (``tuner.precision``).

    A config is put in force whole: the hooks of the one before come off, and those of the new
    one go on unless every group is fp32.
    """

    def __init__(self, model: nn.Module, groups: Mapping[str, Sequence[str]],
                 knobs: Iterable[Knob]) -> None:
        self._model = model
        self._groups = {g: tuple(p) for g, p in groups.items()}
        self._knobs = KnobSpace.of(knobs)
        self._values = self._knobs.defaults()
        self._handle: PrecisionHandle | None = None

    @property
    def prefix(self) -> str:
        """``precision.<group>`` knobs."""
        return "precision"

    def read(self) -> dict[str, KnobValue]:
        """The precision of each group with a knob."""
        return dict(self._values)

    def apply(self, values: Mapping[str, KnobValue]) -> None:
        """The groups' precisions; a group not given is fp32."""
        checked = self._knobs.validate(values)
        precisions = {name.removeprefix("precision."): str(v) for name, v in checked.items()}
        self.remove()
        if any(p != "fp32" for p in precisions.values()):
            self._handle = apply_precision(self._model, PrecisionPolicy.from_groups(
                self._groups, precisions))  # type: ignore[arg-type]
        self._values = checked

    def remove(self) -> None:
        """Take the hooks off (idempotent): the session closes."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class ThreadsActuator:
    """``threads``: ``torch.set_num_threads``, the intra-op threads of this process."""

    def __init__(self, knob: Knob) -> None:
        self._knobs = KnobSpace.of([knob])

    @property
    def prefix(self) -> str:
        """The ``threads`` knob."""
        return "threads"

    def read(self) -> dict[str, KnobValue]:
        """``torch.get_num_threads()``."""
        return {"threads": torch.get_num_threads()}

    def apply(self, values: Mapping[str, KnobValue]) -> None:
        """``torch.set_num_threads``, once the value is within the knob's bounds."""
        torch.set_num_threads(int(self._knobs.validate(values)["threads"]))
