"""Real DDP jobs with the timed all-reduce hook installed.

Always: 2 gloo ranks on CPU. Where CUDA is present (not on the development box, so those two
cases have not been run there yet): 1 NCCL rank, and 2 gloo ranks sharing cuda:0, both of which
take the CUDA-event timing path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.multiprocessing as mp  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

from collectors.torch_collective import CollectiveTimer, install  # noqa: E402
from tests.collectors._otel_points import metric_points  # noqa: E402
from tests.rendezvous import file_rendezvous  # noqa: E402
from workloads.process_group import rank_process_group  # noqa: E402

STEPS = 4
VERSION_SWITCH_STEP = 2  # steps before it run under config version 1, from it on version 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    backend: str
    device: str
    world_size: int


JOBS = [
    pytest.param(Job(backend="gloo", device="cpu", world_size=2), id="gloo-cpu-2"),
    *(
        pytest.param(job, id=f"{job.backend}-cuda-{job.world_size}", marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs CUDA"))
        for job in (Job(backend="nccl", device="cuda", world_size=1),
                    Job(backend="gloo", device="cuda", world_size=2))
    ),
]


def _rank(rank: int, out_dir: str, job: dict[str, Any]) -> None:
    backend, device, world_size = job["backend"], torch.device(job["device"]), job["world_size"]
    torch.set_num_threads(1)
    with rank_process_group(backend, rank=rank, world_size=world_size,
                            init_method=file_rendezvous(out_dir)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(50, 32),  # frozen below: its bytes must not be counted
            torch.nn.Linear(32, 96),
            torch.nn.ReLU(),
            torch.nn.Linear(96, 96),
            torch.nn.ReLU(),
            torch.nn.Linear(96, 8),
        )
        model[0].weight.requires_grad_(False)
        model.to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
        reader = InMemoryMetricReader()
        timer = CollectiveTimer(
            MeterProvider(metric_readers=[reader]).get_meter("test"),
            world_size=world_size, backend=backend, config_version=1,
            attributes={"seedance.rank": rank},
        )
        install(ddp, timer)
        optimiser = torch.optim.SGD(ddp.parameters(), lr=0.01)
        steps = []
        for step in range(STEPS):
            if step == VERSION_SWITCH_STEP:
                timer.config_version = 2
            tokens = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(step))
            ddp(tokens.to(device)).square().mean().backward()
            optimiser.step()
            optimiser.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()  # the timer reads CUDA events lazily, never waits
            stats = timer.last_step_stats()
            assert stats is not None
            steps.append({
                "step": stats.step,
                "config_version": stats.config_version,
                "step_bytes": stats.step_bytes,
                "calls": stats.calls,
                "buckets": [
                    {"index": b.index, "size_bytes": b.size_bytes, "latency_s": b.latency_s,
                     "algbw": b.algbw_bytes_per_s, "busbw": b.busbw_bytes_per_s}
                    for b in stats.buckets
                ],
            })
        logging_data = ddp._get_ddp_logging_data()
        result = {
            "trainable_bytes": sum(
                p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
            ),
            "all_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "ddp_bucket_sizes": [int(s) for s in logging_data["bucket_sizes"].split(",")],
            "ddp_rebuilt_bucket_sizes": [
                int(s) for s in logging_data["rebuilt_bucket_sizes"].split(",")
            ],
            "steps": steps,
            "metrics": metric_points(reader),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module", params=JOBS)
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """One result per rank; the job's backend is in each result."""
    job: Job = request.param
    out_dir = tmp_path_factory.mktemp("ddp")
    mp.spawn(_rank, args=(str(out_dir), asdict(job)), nprocs=job.world_size,
             join=True)
    return [
        {**json.loads(Path(out_dir, f"rank{r}.json").read_text()), "backend": job.backend}
        for r in range(job.world_size)
    ]


@pytest.mark.integration
def test_step_bytes_are_the_trainable_parameter_bytes(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["trainable_bytes"] < result["all_bytes"]  # the frozen embedding is out
        assert [s["step_bytes"] for s in result["steps"]] == [result["trainable_bytes"]] * STEPS
        assert [s["step"] for s in result["steps"]] == list(range(STEPS))


@pytest.mark.integration
def test_buckets_match_ddp_before_and_after_the_rebuild(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        before, rebuilt = result["ddp_bucket_sizes"], result["ddp_rebuilt_bucket_sizes"]
        assert before != rebuilt  # the test only means something if DDP did rebuild
        assert len(rebuilt) > 1
        for step in result["steps"]:
            expected = before if step["step"] == 0 else rebuilt
            assert step["calls"] == len(expected)
            by_index = sorted(step["buckets"], key=lambda b: b["index"])
            assert [b["index"] for b in by_index] == list(range(len(expected)))
            assert [b["size_bytes"] for b in by_index] == expected


@pytest.mark.integration
def test_latency_and_bandwidths(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    for result in ranks:
        for step in result["steps"]:
            for bucket in step["buckets"]:
                assert bucket["latency_s"] > 0
                assert bucket["algbw"] == bucket["size_bytes"] / bucket["latency_s"]
                assert bucket["busbw"] == bucket["algbw"] * 2 * (n - 1) / n


@pytest.mark.integration
def test_otel_points_carry_the_config_version(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        metrics, steps = result["metrics"], result["steps"]
        for version in (1, 2):
            mine = [s for s in steps if s["config_version"] == version]
            assert len(mine) == 2
            attrs = {"seedance.config.version": version,
                     "seedance.comm.backend": result["backend"], "seedance.rank": rank}
            calls = [p for p in metrics["seedance.comm.allreduce.calls"]
                     if p["attributes"] == attrs]
            sent = [p for p in metrics["seedance.comm.allreduce.bytes"]
                    if p["attributes"] == attrs]
            duration = [p for p in metrics["seedance.comm.allreduce.duration"]
                        if p["attributes"] == attrs]
            assert calls[0]["value"] == sum(s["calls"] for s in mine)
            assert sent[0]["value"] == sum(s["step_bytes"] for s in mine)
            assert duration[0]["count"] == sum(s["calls"] for s in mine)
            assert duration[0]["sum"] == pytest.approx(
                sum(b["latency_s"] for s in mine for b in s["buckets"])
            )


@pytest.mark.integration
def test_gauges_report_only_the_last_steps_buckets(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        last = result["steps"][-1]
        assert result["metrics"]["seedance.comm.step_bytes"] == [{
            "attributes": {"seedance.config.version": 2,
                           "seedance.comm.backend": result["backend"], "seedance.rank": rank},
            "value": last["step_bytes"],
        }]
        for name, key in (("seedance.comm.allreduce.algbw", "algbw"),
                          ("seedance.comm.allreduce.busbw", "busbw")):
            observed = {p["attributes"]["seedance.comm.bucket"]: p["value"]
                        for p in result["metrics"][name]}
            assert observed == {b["index"]: b[key] for b in last["buckets"]}
