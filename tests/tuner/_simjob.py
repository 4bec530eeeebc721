"""A SIMULATED training job for rollout tests: it holds a real lease in a real JobRegistry and
writes the points the torch client would (cumulative step-duration histogram, token
counter, loss) into a real
TimeSeriesStore, tagged with the config version it runs. Step times come from a function of
the config, with seeded noise, so tests decide which config is faster."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from collectors._points import CONFIG_VERSION_ATTR, Point
from collectors._store import TimeSeriesStore
from tuner._knobs import Knob
from tuner._lease import JobRegistry

KNOBS = (
    Knob(name="micro_batch", default=8, choices=(1, 2, 4, 8)),
    Knob(name="prefetch", default=2, low=1, high=8, integer=True),
    Knob(name="precision", default="fp32", choices=("fp32", "bf16"), risk="high"),
    Knob(name="precision.ffn", default="fp32", choices=("fp32", "bf16"), risk="high"),
    Knob(name="threads", default=2, low=1, high=4, integer=True, scope="restart"),
)
NS = 1_000_000_000


class SimJob:
    """SIMULATED job; ``run(steps)`` follows the lease, acks, and emits ``steps`` steps."""

    def __init__(self, registry: JobRegistry, store: TimeSeriesStore, *, job: str = "train",
                 step_s: Callable[[Mapping[str, Any]], float],
                 loss: Callable[[Mapping[str, Any], int], float] | None = None,
                 noise: float = 0.02, seed: int = 0, tokens_per_step: int = 512) -> None:
        self.registry, self.store, self.job = registry, store, job
        self.step_s, self.noise, self.tokens_per_step = step_s, noise, tokens_per_step
        self.loss = loss or (lambda values, step: 5.0 * math.exp(-step / 500))
        self.rng = np.random.default_rng(seed)
        self.session, self.config = registry.attach(job, knobs=KNOBS, baseline={})
        self.step = 0
        self.time_ns = time.time_ns() - 3600 * NS  # recent: raw points are kept for days
        self.count: dict[int, int] = {}
        self.total: dict[int, float] = {}
        self.actions: list[dict[str, Any]] = []
        self.action_error: str | None = None
        """Set: every action raises this, as a job with nothing to roll back to would."""
        self.refuse: Callable[[Mapping[str, Any]], str | None] = lambda values: None
        """The error of applying these values (None: they apply)."""

    def run(self, steps: int = 8) -> None:
        lease = self.registry.lease(self.job, self.session, -1, 0.0)
        self.actions += [dict(a) for a in lease.actions]
        ran = [{**a, "status": "failed" if self.action_error else "done",
                "error": self.action_error} for a in lease.actions]
        error = self.refuse(lease.config.values)
        if error is None:
            self.config = lease.config
        self.registry.ack(self.job, self.session, version=lease.config.version, step=self.step,
                          status="applied" if error is None else "failed", error=error,
                          actions=ran)
        version = self.config.version
        attrs = {"service.name": self.job, CONFIG_VERSION_ATTR: str(version)}
        for _ in range(steps):
            wall = self.step_s(self.config.values) * (1 + self.noise * self.rng.standard_normal())
            self.step += 1
            self.time_ns += int(wall * NS)
            self.count[version] = self.count.get(version, 0) + 1
            self.total[version] = self.total.get(version, 0.0) + wall
            self.store.write([
                Point("seedance.train.step.duration.count", float(self.count[version]),
                      self.time_ns, attrs),
                Point("seedance.train.step.duration.sum", self.total[version], self.time_ns,
                      attrs),
                Point("seedance.train.tokens", float(self.tokens_per_step * self.count[version]),
                      self.time_ns, attrs),
                Point("seedance.train.loss", self.loss(self.config.values, self.step),
                      self.time_ns, attrs)])
        self.store.flush()
