"""The simulated fleet job's knobs, in a module without torch: the bench's reader and prober
processes import them, and torch's objects there would add garbage-collector pauses to the
latencies they time."""

from __future__ import annotations

from tuner import Knob

KNOBS = (
    Knob(name="sim.batch", default=2, choices=(1, 2, 4, 8)),
    Knob(name="sim.prefetch", default=1, low=1, high=4, integer=True),
    Knob(name="sim.fuse", default="off", choices=("off", "on")),
)
