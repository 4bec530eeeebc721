"""How often a two-rank gloo job's rank aborts at exit: a normal interpreter exit after
``destroy_process_group`` against ``workloads.process_group.rank_process_group``.

Each run spawns two gloo ranks on CPU that train a small DDP model for a few steps, then end
one way or the other; the arms alternate run by run (A/B interleaved). ``--load`` busy processes
stand in for a loaded CI box (the abort showed up there, in the full test suite). Writes
bench/results/gloo_exit.json.

    python bench/gloo_exit.py --runs 25 --load 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._targets import Target, holds, judged  # noqa: E402
from tests.rendezvous import file_rendezvous  # noqa: E402
from workloads.process_group import rank_process_group  # noqa: E402

RESULT = Path(__file__).parent / "results" / "gloo_exit.json"
ARMS = ("normal_exit", "rank_process_group")


def _train(steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 16)).square().mean().backward()
        optimiser.step()
        optimiser.zero_grad()
        stop = torch.zeros(1)
        dist.all_reduce(stop)


def _rank(rank: int, arm: str, out: str, steps: int) -> None:
    torch.set_num_threads(1)
    init = {"rank": rank, "world_size": 2, "init_method": file_rendezvous(out)}
    if arm == "rank_process_group":
        with rank_process_group("gloo", **init):
            _train(steps)
        return
    dist.init_process_group("gloo", **init)
    try:
        _train(steps)
    finally:
        dist.destroy_process_group()


def targets(result: dict) -> list[Target]:
    """The fix's arm never aborts; the normal exit is the control and has no target.

    No issue states a number; the fix (issue #4's closing note) rests on the rank never
    reaching gloo's teardown, so any abort in that arm is a miss.
    """
    aborted = result["aborted_runs"]["rank_process_group"]
    return [holds("aborted runs with rank_process_group", "0", aborted, aborted == 0,
                  "issue #4 closing note (the rank never reaches the code that aborted)")]


def _busy() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=25, help="runs per arm")
    parser.add_argument("--steps", type=int, default=50, help="training steps per run")
    parser.add_argument("--load", type=int, default=3, help="busy processes alongside")
    parser.add_argument("--out", type=Path, default=RESULT, help="where the JSON goes")
    args = parser.parse_args()
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for process in busy:
        process.start()
    aborts = {arm: 0 for arm in ARMS}
    failures: dict[str, list[str]] = {arm: [] for arm in ARMS}
    started = time.perf_counter()
    try:
        for run in range(args.runs):
            for arm in ARMS if run % 2 else reversed(ARMS):
                with tempfile.TemporaryDirectory() as out:
                    try:
                        mp.spawn(_rank, args=(arm, out, args.steps), nprocs=2)
                    except mp.ProcessExitedException as error:
                        aborts[arm] += 1
                        failures[arm].append(str(error))
    finally:
        for process in busy:
            process.terminate()
    result = {
        "bench": "gloo_exit",
        "what": "two gloo ranks on CPU, DDP training then exit; runs whose rank died by signal",
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "runs_per_arm": args.runs,
        "aborted_runs": aborts,
        "failures": failures,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("aborted_runs", "wall_s")}))


if __name__ == "__main__":
    main()
