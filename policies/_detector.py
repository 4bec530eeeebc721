"""The plug-in point for detection: a detector reads one window and returns findings."""

from __future__ import annotations

from abc import ABC, abstractmethod

from policies._findings import Finding
from policies._window import StoreWindow


class Detector(ABC):
    """Decides what is wrong with one job over one window of telemetry.

    Contract:
    - ``name`` is unique among the engine's detectors and stable across runs (findings and
      hysteresis are keyed by it).
    - :meth:`evaluate` is pure: it only reads ``window`` (queries bound to one job and one time
      range) and returns findings; no side effects, no I/O besides the window, no state that
      changes its answer for the same window. Hysteresis, ids, times, dedup and persistence are
      the engine's job, so it returns findings with ``id`` empty and no times.
    - It returns one finding per resource it judges bad (``detector`` = its name, ``job`` =
      ``window.job``); a resource it does not return counts as clean for this evaluation.
    - Too little data is not a finding: return nothing. An exception is a bug: the engine logs
      it and leaves that detector's hysteresis counts for the job untouched.
    - It may be called from the engine's thread; it must not block beyond its queries.
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """The detector's stable, unique name (``"bandwidth_saturation"``)."""

    @abstractmethod
    def evaluate(self, window: StoreWindow) -> list[Finding]:
        """The findings this window shows (empty when all is well or data is missing)."""
