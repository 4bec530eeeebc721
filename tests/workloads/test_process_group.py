"""Spawned gloo ranks exit 0 once all are done, and a failing rank reports its exception."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.rendezvous import file_rendezvous
from workloads.process_group import rank_process_group

RUNS = 3


def _rank(rank: int, out: str, fail_rank: int) -> None:
    torch.set_num_threads(1)
    with rank_process_group("gloo", rank=rank, world_size=2, init_method=file_rendezvous(out)):
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        if rank == fail_rank:
            raise ValueError(f"rank {rank} failed on purpose")
        Path(out, f"rank{rank}.json").write_text(json.dumps(float(total.item())))


def test_finished_ranks_exit_zero_with_their_results_written(tmp_path: Path) -> None:
    for run in range(RUNS):
        out = tmp_path / str(run)
        out.mkdir()
        mp.spawn(_rank, args=(str(out), -1), nprocs=2)
        assert [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)] == [3.0, 3.0]


def test_a_failing_rank_reports_its_exception(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose"):
        mp.spawn(_rank, args=(str(tmp_path), 1), nprocs=2)
    assert not (tmp_path / "rank1.json").exists()
