"""What puts a knob's value in force inside the job: one ``Actuator`` per knob prefix.

A session owns an ``ActuatorRegistry``; at a boundary it hands the registry the whole config
and the values in force, and the registry calls each actuator whose knobs changed with all the
knobs under its prefix. A knob belongs to the actuator with the longest prefix that names it
(``precision`` owns ``precision.ffn``); the empty prefix owns every knob no other claims. The
torch actuators (precision, threads) are in ``tuner.job._torch_actuators``; the ones here are
torch-free, so a serving stack that is not PyTorch can use them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from tuner._knobs import Knob, KnobError, KnobSpace, KnobValue


class Actuator(Protocol):
    """Puts the knobs under ``prefix`` in force, between steps, from the job's own thread.

    ``apply`` gets every knob under the prefix, checks them all before it touches anything and
    raises (leaving the state as it was) when one is out of its knob's domain. What ``read``
    returns, handed back to ``apply``, restores the state it read: that is how a session puts
    the previous config back when a new one fails.
    """

    @property
    def prefix(self) -> str:
        """The knobs it owns: this name, and names under it (``prefix.<rest>``); "" for all."""
        ...

    def read(self) -> dict[str, KnobValue]:
        """The values in force now, one per knob it owns."""
        ...

    def apply(self, values: Mapping[str, KnobValue]) -> None:
        """Put ``values`` (every knob it owns) in force; raise and change nothing to refuse."""
        ...


def is_under(prefix: str, name: str) -> bool:
    """Whether the knob ``name`` is under ``prefix`` (the empty prefix is over every knob)."""
    return not prefix or name == prefix or name.startswith(f"{prefix}.")


class ActuatorRegistry:
    """The actuators of one session, by prefix, in the order they apply a config."""

    def __init__(self, actuators: Iterable[Actuator] = ()) -> None:
        self._by_prefix: dict[str, Actuator] = {}
        for actuator in actuators:
            self.register(actuator)

    def register(self, actuator: Actuator) -> None:
        """Add ``actuator``; it applies after those registered before it."""
        if actuator.prefix in self._by_prefix:
            raise KnobError(f"an actuator for prefix {actuator.prefix!r} is registered already")
        self._by_prefix[actuator.prefix] = actuator

    def __iter__(self) -> Iterator[Actuator]:
        return iter(self._by_prefix.values())

    def owner(self, name: str) -> Actuator | None:
        """The actuator of the knob ``name`` (the longest prefix over it); None if none is."""
        prefixes = [p for p in self._by_prefix if is_under(p, name)]
        return self._by_prefix[max(prefixes, key=len)] if prefixes else None

    def apply(self, values: Mapping[str, KnobValue],
              previous: Mapping[str, KnobValue] | None = None) -> None:
        """Hand each actuator its part of ``values`` when a knob of it differs from
        ``previous`` (every actuator, even one with no knob, when ``previous`` is None), in
        registration order; the
        first refusal propagates and the actuators after it are not called."""
        parts: dict[str, dict[str, KnobValue]] = {}
        for name, value in values.items():
            actuator = self.owner(name)
            if actuator is None:
                raise KnobError(f"knob {name}: no actuator owns it")
            parts.setdefault(actuator.prefix, {})[name] = value
        for prefix, actuator in self._by_prefix.items():
            part = parts.get(prefix, {})
            if previous is None or any(previous.get(k) != v for k, v in part.items()):
                actuator.apply(part)


class KnobHandle:
    """A live knob: read ``.value`` each step; it changes only at a step boundary."""

    def __init__(self, knob: Knob) -> None:
        self.knob = knob
        self.value: KnobValue = knob.default

    def __repr__(self) -> str:
        return f"KnobHandle({self.knob.name}={self.value!r})"


class HandleActuator:
    """Knobs the job's own code acts on: it reads each one's ``KnobHandle.value`` per step.

    ``handles`` is shared with the session, which adds a handle per knob the job declares.
    """

    def __init__(self, prefix: str, handles: Mapping[str, KnobHandle]) -> None:
        self._prefix = prefix
        self._handles = handles

    @property
    def prefix(self) -> str:
        """The knobs whose handles it sets."""
        return self._prefix

    def read(self) -> dict[str, KnobValue]:
        """Each handle's value."""
        return {name: handle.value for name, handle in self._handles.items()}

    def apply(self, values: Mapping[str, KnobValue]) -> None:
        """Set the handles; a value outside its knob's domain refuses them all."""
        unknown = sorted(set(values) - set(self._handles))
        if unknown:
            raise KnobError(f"no handle for knob(s) {', '.join(unknown)}")
        checked = {name: self._handles[name].knob.validate(v) for name, v in values.items()}
        for name, value in checked.items():
            self._handles[name].value = value


class CallbackActuator:
    """A job's own ``apply`` callback (a serving engine's ``apply_knobs``), for every knob the
    job declared: the job owns the objects those knobs act on, so the job applies them.

    It is called with the whole config at every apply, changed or not (a serving engine
    restarts its quality sample per version), and it raises to refuse one.
    """

    def __init__(self, knobs: KnobSpace, apply: Callable[[Mapping[str, KnobValue]], None]
                 ) -> None:
        self._knobs = knobs
        self._apply = apply
        self._values = knobs.defaults()  # the job's launch values

    @property
    def prefix(self) -> str:
        """Every knob: the job's config is one piece to its callback."""
        return ""

    def read(self) -> dict[str, KnobValue]:
        """The values last applied (the job's launch values before the first)."""
        return dict(self._values)

    def apply(self, values: Mapping[str, KnobValue]) -> None:
        """The callback on ``values`` completed with the declared defaults; values outside
        their knobs' domain never reach it."""
        checked = self._knobs.validate(values)
        self._apply(checked)
        self._values = checked
