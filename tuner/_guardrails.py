"""Guardrails of training jobs: conditions that roll the change in flight back at once (the
serving ones are in ``tuner.serving_guardrails``)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

from collectors import StoreReader
from policies import Finding, StoreWindow
from policies.detectors import COLLAPSE, NON_FINITE, UNDERFLOW, NonFiniteDetector
from tuner._change import Change, Trip
from tuner._version_reader import VersionReader

_END_OF_TIME_NS = 2**63 - 1


class Guardrail(abc.ABC):
    """A condition that forces an immediate rollback of the change in flight.

    ``check`` is called from ``tick()`` (one thread) with the version in force; it must not
    block for long and returns None when all is well.
    """

    @abc.abstractmethod
    def check(self, change: Change, version: int, reader: StoreReader) -> Trip | None: ...


class NonFiniteValues(Guardrail):
    """The non-finite detector on what the job emitted under the version in force: a NaN or
    infinite loss, or gradients it counts as non-finite, roll back at once (FULL: the optimizer
    may have stepped on them). The engine's finding of the same comes later, after its
    hysteresis; this judges the same evidence by the same rules as soon as it is stored."""

    def __init__(self, detector: NonFiniteDetector | None = None) -> None:
        self.detector = detector or NonFiniteDetector()

    def check(self, change: Change, version: int, reader: StoreReader) -> Trip | None:
        window = StoreWindow(VersionReader(reader, change.job, version), job=change.job,
                             since_ns=0, until_ns=_END_OF_TIME_NS)
        for finding in self.detector.evaluate(window):
            what = "loss" if finding.evidence.value("nonfinite_loss_steps") > 0 else "gradients"
            return Trip(kind="full", reason=(f"non-finite {what} under config v{version}: "
                                             f"{finding.evidence.summary}"))
        return None


class GradientCollapseFindings(Guardrail):
    """A gradient-collapse, underflow or non-finite finding on the job, opened since the change
    began: LOCAL rollback of the finding's ``module_group`` (FULL when it names none, and always
    for non-finite gradients: the optimizer may have stepped on them everywhere)."""

    def __init__(self, active_findings: Callable[[], Sequence[Finding]], *,
                 detectors: Sequence[str] = (COLLAPSE, UNDERFLOW, NON_FINITE)) -> None:
        self._active = active_findings
        self.detectors = frozenset(detectors)

    def check(self, change: Change, version: int, reader: StoreReader) -> Trip | None:
        since_ns = int(change.plan.get("applied_at_s", change.created_at_s) * 1e9)
        for f in self._active():
            if (f.job == change.job and f.detector in self.detectors
                    and (f.opened_at_ns or 0) >= since_ns):
                group = None if f.detector == NON_FINITE else f.resource.get("module_group")
                return Trip(kind="local" if group else "full", group=group,
                            reason=f"{f.detector} finding {f.id}: {f.evidence.summary}")
        return None


