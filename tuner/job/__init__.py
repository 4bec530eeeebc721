"""The in-job side of the tuner: a session holds the job's knob lease and its actuators.

Imported by the job, never by the sidecar. A training job (any ``nn.Module`` and
``torch.optim`` optimizer) attaches a ``Session``::

    session = tuner.job.attach(model, optimizer, job="gpt", sidecar="http://127.0.0.1:4318",
                               global_batch=32)
    warmup = session.knob("warmup_steps", 100, low=0, high=1000, integer=True)
    for x, y in loader:                                   # x: one global batch (this rank's part)
        with session.step(tokens=x.numel(), samples=len(x)):
            n = session.micro_batches(32)                 # live micro_batch knob, global batch fixed
            for xs, ys in zip(x.chunk(n), y.chunk(n)):
                (model(xs, ys) / n).backward()
            session.after_backward()
            optimizer.step(); optimizer.zero_grad()
    session.close()

A serving job attaches a ``ServeSession`` (``attach_serving``) with its own ``apply`` callback;
it imports without torch. docs/lease-protocol.md, 'The in-job package' says more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collectors import lazy_exports

if TYPE_CHECKING:
    from tuner.job._actuators import Actuator as Actuator
    from tuner.job._actuators import ActuatorRegistry as ActuatorRegistry
    from tuner.job._actuators import CallbackActuator as CallbackActuator
    from tuner.job._actuators import HandleActuator as HandleActuator
    from tuner.job._actuators import KnobHandle as KnobHandle
    from tuner.job._errors import ClientError as ClientError
    from tuner.job._errors import ConfigRefusedError as ConfigRefusedError
    from tuner.job._errors import ServeClientError as ServeClientError
    from tuner.job._serve_session import KV_BITS_CHOICES as KV_BITS_CHOICES
    from tuner.job._serve_session import KV_BITS_KNOBS as KV_BITS_KNOBS
    from tuner.job._serve_session import NO_STATE as NO_STATE
    from tuner.job._serve_session import SERVING_KNOBS as SERVING_KNOBS
    from tuner.job._serve_session import ServeSession as ServeSession
    from tuner.job._serve_session import attach_serving as attach_serving
    from tuner.job._serve_session import available_memory_mib as available_memory_mib
    from tuner.job._session import Session as Session
    from tuner.job._session import attach as attach
    from tuner.job._torch_actuators import PRECISION_CHOICES as PRECISION_CHOICES
    from tuner.job._torch_actuators import PrecisionActuator as PrecisionActuator
    from tuner.job._torch_actuators import ThreadsActuator as ThreadsActuator
    from tuner.job._torch_actuators import default_precision_groups as default_precision_groups

if not TYPE_CHECKING:  # a __getattr__ that mypy saw would type every misspelt name as Any
    __all__, __getattr__, __dir__ = lazy_exports(globals())
