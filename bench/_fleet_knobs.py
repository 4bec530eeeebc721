"""The simulated fleet job's knobs, and one timed step of a search on them, in a module without
torch: the bench's reader and prober processes import them, and torch's objects there would add
garbage-collector pauses to the latencies they time."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from tuner import Knob, KnobSpace, SearchDriver

KNOBS = (
    Knob(name="sim.batch", default=2, choices=(1, 2, 4, 8)),
    Knob(name="sim.prefetch", default=1, low=1, high=4, integer=True),
    Knob(name="sim.fuse", default="off", choices=("off", "on")),
)


def timed_step(search: SearchDriver, baseline: Mapping[str, Any], space: KnobSpace,
               rng: np.random.Generator) -> tuple[dict[str, Any] | None, float, float]:
    """A sidecar's search step: ``next_move`` from ``baseline``, then ``tell`` (a random
    value); a kept move (one in three) becomes the baseline. Returns the next baseline (None:
    every move was tried, start a new study) and the two calls' milliseconds."""
    t0 = time.perf_counter()
    proposal = search.next_move(baseline, space)
    t1 = time.perf_counter()
    if proposal is None:
        return None, (t1 - t0) * 1000, 0.0
    search.tell(proposal.number, float(rng.random()))
    t2 = time.perf_counter()
    kept = rng.random() < 1 / 3
    return (dict(proposal.values) if kept else dict(baseline)), (t1 - t0) * 1000, (t2 - t1) * 1000
