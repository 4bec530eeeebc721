"""Non-finite loss or gradients: where a NaN or infinity first appears, and which group it
starts in."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._gradient_parts import (
    NON_FINITE,
    NONFINITE_STEPS,
    NONFINITE_WHAT,
    GroupView,
    RankSplit,
    backoff_streak,
    check_config,
    rank_rows,
)
from policies.detectors._series import increase
from policies.detectors._steps import (
    GRAD_NORM,
    GROUP_NORM,
    LEARNING_RATE,
    LOSS,
    MODULE_GROUP_ATTR,
    NONFINITE,
    RANK_ATTR,
    SCALE,
    attribute_columns,
    by,
    per_step,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class NonFiniteConfig:
    """When non-finite values count.

    A non-finite loss always counts. Without a GradScaler, non-finite gradients count at once
    (a non-finite norm, or ``grad.nonfinite`` elements > 0). With one (``grad_scaler.scale``
    readings present) an overflow is routine (the scaler skips the step and backs off), so they
    count only when the last ``scaler_tolerated`` norm readings in a row are non-finite or the
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
        check_config(self.scaler_tolerated >= 1,
               f"scaler_tolerated must be >= 1, got {self.scaler_tolerated}")
        check_config(0 < self.lr_cut < 1, f"lr_cut must be in (0, 1), got {self.lr_cut}")
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
        return [] if nothing_nonfinite(window) else self.judge(window)

    def judge(self, window: StoreWindow) -> list[Finding]:
        """The findings of ``window``, judged step by step (``evaluate`` skips this when
        :func:`nothing_nonfinite` proves there can be none)."""
        cfg = self.config
        loss = per_step(window, LOSS)
        grads = per_step(window, GRAD_NORM)
        counts = per_step(window, NONFINITE)
        scales = per_step(window, SCALE)
        lrs = per_step(window, LEARNING_RATE)
        counter = window.query(NONFINITE_STEPS)
        ranks = {tuple(sorted(k.items())) for frame in (loss, grads, counts, counter)
                 for k, _ in by(frame, [RANK_ATTR])}
        findings = []
        groups: pd.DataFrame | None = None
        counts_by_rank = RankSplit(counts)
        for rank in (dict(r) for r in sorted(ranks)):
            rank_loss = rank_rows(loss, rank)
            rank_grads = rank_rows(grads, rank)
            rank_counts = counts_by_rank.rows(rank)
            rank_scales = rank_rows(scales, rank)
            bad_loss = ~np.isfinite(rank_loss["value"].to_numpy(dtype=np.float64))
            bad_grad = ~np.isfinite(rank_grads["value"].to_numpy(dtype=np.float64))
            counted = _counted_nonfinite(rank_rows(counter, rank))
            loss_steps = max(float(bad_loss.sum()), counted.get("loss", 0.0))
            grad_steps = max(float(bad_grad.sum()), counted.get("grad_norm", 0.0))
            elements = (rank_counts.groupby("time")["value"].sum() if not rank_counts.empty
                        else pd.Series(dtype="float64"))
            scaled = not rank_scales.empty
            grad_run = _trailing(bad_grad)
            streak = backoff_streak(rank_scales)
            if scaled:
                grad_bad = max(grad_run, streak) >= cfg.scaler_tolerated
            else:
                grad_bad = bool(grad_steps > 0 or (elements > 0).any())
            if not (loss_steps > 0 or grad_bad):
                continue
            if groups is None:  # read only for a bad rank: a job may have thousands of groups
                groups = per_step(window, GROUP_NORM)
            rank_groups = rank_rows(groups, rank)
            bad_groups = self._bad_groups(rank_groups, rank_counts)
            view = GroupView.of(window, rank_groups, cfg.forward_order)
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
            rank_lr = rank_rows(lrs, rank)
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


_READ_BY_CLEAR_CHECK = (LOSS, GRAD_NORM, NONFINITE, NONFINITE_STEPS, SCALE)


def nothing_nonfinite(window: StoreWindow) -> bool:
    """True when no reading in ``window`` could make a finding: every loss and gradient norm
    is finite, no element count is above zero, the non-finite step counter stayed at zero, and
    the loss scale never moved. It reads only bounds on the raw values (the store keeps them
    per chunk; bounds of a superset of the window prove as much), none of the per-step
    pairing: the rollout checks every live trial with this detector each second, and on a
    healthy job the pairing was most of a sidecar's idle CPU.

    The per-step readings are a subset of the raw ones, so a clear raw window has clear steps.
    A scale that changed at all takes the slow path: readings of two config versions at the
    same instant may pair in either order, and only an unchanged scale can never fall.
    """
    if not all(window.value_bounds(name).all_finite() for name in (LOSS, GRAD_NORM)):
        return False
    if window.value_bounds(NONFINITE).high > 0:
        return False
    return window.value_bounds(NONFINITE_STEPS).only(0.0) and window.value_bounds(SCALE).constant()


def latest_nonfinite_reading_ns(window: StoreWindow) -> int | None:
    """The time (ns) of the latest reading in ``window`` that :func:`nothing_nonfinite`
    reads, None when it holds none: where a check that only reads what is new starts. From
    the value bounds it read, so at most ``window.until_ns`` and exact for a window open at
    its end (bounds may cover whole chunks past it)."""
    latest = [t for name in _READ_BY_CLEAR_CHECK
              if (t := window.value_bounds(name).latest_ns) is not None]
    return min(max(latest), window.until_ns) if latest else None


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
