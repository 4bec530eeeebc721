"""Gradient health: the seed's collapse rule, per-group underflow, and non-finite values.

Collapse (seed 3.3) is judged on the global gradient norm, exactly as the seed writes it.
The seed's ratio ``||g_t|| / ||g_{t-1}||`` is undefined after a zero norm, so its rule never
fires on gradients that flush to exactly zero: :class:`GradientUnderflowDetector` catches that,
per module group, because a group that underflows starves every group upstream of it while the
global norm (dominated by the groups near the loss) may hardly move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import CONFIG_VERSION_ATTR
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._model_view import forward_order, single_precisions
from policies.detectors._series import increase
from policies.detectors._steps import (
    GRAD_NORM,
    GROUP_NORM,
    LEARNING_RATE,
    LOSS,
    MODULE_GROUP_ATTR,
    NONFINITE,
    PRECISION_ATTR,
    RANK_ATTR,
    REDUCED_PRECISIONS,
    SCALE,
    ZERO_FRACTION,
    attribute_columns,
    by,
    per_step,
)

COLLAPSE = "gradient_collapse"
UNDERFLOW = "gradient_underflow"
NON_FINITE = "non_finite"
"""The gradient detectors' names, which the tuner's guardrail watches."""
NONFINITE_STEPS = "seedance.train.nonfinite_steps"
NONFINITE_WHAT = "seedance.nonfinite.what"


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# -- collapse (seed 3.3) ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class CollapseConfig:
    """The seed's collapse rule (section 3.3); the defaults are the seed's numbers.

    At step t the rule holds when ``||g_i|| / ||g_{i-1}|| < ratio_below`` for each of the
    ``consecutive`` steps i = t-consecutive+1 .. t (each ratio defined: the previous norm
    finite and > 0), AND the population variance (ddof 0) of the ``variance_window`` norms
    ``||g_{t-variance_window+1}|| .. ||g_t||`` is below ``variance_below``. "Gradient
    variance" is thus the variance of the per-step global L2 norms in the window, not of the
    gradient elements. The rule needs the full variance window, so it holds at t >= 4 at the
    earliest with the defaults.
    """

    ratio_below: float = 0.05
    consecutive: int = 3
    variance_below: float = 1e-8
    variance_window: int = 5

    def __post_init__(self) -> None:
        _check(self.ratio_below > 0, f"ratio_below must be > 0, got {self.ratio_below}")
        _check(self.consecutive >= 1, f"consecutive must be >= 1, got {self.consecutive}")
        _check(self.variance_below > 0, f"variance_below must be > 0, got {self.variance_below}")
        _check(self.variance_window >= 2,
               f"variance_window must be >= 2, got {self.variance_window}")


def _rule_holds(norms: np.ndarray, t: int, rule: CollapseConfig) -> bool:
    if t < max(rule.consecutive, rule.variance_window - 1):
        return False
    for i in range(t - rule.consecutive + 1, t + 1):
        prev = norms[i - 1]
        if not (math.isfinite(prev) and prev > 0 and norms[i] / prev < rule.ratio_below):
            return False
    window = norms[t - rule.variance_window + 1:t + 1]
    return bool(np.isfinite(window).all() and np.var(window) < rule.variance_below)


def article_collapse_step(norms: Sequence[float], rule: CollapseConfig | None = None) -> int | None:
    """The first index t of ``norms`` (per-step global gradient L2 norms) where the seed's
    collapse rule holds (see :class:`CollapseConfig`), or None if it never does."""
    rule = rule or CollapseConfig()
    values = np.asarray(norms, dtype=np.float64)
    return next((t for t in range(values.size) if _rule_holds(values, t, rule)), None)


class GradientCollapseDetector(Detector):
    """Flags a rank whose global gradient norm collapsed by the seed's rule (seed 3.3).

    Reads ``seedance.train.grad.norm`` one reading per step (see ``policies.detectors._steps``).
    Critical: collapse is a guardrail; the seed's remedy is a rollback to the checkpoint taken
    before precision was lowered, with mixed precision off for the offending layer.
    """

    def __init__(self, config: CollapseConfig | None = None, *,
                 name: str = COLLAPSE) -> None:
        self.config = config or CollapseConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        findings = []
        rule = self.config
        for key, rows in by(per_step(window, GRAD_NORM), [RANK_ATTR]):
            norms = rows["value"].to_numpy(dtype=np.float64)
            t = article_collapse_step(norms, rule)
            if t is None:
                continue
            ratios = [norms[i] / norms[i - 1] for i in range(t - rule.consecutive + 1, t + 1)]
            span = norms[t - rule.variance_window + 1:t + 1]
            step = rows["step"].iloc[t]
            measurements = [
                Measurement(name="collapse_step", value=float(step), unit="{step}"),
                Measurement(name="max_norm_ratio", value=float(max(ratios))),
                Measurement(name="norm_variance", value=float(np.var(span))),
                *(Measurement(name=f"norm[t-{len(span) - 1 - i}]", value=float(v))
                  for i, v in enumerate(span)),
            ]
            version = _at(rows, CONFIG_VERSION_ATTR, t)
            findings.append(Finding(
                detector=self.name, job=window.job, severity="critical", resource=key,
                evidence=Evidence(
                    summary=(f"the global gradient norm fell below {rule.ratio_below:g} of the "
                             f"step before {rule.consecutive} steps running, ending at step "
                             f"{step:.0f}" + (f" under config version {version}" if version
                                              else "")),
                    model=(f"seed 3.3 gradient collapse: ||g_t||/||g_t-1|| < {rule.ratio_below:g}"
                           f" for {rule.consecutive} consecutive steps and population variance "
                           f"of the last {rule.variance_window} per-step norms < "
                           f"{rule.variance_below:g}"),
                    measurements=tuple(measurements),
                    thresholds=(
                        Threshold(measurement="max_norm_ratio", comparison="<",
                                  value=rule.ratio_below),
                        Threshold(measurement="norm_variance", comparison="<",
                                  value=rule.variance_below))),
                suggested_changes=(
                    SuggestedChange(knob="checkpoint.restore", value="before_precision_change",
                                    expected_effect="weights from before the collapse; the "
                                    "optimizer's momentum for the affected parameters reset"),
                    SuggestedChange(knob="precision", value="fp32",
                                    expected_effect="gradients keep their magnitude; the seed "
                                    "prefers undoing only the offending layer when it is known"),
                ),
            ))
        return findings


def _at(rows: pd.DataFrame, column: str, i: int) -> str:
    return str(rows[column].iloc[i]) if column in rows.columns else ""


# -- locating the cause among module groups -------------------------------------------------

def locate_cause(bad: Sequence[str], *, forward_order: Sequence[str] = (),
                 precisions: dict[str, str] | None = None) -> tuple[list[str], str]:
    """The group(s) where a gradient fault starts, and how that was decided.

    Gradients flow from the loss back through the forward order, so a group that zeroes (or
    turns non-finite) its gradients does the same to every group upstream of it: the cause is
    the most downstream bad group in ``forward_order``. A single bad group is its own cause.
    Without an order, a bad group computing in reduced precision (``precisions``) while the
    others do not is the cause. Otherwise it is ambiguous and every bad group is returned.
    """
    if len(set(bad)) == 1:
        return sorted(set(bad)), "the only bad group"
    ordered = [g for g in forward_order if g in bad]
    if ordered:
        return [ordered[-1]], "most downstream bad group in the forward order"
    reduced = [g for g in bad if (precisions or {}).get(g) in REDUCED_PRECISIONS]
    if len(reduced) == 1:
        return reduced, f"the only bad group computing in {(precisions or {})[reduced[0]]}"
    return sorted(reduced or bad), ("ambiguous: no forward order and no single "
                                    "reduced-precision group")


def _latest(frame: pd.DataFrame, column: str) -> dict[str, str]:
    """The latest value of ``column`` per module group in ``frame``."""
    if frame.empty or column not in frame.columns or MODULE_GROUP_ATTR not in frame.columns:
        return {}
    last = frame.dropna(subset=[column]).groupby(MODULE_GROUP_ATTR).tail(1)
    return dict(zip(last[MODULE_GROUP_ATTR].astype(str), last[column].astype(str), strict=True))


@dataclass(frozen=True, slots=True)
class GroupView:
    """One rank's module groups as the job runs them: their forward order (configured, else
    the profiler's), the precision each ``precision.<group>`` knob holds, and the precision the
    profiler saw each group compute in (which a cast by hand or autocast can make differ)."""

    order: tuple[str, ...]
    knobs: dict[str, str]
    observed: dict[str, str]

    @classmethod
    def of(cls, window: StoreWindow, rows: pd.DataFrame,
           configured_order: tuple[str, ...]) -> GroupView:
        return cls(order=configured_order or forward_order(window),
                   knobs=_latest(rows, PRECISION_ATTR), observed=single_precisions(window))

    def locate(self, bad: Sequence[str]) -> tuple[list[str], str]:
        return locate_cause(bad, forward_order=self.order,
                            precisions={**self.knobs, **self.observed})

    def not_yet(self, groups: Sequence[str], precision: str) -> list[str]:
        """The groups whose knob does not hold ``precision`` already and that do not compute
        in it already: a suggestion to set it there would change nothing."""
        return [g for g in groups
                if self.knobs.get(g) != precision and self.observed.get(g) != precision]

    def by_hand(self, groups: Sequence[str]) -> str:
        """What the profiler saw each group compute in, when not fp32; and when the job's
        points say what its knob holds and that differs, that it was set outside the knob (a
        cast by hand or an autocast)."""
        notes = []
        for g in groups:
            seen, knob = self.observed.get(g), self.knobs.get(g)
            if seen is None or seen == (knob or "fp32"):
                continue
            outside = (f" while precision.{g} holds {knob} (a cast by hand or autocast)"
                       if knob else "")
            notes.append(f"; {g} computes in {seen}{outside}")
        return "".join(notes)


def _backoff_streak(scale: pd.DataFrame) -> int:
    """Trailing readings in a row where the loss scale fell."""
    values = scale["value"].to_numpy(dtype=np.float64)
    streak = 0
    for i in range(values.size - 1, 0, -1):
        if not values[i] < values[i - 1]:
            break
        streak += 1
    return streak


def _rank_rows(frame: pd.DataFrame, rank: dict[str, str]) -> pd.DataFrame:
    if frame.empty:
        return frame
    keep = np.ones(len(frame), dtype=bool)
    for column, value in rank.items():
        if column in frame.columns:
            keep &= (frame[column] == value).to_numpy(dtype=bool)
    return frame[keep].reset_index(drop=True)


# -- underflow ------------------------------------------------------------------------------

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
        _check(self.zero_readings >= 1, f"zero_readings must be >= 1, got {self.zero_readings}")
        _check(0 < self.full_zero_fraction <= 1,
               f"full_zero_fraction must be in (0, 1], got {self.full_zero_fraction}")
        _check(0 < self.zero_fraction_rise <= 1,
               f"zero_fraction_rise must be in (0, 1], got {self.zero_fraction_rise}")
        _check(self.scale_backoffs >= 1,
               f"scale_backoffs must be >= 1, got {self.scale_backoffs}")
        object.__setattr__(self, "forward_order", tuple(self.forward_order))


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
        norms = per_step(window, GROUP_NORM)
        zeros = per_step(window, ZERO_FRACTION)
        scales = per_step(window, SCALE)
        totals = per_step(window, GRAD_NORM)
        findings = []
        for rank, rows in by(norms, [RANK_ATTR]):
            states = [s for g, group_rows in by(rows, [MODULE_GROUP_ATTR])
                      if (s := self._state(g.get(MODULE_GROUP_ATTR, ""), group_rows,
                                           _rank_rows(zeros, rank))) is not None]
            streak = _backoff_streak(_rank_rows(scales, rank))
            finding = self._finding(window.job, rank, states, rows, streak,
                                    _rank_rows(scales, rank), _rank_rows(totals, rank),
                                    GroupView.of(window, rows, self.config.forward_order))
            if finding is not None:
                findings.append(finding)
        return findings

    def _state(self, group: str, rows: pd.DataFrame, zeros: pd.DataFrame) -> _GroupState | None:
        cfg = self.config
        values = rows["value"].to_numpy(dtype=np.float64)
        nonzero = np.flatnonzero(values != 0)
        tail = values.size - 1 - int(nonzero[-1]) if nonzero.size else values.size
        fractions = (zeros[zeros[MODULE_GROUP_ATTR] == group]["value"].to_numpy(np.float64)
                     if not zeros.empty and MODULE_GROUP_ATTR in zeros.columns else np.empty(0))
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
            onset_version=_at(rows, CONFIG_VERSION_ATTR, onset))

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


# -- non-finite -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class NonFiniteConfig:
    """When non-finite values count.

    A non-finite loss always counts. Without a GradScaler, non-finite gradients count at once
    (a non-finite norm, or ``grad.nonfinite`` elements > 0). With one (``grad_scaler.scale``
    readings present) an overflow is routine (the scaler skips the step and backs off), so they
    count only when the last ``scaler_tolerated`` per-step norms in a row are non-finite or the
    scale backed off that many steps in a row (each back-off is one overflowing step).

    The OpenTelemetry SDK drops non-finite values set on a gauge (it logs "not finite ...
    ignoring measurement" and keeps exporting the last finite one), so through the SDK a NaN
    loss or norm never reaches the store; the element counts and the scale do. Non-finite
    readings are still honoured when a source passes them (Prometheus scrapes, other SDKs). ``lr_cut`` is the factor the suggested learning rate
    applies to the last one read.
    """

    scaler_tolerated: int = 3
    lr_cut: float = 0.1
    forward_order: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(self.scaler_tolerated >= 1,
               f"scaler_tolerated must be >= 1, got {self.scaler_tolerated}")
        _check(0 < self.lr_cut < 1, f"lr_cut must be in (0, 1), got {self.lr_cut}")
        object.__setattr__(self, "forward_order", tuple(self.forward_order))


def _trailing(mask: np.ndarray) -> int:
    """How many of the last entries of ``mask`` are True in a row."""
    false = np.flatnonzero(~mask)
    return int(mask.size - 1 - false[-1]) if false.size else int(mask.size)


class NonFiniteDetector(Detector):
    """Flags a rank whose loss or gradients are NaN or infinite (critical; a guardrail).

    Names the module group where non-finite gradients start (most downstream in
    ``forward_order``, as for underflow) when per-group readings show it.
    """

    def __init__(self, config: NonFiniteConfig | None = None, *,
                 name: str = NON_FINITE) -> None:
        self.config = config or NonFiniteConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        loss = per_step(window, LOSS)
        grads = per_step(window, GRAD_NORM)
        groups = per_step(window, GROUP_NORM)
        counts = per_step(window, NONFINITE)
        scales = per_step(window, SCALE)
        lrs = per_step(window, LEARNING_RATE)
        counter = window.query(NONFINITE_STEPS)
        ranks = {tuple(sorted(k.items())) for frame in (loss, grads, counts, counter)
                 for k, _ in by(frame, [RANK_ATTR])}
        findings = []
        for rank in (dict(r) for r in sorted(ranks)):
            rank_loss = _rank_rows(loss, rank)
            rank_grads = _rank_rows(grads, rank)
            rank_counts = _rank_rows(counts, rank)
            rank_scales = _rank_rows(scales, rank)
            bad_loss = ~np.isfinite(rank_loss["value"].to_numpy(dtype=np.float64))
            bad_grad = ~np.isfinite(rank_grads["value"].to_numpy(dtype=np.float64))
            counted = _counted_nonfinite(_rank_rows(counter, rank))
            loss_steps = max(float(bad_loss.sum()), counted.get("loss", 0.0))
            grad_steps = max(float(bad_grad.sum()), counted.get("grad_norm", 0.0))
            elements = (rank_counts.groupby("time")["value"].sum() if not rank_counts.empty
                        else pd.Series(dtype="float64"))
            scaled = not rank_scales.empty
            grad_run = _trailing(bad_grad)
            streak = _backoff_streak(rank_scales)
            if scaled:
                grad_bad = max(grad_run, streak) >= cfg.scaler_tolerated
            else:
                grad_bad = bool(grad_steps > 0 or (elements > 0).any())
            if not (loss_steps > 0 or grad_bad):
                continue
            bad_groups = self._bad_groups(_rank_rows(groups, rank), _rank_rows(counts, rank))
            view = GroupView.of(window, _rank_rows(groups, rank), cfg.forward_order)
            causes, how = view.locate(bad_groups) if bad_groups else ([], "")
            measurements = [
                Measurement(name="nonfinite_loss_steps", value=loss_steps, unit="{step}"),
                Measurement(name="nonfinite_grad_norm_steps", value=grad_steps, unit="{step}"),
                Measurement(name="nonfinite_grad_run", value=float(grad_run), unit="{step}"),
                Measurement(name="nonfinite_elements_max",
                            value=float(elements.max()) if len(elements) else 0.0,
                            unit="{element}"),
            ]
            if scaled:
                measurements.append(Measurement(name="scale_backoff_streak", value=float(
                    streak), unit="{step}"))
            first = _first_bad_step(rank_loss, bad_loss, rank_grads, bad_grad, rank_counts)
            if not math.isnan(first):
                measurements.append(Measurement(name="first_nonfinite_step", value=first,
                                                unit="{step}"))
            finite_loss = rank_loss["value"][~bad_loss]
            if len(finite_loss):
                measurements.append(Measurement(name="last_finite_loss",
                                                value=float(finite_loss.iloc[-1])))
            thresholds = [Threshold(measurement="nonfinite_loss_steps", comparison=">",
                                    value=0.0, unit="{step}")] if loss_steps > 0 else []
            if grad_bad and scaled:
                thresholds.append(Threshold(
                    measurement="nonfinite_grad_run" if grad_run >= streak
                    else "scale_backoff_streak",
                    comparison=">=", value=float(cfg.scaler_tolerated), unit="{step}"))
            elif grad_bad:
                thresholds.append(Threshold(
                    measurement="nonfinite_grad_norm_steps" if grad_steps > 0
                    else "nonfinite_elements_max", comparison=">", value=0.0))
            changes = [SuggestedChange(knob="checkpoint.restore", value="latest_finite",
                                       expected_effect="weights and optimizer state from "
                                       "before the first non-finite step")]
            rank_lr = _rank_rows(lrs, rank)
            if not rank_lr.empty:
                lr = float(rank_lr["value"].iloc[-1])
                measurements.append(Measurement(name="learning_rate", value=lr))
                changes.append(SuggestedChange(
                    knob="optimizer.lr", value=lr * cfg.lr_cut,
                    expected_effect="smaller updates keep weights and activations finite"))
            changes += [SuggestedChange(knob=f"precision.{c}", value="fp32",
                                        expected_effect=f"{c} no longer overflows its range")
                        for c in view.not_yet(causes, "fp32")]
            resource = dict(rank)
            if causes:
                resource[MODULE_GROUP_ATTR.removeprefix("seedance.")] = ",".join(causes)
            others = sorted(set(bad_groups) - set(causes))
            what = " and ".join(w for w, bad in (("loss", loss_steps > 0),
                                                 ("gradients", grad_bad)) if bad)
            findings.append(Finding(
                detector=self.name, job=window.job, severity="critical", resource=resource,
                evidence=Evidence(
                    summary=(f"{what} turned NaN or infinite"
                             + (f" from step {first:.0f}" if not math.isnan(first) else "")
                             + (f"; starts in module group {' or '.join(causes)} ({how})"
                                if causes else "")
                             + (f"; also non-finite: {', '.join(others)}" if others else "")),
                    model=("non-finite guard: any non-finite loss; non-finite gradient norm "
                           + (f"for {cfg.scaler_tolerated}+ steps in a row (GradScaler present)"
                              if scaled else "at any step (no GradScaler)")),
                    measurements=tuple(measurements), thresholds=tuple(thresholds)),
                suggested_changes=tuple(changes),
            ))
        return findings

    @staticmethod
    def _bad_groups(groups: pd.DataFrame, counts: pd.DataFrame) -> list[str]:
        """Groups whose latest norm is non-finite or latest non-finite element count > 0."""
        bad: set[str] = set()
        for frame, test in ((groups, lambda v: not math.isfinite(v)), (counts, lambda v: v > 0)):
            if frame.empty or MODULE_GROUP_ATTR not in frame.columns:
                continue
            last = frame.groupby(MODULE_GROUP_ATTR).tail(1)
            bad |= {str(g) for g, v in zip(last[MODULE_GROUP_ATTR], last["value"],
                                                    strict=True) if test(v)}
        return sorted(bad)


def _counted_nonfinite(counter: pd.DataFrame) -> dict[str, float]:
    """Non-finite steps the job counted in the window, by what (loss | grad_norm).

    OpenTelemetry drops NaN and infinite gauge values, so the job also counts such steps (it
    adds 0 every step, so each version's series starts at 0): the growth of that counter over
    the window, per series, is the signal; a series' first value counts when the window holds
    its whole life (it starts in the window at a non-zero value only if the first interval
    already went bad).
    """
    if counter.empty or NONFINITE_WHAT not in counter.columns:
        return {}
    grown: dict[str, float] = {}
    for keys, series in by(counter, attribute_columns(counter)):
        series = series.sort_values("time")
        first = float(series["value"].iloc[0])
        growth = increase(series) + (first if len(series) == 1 else 0.0)
        what = keys.get(NONFINITE_WHAT, "")
        grown[what] = grown.get(what, 0.0) + growth
    return grown


def _first_bad_step(loss: pd.DataFrame, bad_loss: np.ndarray, grads: pd.DataFrame,
                    bad_grad: np.ndarray, counts: pd.DataFrame) -> float:
    """The earliest step index any reading shows a non-finite value at (NaN if unknown)."""
    steps = [float(frame["step"][mask].min()) for frame, mask in (
        (loss, bad_loss), (grads, bad_grad),
        (counts, (counts["value"] > 0).to_numpy(dtype=bool) if not counts.empty else None))
        if mask is not None and mask.any()]
    steps = [s for s in steps if not math.isnan(s)]
    return min(steps) if steps else math.nan
