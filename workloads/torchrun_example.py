"""A DDP job under torchrun, tuned live by the sidecar: the multi-rank attach, ready to copy.

    seedancectl sidecar &          # in this folder: it writes the token the job reads here
    torchrun --nproc-per-node 2 -m workloads.torchrun_example --sidecar http://127.0.0.1:4318

Every rank calls ``attach`` once the process group is up. Only rank 0 holds the knob lease
(attach, long poll, acks); at each step boundary it broadcasts the newest config, so every rank
switches at the same step. Every rank exports its own metrics, tagged with its rank, so the
sidecar sees each rank's step time. The live ``micro_batch`` knob sets how many micro-batches
each rank accumulates into its share of the fixed global batch; DDP's ``no_sync`` leaves the
all-reduce to the last one. ``--record DIR`` writes what each rank ran at each step (step,
config version, micro-batch size) to ``DIR/rank<R>.json``.

Ranks must agree on when to stop too: rank 0 decides (``--seconds``) and broadcasts it, since a
rank that left the loop alone would leave the others waiting in a collective.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tuner.job
from workloads.process_group import rank_process_group

GLOBAL_BATCH = 16
WIDTH = 256


def train(*, sidecar: str | None, job: str, steps: int, seconds: float | None,
          record: Path | None) -> None:
    """The training loop of one rank; call it inside the process group."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP checks the shapes only)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH),
                          nn.GELU(), nn.Linear(WIDTH, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = tuner.job.attach(ddp, optimizer, job=job, sidecar=sidecar,
                               global_batch=GLOBAL_BATCH)
    data = torch.Generator().manual_seed(rank)  # each rank its own samples
    ran: list[tuple[int, int, int]] = []  # (step, config version, micro-batch size)
    stop = torch.zeros(1, dtype=torch.int64)
    start = time.monotonic()
    while not stop.item():
        x = torch.randn(GLOBAL_BATCH // world_size, WIDTH, generator=data)
        y = x.mean(dim=1, keepdim=True)
        step = session.steps_done  # the step number the session's switches are logged by
        with session.step(samples=len(x)):
            n = session.micro_batches(GLOBAL_BATCH)  # live knob: the global batch stays fixed
            total = torch.zeros(())
            for i, (xs, ys) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
                sync = ddp.no_sync() if i < n - 1 else contextlib.nullcontext()
                with sync:
                    loss = nn.functional.mse_loss(ddp(xs), ys) / n
                    loss.backward()
                total += loss.detach()
            session.after_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.record_loss(total)
        ran.append((step, session.version, len(x) // n))
        if rank == 0:
            over = (session.steps_done >= steps
                    or (seconds is not None and time.monotonic() - start >= seconds))
            stop.fill_(int(over))
        dist.broadcast(stop, src=0)
    session.close()
    if record is not None:
        Path(record, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "switches": session.switches, "steps": ran}))
    if rank == 0:
        print(f"{job}: {session.steps_done} steps on {world_size} ranks, "
              f"config switches (step, version): {session.switches}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """One torchrun rank: reads torchrun's environment, runs ``train`` in a gloo group."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sidecar", default=None, metavar="URL",
                   help="sidecar base URL (none: train untuned, the session does nothing)")
    p.add_argument("--job", default="torchrun-example", help="the job's name at the sidecar")
    p.add_argument("--steps", type=int, default=10**9, help="stop after this many steps")
    p.add_argument("--seconds", type=float, default=None, help="stop after this wall time")
    p.add_argument("--record", type=Path, default=None, metavar="DIR",
                   help="write each rank's (step, config version, micro-batch) here")
    a = p.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        p.exit(2, "torchrun_example: start it under torchrun (RANK and WORLD_SIZE unset)\n")
    if int(os.environ["WORLD_SIZE"]) > GLOBAL_BATCH:
        p.exit(2, f"torchrun_example: at most {GLOBAL_BATCH} ranks (the global batch)\n")
    torch.set_num_threads(1)  # one core per rank: the ranks share the machine
    with rank_process_group("gloo"):  # torchrun's MASTER_ADDR/PORT, RANK, WORLD_SIZE
        train(sidecar=a.sidecar, job=a.job, steps=a.steps, seconds=a.seconds,
              record=a.record)


if __name__ == "__main__":
    main()
