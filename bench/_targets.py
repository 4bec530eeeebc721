"""One way for every bench to say what it aimed at and whether it got there (issue #16 item 5).

Each bench states its targets as ``Target`` values computed by a pure ``targets(result)``
function from the figures it measured; ``block`` turns them into the results JSON's uniform
keys: ``"targets": {name: {"target", "measured", "met", "source", ...}}`` and ``"met"`` (all
met). Because the function only reads the recorded figures, ``bench/refresh_targets.py`` can
re-judge a committed results file with the same code the bench runs when it writes one.

A numeric target carries its comparison in ``op``; a condition in words has none and the bench
decides ``met``. A figure that was not measured (``None``) never meets a numeric target.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """A target, where it comes from, what was measured and whether it was met."""

    name: str
    target: float | str
    measured: Any
    met: bool
    source: str
    op: str | None = None
    note: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The entry under ``targets[name]``; ``op`` and ``note`` only where they apply."""
        out: dict[str, Any] = {"target": self.target}
        if self.op is not None:
            out["op"] = self.op
        out |= {"measured": self.measured, "met": self.met, "source": self.source}
        if self.note is not None:
            out["note"] = self.note
        return out


def at_most(name: str, limit: float, measured: float | None, source: str,
            note: str | None = None) -> Target:
    """A ceiling: met when the figure was measured and is at most ``limit``."""
    return Target(name, limit, measured, measured is not None and measured <= limit, source,
                  "<=", note)


def at_least(name: str, floor: float, measured: float | None, source: str,
             note: str | None = None) -> Target:
    """A floor: met when the figure was measured and is at least ``floor``."""
    return Target(name, floor, measured, measured is not None and measured >= floor, source,
                  ">=", note)


def holds(name: str, condition: str, measured: Any, met: bool, source: str,
          note: str | None = None) -> Target:
    """A condition in words (e.g. "no finding"), judged by the bench that measured it."""
    return Target(name, condition, measured, bool(met), source, None, note)


def block(targets: Iterable[Target]) -> dict[str, Any]:
    """The uniform keys: every target by name, and ``met`` when there is one and all are met."""
    entries = {t.name: t.as_json() for t in targets}
    if not entries:
        raise ValueError("a bench with no target says why with no_target(), not an empty block")
    return {"targets": entries, "met": all(e["met"] for e in entries.values())}


def no_target(because: str) -> dict[str, Any]:
    """For a file that is input data rather than a result: no target, and why."""
    return {"targets": {}, "no_target_because": because}


def judged(result: Mapping[str, Any], targets: Iterable[Target]) -> dict[str, Any]:
    """``result`` with its uniform targets block (replacing any earlier one), for writing."""
    return {**result, **block(targets)}
