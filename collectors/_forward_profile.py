"""The forward profiler's settings, its result, and how module groups and blocks are found.

Everything here is plain data or a pure function of the model, so ``_group_profiler`` (the
hooks) is left with timing and publishing alone.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from collectors._errors import SeedanceError


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


def direct_groups(model: nn.Module, groups: Mapping[str, Sequence[str]]) -> dict[str, int]:
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

