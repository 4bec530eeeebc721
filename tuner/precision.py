"""Layer-wise precision: each module computes in its own dtype, master weights stay fp32.

The seed's section 3.2: a policy maps module names (fnmatch rules, the first match wins, an
unmatched module inherits its parent's) to precisions, with casts at precision boundaries. A
module in fp16 or bf16 computes with cast copies of its parameters and casts its inputs on
entry (not ``torch.autocast``); norm layers always compute in fp32. Imported by the training job
(it needs torch), never by the sidecar.

docs/tuning.md, 'Layer-wise precision' explains the casts, the norm layers and the resolution.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from collectors import SeedanceError
from collectors.torch_profile import PRECISION_DTYPES

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
DTYPES: Mapping[str, torch.dtype] = PRECISION_DTYPES
ROOT_NAME = "<root>"
NORM_TYPES: tuple[type[nn.Module], ...] = (
    _NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, nn.LocalResponseNorm)
"""Layers that compute in fp32 whatever precision they are given (see the module docstring)."""


class PrecisionError(SeedanceError):
    """A precision policy cannot be applied as written."""


class PatternMatchError(PrecisionError):
    """A pattern in a policy matches no module of the model."""


class PrecisionUnsupportedError(PrecisionError):
    """The requested precision cannot compute on this device."""


def fp8_matmul_supported(device: torch.device | str) -> bool:
    """Whether the device has fp8 tensor-core matmuls (CUDA compute capability 8.9 or newer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def check_supported(precision: str, device: torch.device | str) -> None:
    """Raise ``PrecisionUnsupportedError`` unless ``precision`` can compute on ``device``."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "fp8":
        return
    if not fp8_matmul_supported(device):
        raise PrecisionUnsupportedError(
            f"fp8 is unsupported on this device ({torch.device(device)}): fp8 matmuls need a "
            "CUDA GPU with compute capability >= 8.9 (Ada, Hopper or newer); use bf16 or fp16")
    # Plain ops do not accept float8 operands: fp8 training needs scaled matmuls
    # (torch._scaled_mm) with an amax history per tensor, which this actuator does not do.
    raise PrecisionUnsupportedError(
        f"fp8 matmuls are available on {torch.device(device)} but this actuator does not "
        "implement scaled fp8 compute (amax history + torch._scaled_mm); use bf16 or fp16")


def _display(name: str) -> str:
    return name or ROOT_NAME


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm layer, which computes in fp32 under any policy."""
    return isinstance(module, NORM_TYPES)


def norm_only(model: nn.Module, patterns: Iterable[str]) -> bool:
    """Whether the modules ``patterns`` match are all norm layers (and there is one at least):
    a precision for them would change nothing. Patterns that match nothing are ignored here."""
    patterns = tuple(patterns)
    hits = [m for n, m in model.named_modules()
            if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    return bool(hits) and all(is_norm(m) for m in hits)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionPolicy:
    """Ordered rules (pattern -> precision, first match wins) and named groups of patterns.

    ``groups`` only name sets of modules (``set_group`` and local rollback act on them); the
    starting precision of every module comes from ``rules`` (unmatched modules inherit, the root
    is fp32).
    """

    rules: Mapping[str, Precision]
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", MappingProxyType(dict(self.rules)))
        object.__setattr__(self, "groups", MappingProxyType(
            {name: tuple(pats) for name, pats in self.groups.items()}))
        for pattern, precision in self.rules.items():
            if precision not in PRECISIONS:
                raise PrecisionError(
                    f"PrecisionPolicy.rules[{pattern!r}] must be one of {PRECISIONS}, "
                    f"got {precision!r}")
        for name, patterns in self.groups.items():
            if not patterns or any(not isinstance(p, str) for p in patterns):
                raise PrecisionError(
                    f"PrecisionPolicy.groups[{name!r}] must be a non-empty tuple of patterns")

    @classmethod
    def from_groups(
        cls, groups: Mapping[str, Sequence[str]], precisions: Mapping[str, Precision]
    ) -> PrecisionPolicy:
        """Rules from groups: each group's patterns get its precision (fp32 when not given)."""
        unknown = set(precisions) - set(groups)
        if unknown:
            raise PrecisionError(f"precisions name unknown groups: {sorted(unknown)}")
        rules: dict[str, Precision] = {}
        for name, patterns in groups.items():
            for pattern in patterns:
                rules.setdefault(pattern, precisions.get(name, "fp32"))
        return cls(rules=rules, groups={n: tuple(p) for n, p in groups.items()})


def match_modules(model: nn.Module, patterns: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Pattern -> qualified names of the modules it matches; raise on a pattern matching none."""
    names = [name for name, _ in model.named_modules()]
    out: dict[str, tuple[str, ...]] = {}
    for pattern in patterns:
        hits = tuple(n for n in names if fnmatch.fnmatchcase(n, pattern))
        if not hits:
            sample = ", ".join(_display(n) for n in names[:8])
            raise PatternMatchError(
                f"pattern {pattern!r} matches no module; names are dot-separated like: {sample}"
                f"{', ...' if len(names) > 8 else ''} ({len(names)} modules)")
        out[pattern] = hits
    return out


class PrecisionHandle:
    """The live precision assignment of one model; made by ``apply_precision``.

    Not thread-safe: change precisions at a step boundary, from the training thread (a change
    while a forward is running raises). Idempotent ``remove()``; also a context manager.
    """

    def __init__(self, model: nn.Module, policy: PrecisionPolicy) -> None:
        self.model = model
        self.policy = policy
        self._modules = dict(model.named_modules())
        self._parent = {n: n.rpartition(".")[0] for n in self._modules if n}
        self.matches: Mapping[str, tuple[str, ...]] = MappingProxyType(
            match_modules(model, policy.rules))
        groups = {g: match_modules(model, pats) for g, pats in policy.groups.items()}
        self.groups: Mapping[str, tuple[str, ...]] = MappingProxyType({
            g: tuple(dict.fromkeys(n for hits in by_pattern.values() for n in hits))
            for g, by_pattern in groups.items()})
        self._explicit: dict[str, str] = {}
        self._why: dict[str, str] = {}
        for pattern, precision in policy.rules.items():
            for name in self.matches[pattern]:
                if name not in self._explicit:
                    self._explicit[name] = precision
                    self._why[name] = f"rule {pattern!r}"
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._hooks: list[RemovableHandle] = []
        self._active = 0
        self._lock = threading.Lock()
        self._removed = False
        self._install()

    # ---- queries -------------------------------------------------------------------------

    def precision_of(self, module_name: str) -> str:
        """The precision ``module_name`` computes in: fp32 for a norm layer, else its own rule's,
        else its parent's."""
        if module_name not in self._modules:
            raise PrecisionError(f"no module named {module_name!r}")
        if is_norm(self._modules[module_name]):
            return "fp32"
        return self._assigned(module_name)

    def _assigned(self, module_name: str) -> str:
        """The precision the rules give ``module_name`` (its own, else its parent's)."""
        name: str | None = module_name
        while name is not None:
            if name in self._explicit:
                return self._explicit[name]
            name = self._parent.get(name)
        return "fp32"

    def report(self) -> str:
        """What each pattern and group matched and what every non-fp32 module computes in."""
        lines = ["pattern -> modules matched (first matching rule wins):"]
        for pattern, hits in self.matches.items():
            lines.append(f"  {pattern!r} ({self.policy.rules[pattern]}): "
                         f"{', '.join(_display(n) for n in hits)}")
        for group, hits in self.groups.items():
            lines.append(f"group {group!r}: {', '.join(_display(n) for n in hits)}")
        lines.append("modules not in fp32:")
        kept = []
        for name, module in self._modules.items():
            precision = self.precision_of(name)
            if precision != "fp32":
                why = self._why.get(name, "inherited")
                lines.append(f"  {_display(name)}: {precision} ({why})")
            elif is_norm(module) and self._assigned(name) != "fp32":
                kept.append(_display(name))
        if kept:
            lines.append(f"norm layers kept in fp32: {', '.join(kept)}")
        return "\n".join(lines)

    # ---- changes -------------------------------------------------------------------------

    def set_group(self, group: str, precision: Precision) -> None:
        """Switch every module of ``group`` to ``precision``; call at a step boundary."""
        if group not in self.groups:
            raise PrecisionError(f"unknown group {group!r}; groups: {sorted(self.groups)}")
        self.set_modules(self.groups[group], precision, why=f"group {group!r}")

    def set_modules(self, names: Iterable[str], precision: Precision, *,
                    why: str = "set_modules") -> None:
        """Switch the named modules and everything inside them to ``precision``.

        Rules on submodules of a named module are dropped, so the whole subtree follows it.
        """
        check_supported(precision, self._device)
        names = tuple(names)
        unknown = [n for n in names if n not in self._modules]
        if unknown:
            raise PrecisionError(f"no modules named {unknown[:5]}")
        with self._lock:
            if self._removed:
                raise PrecisionError("this precision handle was removed")
            if self._active:
                raise PrecisionError("precision changed during a forward; change it between "
                                     "steps")
            for name in names:
                prefix = f"{name}." if name else ""
                for inner in [n for n in self._explicit if n.startswith(prefix) and n != name]:
                    del self._explicit[inner], self._why[inner]
                self._explicit[name] = precision
                self._why[name] = why
            self._uninstall()
            self._install()

    def remove(self) -> None:
        """Remove every hook; parameters were never replaced, so the model is as before."""
        with self._lock:
            self._uninstall()
            self._removed = True

    def __enter__(self) -> PrecisionHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- hooks ---------------------------------------------------------------------------

    def _install(self) -> None:
        for precision in set(self._explicit.values()):
            check_supported(precision, self._device)
        for name, module in self._modules.items():
            mine = self.precision_of(name)
            outer = self.precision_of(self._parent[name]) if name else "fp32"
            if mine != outer:
                self._hooks.append(module.register_forward_pre_hook(
                    _cast_inputs(DTYPES[mine], self), with_kwargs=True))
                self._hooks.append(module.register_forward_hook(
                    _cast_outputs(DTYPES[outer], self), always_call=True))
            owned = [k for k, p in module._parameters.items()
                     if p is not None and p.is_floating_point()]
            if mine != "fp32" and owned:
                swap = _ParameterSwap(module, owned, DTYPES[mine])
                self._hooks.append(module.register_forward_pre_hook(swap.enter))
                self._hooks.append(module.register_forward_hook(swap.exit, always_call=True))

    def _uninstall(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _cast_tree(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _cast_inputs(dtype: torch.dtype, handle: PrecisionHandle) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        handle._active += 1
        return _cast_tree(args, dtype), _cast_tree(kwargs, dtype)
    return hook


def _cast_outputs(dtype: torch.dtype, handle: PrecisionHandle) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        handle._active -= 1
        return _cast_tree(output, dtype)
    return hook


class _ParameterSwap:
    """For one forward, the module's own parameters are differentiable compute-dtype copies."""

    def __init__(self, module: nn.Module, names: list[str], dtype: torch.dtype) -> None:
        self.module = module
        self.names = names
        self.dtype = dtype
        self.saved: list[dict[str, Any]] = []  # a stack: a module may be re-entered

    def enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        params = module._parameters
        self.saved.append({k: params[k] for k in self.names})
        for k in self.names:
            params[k] = params[k].to(self.dtype)  # type: ignore[assignment,union-attr]

    def exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.saved:
            module._parameters.update(self.saved.pop())


def apply_precision(model: nn.Module, policy: PrecisionPolicy) -> PrecisionHandle:
    """Make each module compute in the precision ``policy`` gives it; see the module docstring.

    Raises ``PatternMatchError`` for a pattern that matches no module and
    ``PrecisionUnsupportedError`` for a precision the model's device cannot compute in.
    """
    return PrecisionHandle(model, policy)
