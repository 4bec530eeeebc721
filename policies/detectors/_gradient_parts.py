"""What the gradient detectors share: their names, the series they read, and how a fault is
traced to the module group where it starts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import ConfigError
from collectors.names import ATTR_SEEDANCE_NONFINITE_WHAT, TRAIN_NONFINITE_STEPS
from policies._window import StoreWindow
from policies.detectors._model_view import forward_order, single_precisions
from policies.detectors._steps import (
    MODULE_GROUP_ATTR,
    PRECISION_ATTR,
    RANK_ATTR,
    REDUCED_PRECISIONS,
)

COLLAPSE = "gradient_collapse"
UNDERFLOW = "gradient_underflow"
NON_FINITE = "non_finite"
"""The gradient detectors' names, which the tuner's guardrail watches."""
NONFINITE_STEPS = TRAIN_NONFINITE_STEPS
NONFINITE_WHAT = ATTR_SEEDANCE_NONFINITE_WHAT


def check_config(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)



def value_at(rows: pd.DataFrame, column: str, i: int) -> str:
    return str(rows[column].iloc[i]) if column in rows.columns else ""



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


def latest_values(frame: pd.DataFrame, column: str) -> dict[str, str]:
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
                   knobs=latest_values(rows, PRECISION_ATTR), observed=single_precisions(window))

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


def backoff_streak(scale: pd.DataFrame) -> int:
    """Trailing readings in a row where the loss scale fell."""
    values = scale["value"].to_numpy(dtype=np.float64)
    streak = 0
    for i in range(values.size - 1, 0, -1):
        if not values[i] < values[i - 1]:
            break
        streak += 1
    return streak


def rank_rows(frame: pd.DataFrame, rank: dict[str, str]) -> pd.DataFrame:
    if frame.empty:
        return frame
    keep = np.ones(len(frame), dtype=bool)
    for column, value in rank.items():
        if column in frame.columns:
            keep &= (frame[column] == value).to_numpy(dtype=bool)
    return frame[keep].reset_index(drop=True)


class RankSplit:
    """A frame's rows of each rank, split once: ``rank_rows`` on a frame of thousands of
    series (one per module group) compared every row's rank text once per rank."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self._frame = frame
        self._rows: dict[object, np.ndarray] | None = (
            dict(frame.groupby(RANK_ATTR, sort=False).indices)
            if not frame.empty and RANK_ATTR in frame.columns else None)

    def rows(self, rank: dict[str, str]) -> pd.DataFrame:
        """What ``rank_rows(frame, rank)`` returns."""
        if self._rows is None or set(rank) != {RANK_ATTR}:
            return rank_rows(self._frame, rank)
        index = self._rows.get(rank[RANK_ATTR])
        return (self._frame.iloc[index] if index is not None
                else self._frame.iloc[:0]).reset_index(drop=True)


