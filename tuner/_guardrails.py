"""Guardrails of training jobs: conditions that roll the change in flight back at once (the
serving ones are in ``tuner.serving_guardrails``)."""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Sequence

from collectors import StoreReader
from policies import Finding, StoreWindow
from policies.detectors import (
    COLLAPSE,
    NON_FINITE,
    UNDERFLOW,
    NonFiniteDetector,
    latest_nonfinite_reading_ns,
    nothing_nonfinite,
)
from tuner._change import Change, Trip
from tuner._version_reader import VersionReader

_END_OF_TIME_NS = 2**63 - 1
_JUDGED_MAX = 64


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
    hysteresis; this judges the same evidence by the same rules as soon as it is stored.

    It runs every rollout tick (each second), and the version's whole life grows with the
    trial: on a job of thousands of module groups that read cost a tenth of a core. So the
    first check of a version reads all of it; later ones read only the readings from
    ``overlap_s`` before the latest one already judged (exports arrive out of order by up to
    an export interval, and the overlap keeps the reading before a new one, so a loss scale
    that moved is seen moving), and every ``full_every``-th check reads the whole life again, so a
    reading that arrives even later is still judged, at most ``full_every`` ticks late. Any
    reading that could make a finding sends the check to the whole life, judged as before.
    """

    def __init__(self, detector: NonFiniteDetector | None = None, *, overlap_s: float = 30.0,
                 full_every: int = 30) -> None:
        if not overlap_s >= 0 or full_every < 1:
            raise ValueError(f"overlap_s must be >= 0 and full_every >= 1, got {overlap_s!r}"
                             f" and {full_every!r}")
        self.detector = detector or NonFiniteDetector()
        self.overlap_ns = int(overlap_s * 1e9)
        self.full_every = full_every
        self._judged: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()
        """(change id, version) -> (latest reading judged clear, checks since a full one)."""

    def check(self, change: Change, version: int, reader: StoreReader) -> Trip | None:
        key = (change.id, version)
        readings = VersionReader(reader, change.job, version)
        judged = self._judged.pop(key, None)
        if judged is not None and judged[1] + 1 < self.full_every:
            latest, checks = judged
            recent = StoreWindow(readings, job=change.job, since_ns=latest - self.overlap_ns,
                                 until_ns=_END_OF_TIME_NS)
            if nothing_nonfinite(recent):
                self._remember(key, max(latest, latest_nonfinite_reading_ns(recent) or latest),
                               checks + 1)
                return None
        window = StoreWindow(readings, job=change.job, since_ns=0, until_ns=_END_OF_TIME_NS)
        for finding in self.detector.evaluate(window):
            what = "loss" if finding.evidence.value("nonfinite_loss_steps") > 0 else "gradients"
            return Trip(kind="full", reason=(f"non-finite {what} under config v{version}: "
                                             f"{finding.evidence.summary}"))
        judged_until = latest_nonfinite_reading_ns(window)
        if judged_until is not None:
            self._remember(key, judged_until, 0)
        return None

    def _remember(self, key: tuple[str, int], latest: int, checks: int) -> None:
        self._judged[key] = (latest, checks)
        while len(self._judged) > _JUDGED_MAX:  # changes long finished
            self._judged.popitem(last=False)


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


