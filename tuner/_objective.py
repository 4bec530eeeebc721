"""The search's objective: drift-cancelled tokens/s, so trials measured at different times compare.

The objective is the study's reference (the first baseline's measured tokens/s) times the
config's level relative to it, and a candidate's level is its baseline's level times (1 + its
paired gain over that baseline). A kept candidate's level becomes known, so later trials,
measured against it, stay comparable with earlier ones; raw window means are not (a busier box
or a warmer cache moves them all), and a pruner fed raw means prunes on drift.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tuner._change import Change
from tuner._study_records import LEVEL_PREFIX, REFERENCE_ATTR, StudyRecords


class DriftCancelledObjective:
    """A change's objective values; the reference and the known levels live in the study's
    attributes (``records``), each level under the ``key`` of its config."""

    def __init__(self, records: StudyRecords, key: Callable[[Mapping[str, Any]], str]) -> None:
        self._records = records
        self._key = key

    def _baseline_tokens_per_s(self, change: Change) -> float | None:
        measured = [w.tokens_per_s for w in change.windows if w.arm == "baseline"]
        return float(np.mean(measured)) if measured else None

    def anchor(self, change: Change) -> tuple[float, float] | None:
        """(the study's reference tokens/s, the change's baseline level relative to it); None
        before the change measured a baseline window. The first change with one sets the
        reference (its baseline is level 1). A baseline's level is known when it is the first
        baseline or a kept candidate; else (an operator moved it) it is its windows' raw
        ratio to the reference."""
        measured = self._baseline_tokens_per_s(change)
        if measured is None:
            return None
        attrs = self._records.attrs()
        if REFERENCE_ATTR not in attrs:
            self._records.set_attr(REFERENCE_ATTR, measured)
            self.set_level(change.baseline, 1.0)
            return measured, 1.0
        reference = float(attrs[REFERENCE_ATTR])
        level = attrs.get(LEVEL_PREFIX + self._key(change.baseline))
        return reference, float(level) if level is not None else measured / reference

    def candidate(self, change: Change, gain: float,
                  anchor: tuple[float, float] | None = None) -> float | None:
        """Drift-cancelled tokens/s of the candidate; None before a pair was measured."""
        anchor = anchor or self.anchor(change)
        if anchor is None or not math.isfinite(gain):
            return None
        reference, level = anchor
        return reference * level * (1 + gain)

    def set_level(self, values: Mapping[str, Any], level: float) -> None:
        """Record ``values``' level relative to the reference (a kept candidate's is known)."""
        self._records.set_attr(LEVEL_PREFIX + self._key(values), level)
