"""Gradient underflow per module group: a group whose gradients flush to zero starves every
group upstream of it while the global norm (dominated by the groups near the loss) may hardly
move, so it is judged per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import CONFIG_VERSION_ATTR
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._gradient_parts import (
    UNDERFLOW,
    GroupView,
    RankSplit,
    backoff_streak,
    check_config,
    rank_rows,
    value_at,
)
from policies.detectors._steps import (
    GRAD_NORM,
    GROUP_NORM,
    MODULE_GROUP_ATTR,
    RANK_ATTR,
    SCALE,
    ZERO_FRACTION,
    by,
    per_step,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class UnderflowConfig:
    """When a module group counts as underflowing, and where gradients flow.

    A group underflows when its last ``zero_readings`` per-step norms are exactly 0 and either
    it had a non-zero norm earlier in the window (an onset) or its latest exactly-zero element
    fraction is at least ``full_zero_fraction`` (its gradients exist and are all zero; a group
    with no gradients at all reports fraction 0). It is also flagged when its zero fraction rose
    by at least ``zero_fraction_rise`` within the window (partial flush). A GradScaler scale
    that fell ``scale_backoffs`` readings in a row is flagged too. ``forward_order`` lists module
    groups from input to loss, to name the cause (see :func:`locate_cause`).
    """

    zero_readings: int = 3
    full_zero_fraction: float = 0.99
    zero_fraction_rise: float = 0.5
    scale_backoffs: int = 5
    forward_order: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_config(self.zero_readings >= 1, f"zero_readings must be >= 1, got {self.zero_readings}")
        check_config(0 < self.full_zero_fraction <= 1,
               f"full_zero_fraction must be in (0, 1], got {self.full_zero_fraction}")
        check_config(0 < self.zero_fraction_rise <= 1,
               f"zero_fraction_rise must be in (0, 1], got {self.zero_fraction_rise}")
        check_config(self.scale_backoffs >= 1,
               f"scale_backoffs must be >= 1, got {self.scale_backoffs}")
        object.__setattr__(self, "forward_order", tuple(self.forward_order))


def _fractions_by_group(zeros: pd.DataFrame) -> dict[str, np.ndarray]:
    """One rank's zero-fraction readings of each module group, in time order."""
    if zeros.empty or MODULE_GROUP_ATTR not in zeros.columns:
        return {}
    values = zeros["value"].to_numpy(np.float64)
    return {str(group): values[index] for group, index in
            zeros.groupby(MODULE_GROUP_ATTR, sort=False).indices.items()}


@dataclass(frozen=True, slots=True)
class _GroupState:
    """What the window says about one module group's gradients."""

    group: str
    zero_tail: int
    last_nonzero_norm: float
    zero_fraction_first: float
    zero_fraction_last: float
    onset_step: float
    onset_version: str


