"""Routing requests across serving replicas: static round-robin or the seed's load-aware rule.

Load-aware redistribution (seed 2.3) moves routing weight from the more loaded replica to the
less loaded one when their backlogs (in seconds) differ enough and the pair's cooldown has
expired; requests go to replicas by smooth weighted round-robin (nginx's). Torch-free; not
thread-safe (the launcher's dispatch loop owns a router).

docs/internals.md, 'Routing' gives the formula, its units and the sharding knob.
"""

from __future__ import annotations

import abc
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from collectors import SeedanceError
from tuner._knobs import Knob

__all__ = ["ROUTING_KNOBS", "SHARDING_KNOB", "LoadAwareConfig", "LoadAwareRouter", "Move",
           "RoundRobinRouter", "Router"]

ROUTING_KNOBS: tuple[Knob, ...] = (
    Knob(name="routing.policy", default="round_robin", choices=("round_robin", "load_aware"),
         description="Static round-robin, or move weight from loaded replicas (seed 2.3)"),
    Knob(name="routing.alpha", default=0.82, low=0.01, high=1.0,
         description="Fraction of min(Cap_i, Cap_j) a saturated load difference moves"),
    Knob(name="routing.tau_s", default=45.0, low=0.05, high=600.0, log=True,
         description="Backlog scale (s) of the move and the pair cooldown (s)"),
    Knob(name="routing.threshold", default=0.15, low=0.0, high=1.0,
         description="Least load difference, as a fraction of the highest load, that moves"),
)

SHARDING_KNOB = Knob(
    name="serving.sharding", default="static", choices=("static", "autoscale"),
    scope="restart", risk="high",
    description="Static shards (one per device, memory pre-allocated; seed 2.4) or "
    "autoscaling replicas; changing it restarts the job")


class Router(abc.ABC):
    """Picks the replica for each request; told the replicas' loads as they change."""

    @abc.abstractmethod
    def route(self) -> int:
        """The replica index for the next request."""

    def observe(self, loads_s: Sequence[float]) -> None:  # noqa: B027 - optional for a router
        """The replicas' backlogs now (seconds); a static router ignores them."""

    @property
    @abc.abstractmethod
    def weights(self) -> tuple[float, ...]:
        """Traffic shares now (sum 1)."""


class RoundRobinRouter(Router):
    """The static baseline: replicas in turn, whatever their loads."""

    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise SeedanceError(f"replicas must be >= 1, got {replicas}")
        self._next = itertools.cycle(range(replicas))
        self._n = replicas

    def route(self) -> int:
        """The next replica in turn."""
        return next(self._next)

    @property
    def weights(self) -> tuple[float, ...]:
        """Equal shares, always."""
        return (1.0 / self._n,) * self._n


@dataclass(frozen=True, kw_only=True)
class LoadAwareConfig:
    """The rule's constants (defaults: the seed's); ``capacities`` None means equal."""

    alpha: float = 0.82
    tau_s: float = 45.0
    threshold: float = 0.15
    min_weight: float = 0.02
    capacities: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise SeedanceError(f"LoadAwareConfig.alpha must be in (0, 1], got {self.alpha}")
        if not self.tau_s > 0:
            raise SeedanceError(f"LoadAwareConfig.tau_s must be > 0, got {self.tau_s}")
        if not 0 <= self.threshold <= 1:
            raise SeedanceError(
                f"LoadAwareConfig.threshold must be in [0, 1], got {self.threshold}")
        if not 0 <= self.min_weight < 1:
            raise SeedanceError(
                f"LoadAwareConfig.min_weight must be in [0, 1), got {self.min_weight}")
        if self.capacities is not None and (not self.capacities
                                            or any(c <= 0 for c in self.capacities)):
            raise SeedanceError("LoadAwareConfig.capacities must be positive")


@dataclass(frozen=True, kw_only=True)
class Move:
    """One redistribution: ``weight`` moved from replica ``src`` to ``dst`` at ``at_s``."""

    at_s: float
    src: int
    dst: int
    load_diff_s: float
    weight: float


@dataclass(slots=True)
class _State:
    weights: list[float]
    credit: list[float]
    cooldown_until_s: dict[tuple[int, int], float] = field(default_factory=dict)


class LoadAwareRouter(Router):
    """The seed's load-aware redistribution over smooth weighted round-robin."""

    def __init__(self, replicas: int, config: LoadAwareConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config = config or LoadAwareConfig()
        if replicas < 1:
            raise SeedanceError(f"replicas must be >= 1, got {replicas}")
        caps = config.capacities or (1.0,) * replicas
        if len(caps) != replicas:
            raise SeedanceError(f"{len(caps)} capacities for {replicas} replicas")
        if config.min_weight * replicas >= 1:
            raise SeedanceError(f"min_weight {config.min_weight} leaves nothing to move "
                                f"across {replicas} replicas")
        total = sum(caps)
        self.capacities = tuple(c / total for c in caps)
        self.config = config
        self._clock = clock
        self._state = _State(weights=list(self.capacities), credit=[0.0] * replicas)
        self.moves: list[Move] = []

    @property
    def weights(self) -> tuple[float, ...]:
        """The current shares; they start at the capacities and change only in ``observe``."""
        return tuple(self._state.weights)

    def route(self) -> int:
        """Smooth weighted round-robin: every replica gains its weight, the richest is picked
        and pays 1."""
        credit = self._state.credit
        for i, w in enumerate(self._state.weights):
            credit[i] += w
        pick = max(range(len(credit)), key=credit.__getitem__)
        credit[pick] -= 1.0
        return pick

    def observe(self, loads_s: Sequence[float]) -> None:
        """Apply the rule to every pair, most different pair first; returns nothing, records
        each move in ``moves``."""
        st, cfg = self._state, self.config
        if len(loads_s) != len(st.weights):
            raise SeedanceError(f"{len(loads_s)} loads for {len(st.weights)} replicas")
        peak = max(loads_s)
        if not peak > 0:
            return
        now = self._clock()
        pairs = sorted(itertools.combinations(range(len(loads_s)), 2),
                       key=lambda p: -abs(loads_s[p[0]] - loads_s[p[1]]))
        for i, j in pairs:
            diff = abs(loads_s[i] - loads_s[j])
            if diff < cfg.threshold * peak or st.cooldown_until_s.get((i, j), -math.inf) > now:
                continue
            src, dst = (i, j) if loads_s[i] > loads_s[j] else (j, i)
            wanted = (min(self.capacities[i], self.capacities[j]) * cfg.alpha
                      * (1.0 - math.exp(-diff / cfg.tau_s)))
            moved = min(wanted, st.weights[src] - cfg.min_weight)
            if moved <= 0:
                continue
            st.weights[src] -= moved
            st.weights[dst] += moved
            st.cooldown_until_s[(i, j)] = now + cfg.tau_s
            self.moves.append(Move(at_s=now, src=src, dst=dst, load_diff_s=diff, weight=moved))
