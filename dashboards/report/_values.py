"""What a report holds: findings, changes with their savings and payback, panels and markers
per job, and the week's totals."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd

from collectors import (
    SeedanceError,
)
from collectors.names import ATTR_HOST_NAME, ATTR_SEEDANCE_RANK, ATTR_SERVICE_NAME

JOB_ATTR = ATTR_SERVICE_NAME
HOST_ATTR = ATTR_HOST_NAME
RANK_ATTR = ATTR_SEEDANCE_RANK
HOURS_PER_MONTH = 730.0
"""Hours in an average month (8,760 / 12): a GPU's monthly cost is price x 730."""
NS = 1_000_000_000
VALUE_COLUMNS = ("time", "value", "min", "max", "count", "last")
MAX_INTERVALS = 1500
"""Histogram intervals per series a plot gets at most (a week of minutes is 10,080)."""
HUMAN_EXCLUDED = frozenset({"auto", "mode:off", "controller", "recovery", "job"})
"""Actors that are not people: their decisions do not count as time to a human decision."""


class ReportError(SeedanceError):
    """A report cannot be built as asked (bad range, unreadable source)."""


# ---- values ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FindingRow:
    """One finding of the job that was open at some time in the range."""

    id: str
    detector: str
    severity: str
    resource: Mapping[str, str]
    opened_at_ns: int
    closed_at_ns: int | None
    open_s: float
    """Closed: closed - opened. Still open: the range's end - opened."""
    summary: str
    opened_in_range: bool
    closed_in_range: bool


@dataclass(frozen=True, kw_only=True)
class ChangeRow:
    """One change of the job with a journal event in the range, as the journal tells it."""

    id: str
    state: str
    source: str
    reason: str
    values: Mapping[str, Any]
    baseline: Mapping[str, Any]
    """The config the change was tried against (``values`` override it)."""
    risk: str
    scope: str
    proposed_at_ns: int
    decided_at_ns: int | None
    decided_by: str | None
    decision: str | None
    decision_s: float | None
    """Proposal to a person's approve/reject (None when no person decided)."""
    applied_at_ns: int | None
    kept_at_ns: int | None
    rolled_back_at_ns: int | None
    rollback_cause: str | None
    rollback_kind: str | None
    rolled_back_by: str | None
    gain: float | None
    ci_low: float | None
    ci_high: float | None
    confidence: float | None
    pairs: int | None
    candidate_gpu_hours: float
    """GPU-hours the change's candidate windows ran (the price of trying it)."""
    states_entered: tuple[str, ...]
    """States this change entered inside the range, in order."""


@dataclass(frozen=True, kw_only=True)
class Savings:
    """GPU-hours and money one kept change saved in the range (see :func:`savings_of`)."""

    change_id: str
    gain: float
    ci_low: float
    ci_high: float
    gpus: int
    hours_after: float
    gpu_hours_after: float
    gpu_hours_saved: float
    gpu_hours_saved_low: float
    gpu_hours_saved_high: float
    cost_saved: float
    cost_saved_low: float
    cost_saved_high: float
    nodes_saved: float
    nodes_saved_low: float
    nodes_saved_high: float


@dataclass(frozen=True, kw_only=True)
class Payback:
    """The ROI model's payback of the week's tuning for one job."""

    fix_cost: float
    gpu_months_saved: float
    gpu_months_saved_low: float
    gpu_months_saved_high: float
    node_cost_per_month: float
    months: float
    months_best: float
    months_worst: float


@dataclass(frozen=True, kw_only=True)
class Panel:
    """One plotted quantity: ``frame`` has time (UTC), value and series (a label per line)."""

    key: str
    title: str
    unit: str
    metrics: tuple[str, ...]
    frame: pd.DataFrame
    replayed: bool


@dataclass(frozen=True, kw_only=True)
class Marker:
    """A vertical line on every plot: a change applied, kept or rolled back."""

    at_ns: int
    kind: Literal["apply", "kept", "rolled_back"]
    change_id: str


@dataclass(frozen=True, kw_only=True)
class ConfigRow:
    """Throughput of one config over every version that ran it."""

    config: str
    """What the config changes from the range's starting config, in words."""
    versions: tuple[int, ...]
    points: int
    mean: float
    vs_start: float | None
    """Mean relative to the starting config's mean (None when that config has no points)."""


@dataclass(frozen=True, kw_only=True)
class JobReport:
    job: str
    kind: str
    findings: tuple[FindingRow, ...]
    changes: tuple[ChangeRow, ...]
    state_counts: Mapping[str, int]
    """Changes that entered each state inside the range (journal events)."""
    panels: tuple[Panel, ...]
    markers: tuple[Marker, ...]
    throughput_by_version: pd.DataFrame
    """version, mean (tokens/s, weighted by points), points: the throughput panel's metric."""
    by_config: tuple[ConfigRow, ...]
    gpus: int
    gpu_hours: float
    """GPUs x hours with throughput points in the range: what the job ran."""
    savings: tuple[Savings, ...]
    payback: Payback | None
    headline: tuple[str, ...] = ()
    """The job's result in a few plain sentences: kept, rolled back, incidents, cost."""

    @property
    def quiet(self) -> bool:
        """Nothing to read: no change, no finding, no panel with data."""
        return not (self.changes or self.findings or self.panels)


@dataclass(frozen=True, kw_only=True)
class ReportData:
    since_ns: int
    until_ns: int
    source: str
    price_per_gpu_hour: float
    currency: str
    jobs: tuple[JobReport, ...]
    replayed_panels: tuple[str, ...] = field(default=())
    """``job/panel`` keys whose points carry seedance.replayed=true."""


