"""A name the user typed that the data does not hold (a job, a metric, an attribute value):
one line that says so and offers the near matches, instead of an empty answer that looks like
"nothing happened"."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from collectors import SeedanceError

_NEAR = 3
_LISTED = 8


class UnknownNameError(SeedanceError):
    """The name is not among those known; the message lists the nearest ones."""


def check_known(kind: str, name: str, known: Iterable[str], *, where: str) -> None:
    """Raise UnknownNameError unless ``name`` is in ``known``; ``where`` names the source
    (a store file, a state database, a sidecar's URL)."""
    names = sorted(set(known))
    if name in names:
        return
    near = difflib.get_close_matches(name, names, n=_NEAR)
    if near:
        hint = f"did you mean {' or '.join(repr(n) for n in near)}?"
    elif names:
        more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
        hint = f"known: {', '.join(names[:_LISTED])}{more}"
    else:
        hint = f"{where} holds none yet"
    raise UnknownNameError(f"unknown {kind} {name!r} in {where}; {hint}")
