"""The search's settings (``SearchConfig``) and what it asks to measure (``Proposal``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from collectors import ConfigError
from tuner._knobs import KnobValue


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """The driver's settings; ``trial_lease_s`` must outlast the longest gap between
    heartbeats (one rollout window). ``sample_after_moves``: once every single move from the
    baseline was tried, let the sampler propose (multi-knob configs); off by default, since a
    live job pays for every trial and a sampled config may move many knobs at once."""

    study_name: str
    direction: Literal["maximize", "minimize"] = "maximize"
    trial_lease_s: float = 900.0
    tpe_startup_trials: int = 2
    pruner_startup_trials: int = 2
    max_ask_attempts: int = 20
    seed: int | None = None
    sample_after_moves: bool = False
    revisit_after_s: float | None = 300.0
    """Once every single move from the baseline was tried, a neighbour measured longer ago than
    this is measured again, the best measured first (None: never). A config kept while a
    neighbour process loaded the box can lose once it is gone: a step back is one move."""

    def __post_init__(self) -> None:
        if not self.study_name:
            raise ConfigError("SearchConfig.study_name must not be empty")
        if self.revisit_after_s is not None and not self.revisit_after_s > 0:
            raise ConfigError("SearchConfig.revisit_after_s must be > 0 or None")
        if self.direction not in ("maximize", "minimize"):
            raise ConfigError(f"SearchConfig.direction must be maximize or minimize, "
                             f"got {self.direction!r}")
        if not self.trial_lease_s > 0:
            raise ConfigError("SearchConfig.trial_lease_s must be > 0")
        if self.max_ask_attempts < 1:
            raise ConfigError("SearchConfig.max_ask_attempts must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """A config to measure: the study's trial ``number`` and the knob ``values``."""

    number: int
    values: dict[str, KnobValue]
    origin: str = ""
    """Why this config: a prior's finding, a single move, "again: ..." or "revisit: ..."."""
    continues: Mapping[str, Any] | None = None
    """An "again" trial's earlier pairs (``UNDECIDED_PAIRS_ATTR``), for its change's meta."""
