"""A map that forgets what was not used for a while, for per-series state.

Each config version of a tuned job starts new series, so anything kept per series for as long
as the sidecar runs grows with the number of trials. State that is only worth keeping for
series still arriving lives here instead: entries sit in a current and a previous generation;
every ``idle_s`` the previous generation is dropped and the current one becomes it, and a read
from the previous one moves the entry back to the current. An entry unused for ``idle_s`` to
``2 * idle_s`` is gone; one used at least once per ``idle_s`` stays for good. No per-entry
timestamps: a hit costs one dict lookup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class GenerationalMap(Generic[K, V]):
    """No lock of its own. The limiter holds its lock around it; the store writer's caches
    need none, as their values follow from the key: a race at most recomputes one."""

    def __init__(self, idle_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.idle_s = idle_s
        self._clock = clock
        self._current: dict[K, V] = {}
        self._previous: dict[K, V] = {}
        self._rotated_at = clock()
        self.generation = 0
        """Counts rotations and clears: while it stays the same, no entry read or written since
        has gone, so a caller that saw a set of keys present may skip looking them up again."""

    def get(self, key: K) -> V | None:
        found = self._current.get(key)
        if found is None:
            found = self._previous.pop(key, None)
            if found is not None:
                self._current[key] = found
        return found

    def __setitem__(self, key: K, value: V) -> None:
        self._previous.pop(key, None)
        self._current[key] = value

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def clear(self) -> None:
        self.generation += 1
        self._current.clear()
        self._previous.clear()

    def expire(self) -> dict[K, V]:
        """Rotate once ``idle_s`` has passed since the last rotation; return what was dropped
        (entries unused for a whole generation), empty when it was not yet time."""
        now = self._clock()
        if now - self._rotated_at < self.idle_s:
            return {}
        self.generation += 1
        dropped, self._previous, self._current = self._previous, self._current, {}
        if now - self._rotated_at >= 2 * self.idle_s:  # idle past both generations: all go
            dropped.update(self._previous)
            self._previous = {}
        self._rotated_at = now
        return dropped
