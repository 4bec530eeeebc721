"""A real 2-rank gloo DDP job on CPU whose telemetry lands in a store the detectors read.

Each rank sets up telemetry the way a job does (``collectors._otel.setup_telemetry`` with a
store sink: the SDK's data goes through the OTLP encoder and the receiver's decoder), times its
steps with ``TrainingInstrumentation`` and its all-reduce buckets with
``collectors.torch_collective``, and flushes after every step so each step is one export
interval. Nothing is simulated except the optional ``sleep_s`` one rank adds inside its step
(the slow rank).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from collectors import Point
from tests.rendezvous import file_rendezvous

WORLD_SIZE = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """One job the two ranks run: its name, DDP bucket cap, steps and an optional slow rank."""

    job: str
    bucket_cap_mb: float = 25.0
    steps: int = 10
    slow_rank: int | None = None
    sleep_s: float = 0.0


def _rank(rank: int, out_dir: str, phases: list[Phase]) -> None:
    import torch

    from workloads.process_group import rank_process_group

    torch.set_num_threads(1)
    points: list[Point] = []
    with rank_process_group("gloo", rank=rank, world_size=WORLD_SIZE,
                            init_method=file_rendezvous(out_dir)):
        for phase in phases:
            _run_phase(rank, phase, points)
        rows = [{"name": p.name, "value": p.value, "time_ns": p.time_ns,
                 "attributes": dict(p.attributes)} for p in points]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))


def _run_phase(rank: int, phase: Phase, points: list[Point]) -> None:
    import torch

    from collectors._otel import TelemetryConfig, setup_telemetry
    from collectors.torch_collective import CollectiveTimer, install
    from collectors.torch_training import TrainingInstrumentation

    telemetry = setup_telemetry(
        TelemetryConfig(job=phase.job, rank=rank, host="ddp-test", export_interval_s=3600),
        store_sink=lambda decoded: points.extend(decoded.points))
    try:
        torch.manual_seed(0)
        layers = [m for _ in range(16) for m in (torch.nn.Linear(128, 128), torch.nn.ReLU())]
        model = torch.nn.Sequential(*layers)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=phase.bucket_cap_mb)
        meter = telemetry.meter("ddp-test")
        timer = CollectiveTimer(meter, world_size=WORLD_SIZE, backend="gloo", config_version=1)
        install(ddp, timer)
        optimiser = torch.optim.SGD(ddp.parameters(), lr=0.01)
        instr = TrainingInstrumentation(model, optimiser, meter, config_version=1)
        for step in range(phase.steps):
            batch = torch.randn(256, 128, generator=torch.Generator().manual_seed(step))
            with instr.step(samples=256):
                if rank == phase.slow_rank:
                    time.sleep(phase.sleep_s)
                loss = ddp(batch).square().mean()
                loss.backward()
                instr.record_loss(loss)
                optimiser.step()
                optimiser.zero_grad()
            timer.last_step_stats()  # settles the step's buckets before the export
            telemetry.force_flush()
    finally:
        telemetry.shutdown()


def run_ddp_jobs(phases: list[Phase]) -> list[Point]:
    """Run the phases one after another in one pair of processes; every point both exported."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(out_dir, phases), nprocs=WORLD_SIZE, join=True)
        rows = [r for rank in range(WORLD_SIZE)
                for r in json.loads(Path(out_dir, f"rank{rank}.json").read_text())]
    return [Point(r["name"], r["value"], r["time_ns"], r["attributes"]) for r in rows]