class GradientUnderflowDetector(Detector):
    """Flags module groups whose gradients flush to zero, naming the group where it starts.

    Reads per-step ``grad.group_norm``, ``grad.zero_fraction`` and ``grad_scaler.scale``. One
    critical finding per rank with the cause group as resource; the starved upstream groups are
    listed as affected. Suggests the cause group back to fp32 (a local rollback).
    """

    def __init__(self, config: UnderflowConfig | None = None, *,
                 name: str = UNDERFLOW) -> None:
        self.config = config or UnderflowConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        return [] if nothing_underflowing(window, self.config) else self.judge(window)

    def judge(self, window: StoreWindow) -> list[Finding]:
        """The findings of ``window``, judged step by step and group by group (``evaluate``
        skips this when :func:`nothing_underflowing` proves there can be none)."""
        norms = per_step(window, GROUP_NORM)
        zeros = per_step(window, ZERO_FRACTION)
        scales = per_step(window, SCALE)
        totals = per_step(window, GRAD_NORM)
        findings = []
        zeros_by_rank = RankSplit(zeros)
        for rank, rows in by(norms, [RANK_ATTR]):
            fractions = _fractions_by_group(zeros_by_rank.rows(rank))
            states = [s for g, group_rows in by(self._suspects(rows, fractions),
                                                [MODULE_GROUP_ATTR])
                      if (s := self._state(g.get(MODULE_GROUP_ATTR, ""), group_rows,
                                           fractions)) is not None]
            rank_scales = rank_rows(scales, rank)
            finding = self._finding(window.job, rank, states, rows, backoff_streak(rank_scales),
                                    rank_scales, rank_rows(totals, rank),
                                    GroupView.of(window, rows, self.config.forward_order))
            if finding is not None:
                findings.append(finding)
        return findings

    def _suspects(self, rows: pd.DataFrame, fractions: dict[str, np.ndarray]) -> pd.DataFrame:
        """The rows of the groups ``_state`` may flag (its last norm is 0, or its zero fraction
        rose enough), cut in one vectorised pass: judging each group of a model of hundreds of
        groups one by one took seconds a pass."""
        if MODULE_GROUP_ATTR not in rows.columns:
            return rows
        last = rows.drop_duplicates(MODULE_GROUP_ATTR, keep="last")
        zeroed = set(last.loc[last["value"].to_numpy(np.float64) == 0, MODULE_GROUP_ATTR])
        rising = {g for g, f in fractions.items()
                  if f.size >= 2 and f[-1] - f.min() >= self.config.zero_fraction_rise}
        groups = rows[MODULE_GROUP_ATTR]
        return rows[groups.isin(zeroed | rising) | groups.isna()]

    def _state(self, group: str, rows: pd.DataFrame,
               fractions_by_group: dict[str, np.ndarray]) -> _GroupState | None:
        cfg = self.config
        values = rows["value"].to_numpy(dtype=np.float64)
        nonzero = np.flatnonzero(values != 0)
        tail = values.size - 1 - int(nonzero[-1]) if nonzero.size else values.size
        fractions = fractions_by_group.get(group, np.empty(0))
        first = float(fractions.min()) if fractions.size else math.nan
        last = float(fractions[-1]) if fractions.size else math.nan
        zeroed = tail >= cfg.zero_readings and (
            tail < values.size or (fractions.size > 0 and last >= cfg.full_zero_fraction))
        rising = fractions.size >= 2 and last - first >= cfg.zero_fraction_rise
        if not (zeroed or rising):
            return None
        onset = values.size - tail if tail else values.size - 1
        return _GroupState(
            group=group, zero_tail=tail,
            last_nonzero_norm=float(values[nonzero[-1]]) if nonzero.size else math.nan,
            zero_fraction_first=first, zero_fraction_last=last,
            onset_step=float(rows["step"].iloc[onset]),
            onset_version=value_at(rows, CONFIG_VERSION_ATTR, onset))

    def _finding(self, job: str, rank: dict[str, str], states: list[_GroupState],
                 rows: pd.DataFrame, streak: int, scales: pd.DataFrame,
                 totals: pd.DataFrame, view: GroupView) -> Finding | None:
        cfg = self.config
        backing_off = streak >= cfg.scale_backoffs
        if not states and not backing_off:
            return None
        measurements = [Measurement(name="scale_backoff_streak", value=float(streak),
                                    unit="{reading}")]
        thresholds = [Threshold(measurement="scale_backoff_streak", comparison=">=",
                                value=float(cfg.scale_backoffs), unit="{reading}")
                      ] if backing_off else []
        if not scales.empty:
            measurements.append(Measurement(name="loss_scale", value=float(
                scales["value"].iloc[-1])))
        if not states:
            return Finding(
                detector=self.name, job=job, severity="critical", resource=rank,
                evidence=Evidence(
                    summary=(f"the GradScaler loss scale fell {streak} readings in a row: "
                             "steps keep overflowing and being skipped, and the shrinking "
                             "scale pushes small gradients toward underflow"),
                    model="GradScaler back-off streak", measurements=tuple(measurements),
                    thresholds=tuple(thresholds)),
                suggested_changes=(SuggestedChange(
                    knob="precision", value="fp32",
                    expected_effect="no loss scaling needed; steps stop being skipped"),),
            )
        by_group = {s.group: s for s in states}
        causes, how = view.locate(list(by_group))
        affected = sorted(set(by_group) - set(causes))
        for s in (by_group[c] for c in causes):
            measurements += [
                Measurement(name=f"{s.group}.zero_norm_steps", value=float(s.zero_tail),
                            unit="{step}"),
                Measurement(name=f"{s.group}.last_nonzero_norm", value=s.last_nonzero_norm),
                Measurement(name=f"{s.group}.zero_fraction", value=s.zero_fraction_last),
                Measurement(name=f"{s.group}.onset_step", value=s.onset_step, unit="{step}"),
            ]
            if s.zero_tail >= cfg.zero_readings:
                thresholds.append(Threshold(measurement=f"{s.group}.zero_norm_steps",
                                            comparison=">=", value=float(cfg.zero_readings),
                                            unit="{step}"))
            rise = s.zero_fraction_last - s.zero_fraction_first
            if rise >= cfg.zero_fraction_rise:
                measurements.append(Measurement(name=f"{s.group}.zero_fraction_rise",
                                                value=rise))
                thresholds.append(Threshold(measurement=f"{s.group}.zero_fraction_rise",
                                            comparison=">=", value=cfg.zero_fraction_rise))
        onset = min(by_group[c].onset_step for c in causes)
        if not totals.empty:
            steps = totals["step"].to_numpy(dtype=np.float64)
            before = totals["value"][steps < onset]
            after = totals["value"][steps >= onset]
            if len(before) and len(after):
                measurements += [
                    Measurement(name="global_norm_before", value=float(before.median())),
                    Measurement(name="global_norm_after", value=float(after.median()))]
        first = by_group[causes[0]]
        where = " or ".join(causes)
        summary = (f"gradients of module group {where} flushed to zero from step "
                   f"{onset:.0f}" + (f" (config version {first.onset_version})"
                                     if first.onset_version else "")
                   + (f"; starved upstream: {', '.join(affected)}" if affected else "")
                   + (f"; loss scale fell {streak} readings in a row" if backing_off else "")
                   + f"; cause: {how}" + view.by_hand(causes))
        return Finding(
            detector=self.name, job=job, severity="critical",
            resource={**rank, MODULE_GROUP_ATTR.removeprefix("seedance."): ",".join(causes)},
            evidence=Evidence(
                summary=summary,
                model=("per-group underflow: group L2 norm exactly 0 for "
                       f"{cfg.zero_readings}+ steps after being non-zero (or all elements "
                       f"zero, >= {cfg.full_zero_fraction:g}), or exactly-zero element "
                       f"fraction up by >= {cfg.zero_fraction_rise:g}; cause = {how}"),
                measurements=tuple(measurements), thresholds=tuple(thresholds)),
            suggested_changes=tuple(
                SuggestedChange(knob=f"precision.{c}", value="fp32",
                                expected_effect=(f"{c} computes in fp32 again, so its gradients"
                                                 + (f" and those of {', '.join(affected)}"
                                                    if affected else "")
                                                 + " stop flushing to zero (local rollback)"))
                for c in view.not_yet(causes, "fp32")),
        )


def nothing_underflowing(window: StoreWindow, config: UnderflowConfig) -> bool:
    """True when no reading in ``window`` could make a finding: no group norm is exactly 0,
    no zero fraction moved by ``zero_fraction_rise`` or more, and the loss scale never moved.
    On a healthy job of hundreds of groups the per-step pairing and the per-group judgement
    were most of a policy pass; this reads only bounds on the raw values, which the store
    keeps per chunk (bounds of a superset of the window prove as much: a value absent from
    them is absent from it).

    The per-step readings are a subset of the raw ones: a zeroed group needs a zero norm, a
    rising one a per-group rise no larger than the raw spread, and a back-off streak a fall,
    which an unchanged scale never has (readings of two versions at one instant may pair in
    either order, so any change at all takes the slow path).
    """
    if window.value_bounds(GROUP_NORM).could_hold(0.0):
        return False
    if window.value_bounds(ZERO_FRACTION).spread() >= config.zero_fraction_rise:
        return False
    return window.value_bounds(SCALE).constant()
