"""A SIMULATED training job for bench/fleet.py: the real lease client and the real training
instrumentation, around a step whose time is a function of the config (a sleep), so a fleet of
them costs the box almost nothing but what the sidecars do.

Rank 0 attaches with three low-risk knobs and follows its lease at every step boundary (applies
the newest config, acks it); every point it exports carries the config version in force. Each of
``--ranks`` ranks also exports ``--series`` gauge series (per-module gradient norms of a large
model: ``seedance.train.grad.group_norm`` with a ``seedance.module.group`` attribute), so the
sidecar holds ranks x series live series as a real job of that size would make it.

A rollback's actions (restore a checkpoint) are acked done: a SIMULATED model has no state.

Run (by bench/fleet.py): python bench/_fleet_job.py --sidecar URL --job NAME [--ranks 8]
"""

from __future__ import annotations

import argparse
import math
import random
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from _fleet_knobs import KNOBS  # bench/, this script's folder
from opentelemetry.metrics import CallbackOptions, Observation
from torch import nn

from collectors import TelemetryConfig, setup_telemetry
from collectors.names import ATTR_SEEDANCE_RANK
from collectors.torch_training import TrainingInstrumentation
from tuner.job._lease_client import LeaseClient

BASE_STEP_S = 0.05
TOKENS_PER_STEP = 4096


def step_seconds(values: Mapping[str, Any], rng: random.Random) -> float:
    """SIMULATED: bigger batches and fusion help, prefetch helps up to 2; 2% noise."""
    speed = {1: 0.8, 2: 1.0, 4: 1.15, 8: 1.2}[int(values["sim.batch"])]
    speed *= 1.0 + 0.08 * min(int(values["sim.prefetch"]), 2)
    speed *= 1.1 if values["sim.fuse"] == "on" else 1.0
    return BASE_STEP_S / speed * (1.0 + 0.02 * rng.gauss(0.0, 1.0))


def filler(ranks: int, series: int) -> Any:
    """The gauge callback of ranks x series module-group norms (healthy, slowly varying)."""
    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        wobble = 1.0 + 0.01 * math.sin(time.time() / 30.0)
        for rank in range(ranks):
            for i in range(series):
                yield Observation(wobble, {ATTR_SEEDANCE_RANK: rank,
                                           "seedance.module.group": f"block{i}"})
    return observe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sidecar", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--series", type=int, default=500)
    parser.add_argument("--export-interval-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    telemetry = setup_telemetry(TelemetryConfig(
        job=args.job, otlp_endpoint=args.sidecar, export_interval_s=args.export_interval_s))
    meter = telemetry.meter("bench.fleet_job")
    meter.create_observable_gauge("seedance.train.grad.group_norm",
                                  callbacks=[filler(args.ranks, args.series)])
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    version = 0
    instr = TrainingInstrumentation(model, optimizer, meter, config_version=lambda: version,
                                    attributes={ATTR_SEEDANCE_RANK: 0})
    lease = LeaseClient(args.sidecar, job=args.job, kind="train", world_size=args.ranks,
                        lease_ttl_s=None, applied_version=lambda: version, token=args.token)
    values = {k.name: k.default for k in KNOBS}
    lease.start(KNOBS, values)
    seq = instr_steps = 0
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    while not stop.is_set():
        update = lease.poll()
        if update is not None and update.seq != seq:
            seq = update.seq
            values = dict(update.config.values)
            version = update.config.version
            done = [{**a, "status": "done", "error": None} for a in update.actions]
            lease.ack(update, {"version": version, "step": instr_steps, "status": "applied",
                               "error": None, "actions": done})
        instr_steps += 1
        with instr.step(tokens=TOKENS_PER_STEP, samples=8):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            instr.after_backward()
            optimizer.step()
            optimizer.zero_grad()
            instr.record_loss(loss)
            time.sleep(step_seconds(values, rng))
    lease.shutdown()
    telemetry.shutdown()


if __name__ == "__main__":
    main()
