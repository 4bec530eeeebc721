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


class SelfCheck(ABC):
    """A condition of the sidecar itself (its store cannot write, a rollback failed), reported
    as findings so the operator sees it where every other finding is.

    Unlike a detector it reads no window: it reports what its owner knows now, with no
    hysteresis (a fact, not a noisy signal): a finding opens on the first pass that returns it
    and closes on the first that does not. Findings name ``detector`` = ``name``.
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """Stable and unique among the engine's detectors and self checks."""

    @abstractmethod
    def findings(self) -> list[Finding]:
        """The conditions that hold now (empty when all is well)."""
