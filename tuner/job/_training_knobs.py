"""The knobs of one training job and the actuators that put them in force.

The session's own knobs come first, each with its actuator: ``precision.<group>`` (one per
group that is not norm layers only: norms compute in fp32 whatever they are given),
``threads`` (when the process may use more than one CPU), the restart-scope ``scheduler.*``
(a training job reads them at its next launch) and ``micro_batch`` (with a global batch). The
job's own knobs follow; they are read through their ``KnobHandle``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from tuner._knobs import SCHEDULER_KNOBS, Knob, KnobSpace
from tuner.job._actuators import Actuator, ActuatorRegistry, HandleActuator, KnobHandle
from tuner.job._errors import ClientError
from tuner.job._torch_actuators import (
    PrecisionActuator,
    ThreadsActuator,
    precision_knobs,
    threads_knob,
)
from tuner.precision import norm_only


class TrainingKnobs:
    """Declared knobs by name, and ``actuators``: which of them puts each one in force."""

    def __init__(self, model: nn.Module, precision_groups: Mapping[str, tuple[str, ...]], *,
                 speedups: Mapping[str, float], grad_scaler: bool, kind: str,
                 per_rank_batch: int | None = None, micro_batch: int | None = None) -> None:
        self._knobs: dict[str, Knob] = {}
        self._handles: dict[str, KnobHandle] = {}  # the job's own knobs and the restart ones
        self.actuators = ActuatorRegistry()
        """What puts each knob in force, by prefix (``tuner.job._actuators``)."""
        self._job_knobs = HandleActuator("", self._handles)
        knobs = precision_knobs((g for g, p in precision_groups.items()
                                 if not norm_only(model, p)), speedups, grad_scaler=grad_scaler)
        self.precision = PrecisionActuator(model, precision_groups, knobs)
        """The precision hooks, which come off when the session closes."""
        self._own(self.precision, knobs)
        threads = threads_knob()
        if threads is not None:
            self._own(ThreadsActuator(threads), [threads])
        self._own(self._job_knobs, SCHEDULER_KNOBS if kind == "train" else ())
        self.micro_batch: KnobHandle | None = None
        """The ``micro_batch`` knob, declared when the job has a global batch."""
        if per_rank_batch is not None:  # the divisors of the batch each rank takes a step on
            sizes = tuple(d for d in range(1, per_rank_batch + 1) if per_rank_batch % d == 0)
            knob = Knob(name="micro_batch", default=micro_batch or per_rank_batch, choices=sizes,
                        description="samples per micro-batch and rank")
            self.micro_batch = KnobHandle(knob)
            self._own(HandleActuator("micro_batch", {"micro_batch": self.micro_batch}), [knob])

    @property
    def space(self) -> KnobSpace:
        """Every declared knob, the session's own first."""
        return KnobSpace.of(self._knobs.values())

    def live(self, name: str) -> bool:
        """Whether a value of ``name`` changes the job now (an undeclared name counts)."""
        knob = self._knobs.get(name)
        return knob is None or knob.scope == "live"

    def declare(self, knob: Knob) -> KnobHandle:
        """A knob of the job's own, read through the handle returned."""
        self._declare(knob, self._job_knobs)
        handle = self._handles[knob.name] = KnobHandle(knob)
        return handle

    def _own(self, actuator: Actuator, knobs: Sequence[Knob]) -> None:
        """Register ``actuator`` for the session's ``knobs`` under its prefix."""
        self.actuators.register(actuator)
        for knob in knobs:
            self._declare(knob, actuator)
            if actuator is self._job_knobs:
                self._handles[knob.name] = KnobHandle(knob)

    def _declare(self, knob: Knob, actuator: Actuator) -> None:
        """``knob``, put in force by ``actuator``: the one that owns its name."""
        if knob.name in self._knobs:
            raise ClientError(f"knob {knob.name} is already declared")
        owner = self.actuators.owner(knob.name)
        if owner is not actuator:
            prefix = owner.prefix if owner is not None else ""
            raise ClientError(f"knob {knob.name}: names under {prefix!r} are the session's "
                              f"own ({type(owner).__name__})")
        self._knobs[knob.name] = knob
