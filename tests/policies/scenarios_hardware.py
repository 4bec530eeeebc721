"""Scenario builders for the hardware, communication and balance detectors (tests and bench).

Each builder returns a store and the evaluation times; ``onset`` is the index of the first
evaluation whose window holds the fault (None for healthy scenarios). Sources are labelled:
``replayed`` (a real capture through the real sampler), ``derived`` (a real capture with named
fields changed), ``published`` (figures from a public write-up, turned into points) and
``synthetic`` (made up here, where no real source exists on this machine).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from collectors import Point
from collectors._nccl_tests import (
    NcclTestsResult,
    NcclTestsRow,
    nccl_tests_points,
    parse_nccl_tests,
)
from collectors._nvml import GpuSampler, GpuSamplerConfig
from collectors._nvml_trace import ReplayBackend
from policies import Detector, FrameStore, StoreWindow
from policies.detectors import (
    AutoscalerThrashDetector,
    BandwidthSaturationDetector,
    CommunicationConfig,
    CommunicationDegradationDetector,
)

TRACES = Path(__file__).resolve().parents[2] / "collectors" / "traces"
SAMPLES = Path(__file__).resolve().parents[1] / "data"
S = 10**9
JOB = "job"


@dataclass(frozen=True, slots=True)
class Built:
    store: FrameStore
    eval_ns: list[int]
    onset: int | None
    window_s: float


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    detector: str
    source: str
    build: Callable[[], Built]
    make: Callable[[], Detector]

    def run(self) -> tuple[list[bool], Built]:
        """Evaluate the detector at every evaluation time: True where it returned a finding."""
        built = self.build()
        detector = self.make()
        flags = [bool(detector.evaluate(StoreWindow(
            built.store, job=JOB, since_ns=t - int(built.window_s * S), until_ns=t)))
            for t in built.eval_ns]
        return flags, built

    @property
    def healthy(self) -> bool:
        return self.name.startswith("healthy")


def replay_points(trace: Path) -> list[Point]:
    """Every poll of ``trace`` through the real GpuSampler (replayed points)."""
    backend = ReplayBackend(trace, loop=False)
    polls = sum(1 for _ in trace.open()) - 1
    sampler = GpuSampler(backend, config=GpuSamplerConfig(interval_s=1.0, host_name="replay"))
    points = [p for _ in range(polls) for p in sampler.poll_once()]
    sampler.shutdown()
    return points


def derive_trace(source: Path, out: Path, note: str, readings: list[dict[str, int]]) -> Path:
    """A trace with the first poll of ``source`` repeated, named readings replaced per poll."""
    lines = source.read_text().splitlines()
    header = json.loads(lines[0])
    first = json.loads(lines[1])
    header["description"] = f"DERIVED from {source.name}: {note}"
    records = []
    for k, changes in enumerate(readings):
        gpu = json.loads(json.dumps(first["gpus"][0]))
        gpu["readings"].update(changes)
        for key in changes:
            gpu["errors"].pop(key, None)
        records.append({"gpus": [gpu], "t_s": float(k)})
    out.write_text("\n".join(json.dumps(r, sort_keys=True) for r in [header, *records]) + "\n")
    return out


def _from_points(points: list[Point], onset: int | None, window_polls: int = 3) -> Built:
    times = sorted({p.time_ns for p in points})
    evals = times[window_polls - 1:]
    return Built(FrameStore.from_points(points), evals, onset, (window_polls - 1) + 0.5)


def _trace(name: str) -> Callable[[], Built]:
    return lambda: _from_points(replay_points(TRACES / name), None)


def _derived(source: str, key: str, healthy: int, bad: int, note: str) -> Callable[[], Built]:
    def build() -> Built:
        with tempfile.TemporaryDirectory() as tmp:
            path = derive_trace(TRACES / source, Path(tmp, "derived.jsonl"), note,
                                [{key: healthy}] * 4 + [{key: bad}] * 6)
            points = replay_points(path)
        return _from_points(points, onset=2)  # window of 3 polls: eval 2 first holds poll 4

    return build


# -- communication -----------------------------------------------------------------------------

# (GPU model for the NVLink peak, ranks, fast busbw, degraded busbw) in GB/s; the published
# figures and their source: tests/data/README.md, "Figures from other public measurements"
PUBLISHED = {
    "dgx_h100": ("NVIDIA H100 80GB HBM3", 4, 370.0, 22.9),
    "dgx_a100": ("NVIDIA A100-SXM4-80GB", 4, 222.0, 5.2),
    "a40_pair": ("NVIDIA A40", 2, 47.4, 3.86),
}
EFA_PEAK = {  # per-node EFA bandwidth (AWS instance specs): p4de 4x100 Gb/s, p5 32x100 Gb/s
    "nccl-tests_all_reduce_perf_2x-p4de.24xlarge_slurm.txt": 400e9 / 8,
    "nccl-tests_all_reduce_perf_2x-p5.48xlarge_slurm.txt": 3200e9 / 8,
    "nccl-tests_all_reduce_perf_aws-batch_mpirun.txt": 450e9,  # one node, NVLink (H100)
}


def published_rows(ranks: int, busbw_gb_s: float) -> list[NcclTestsRow]:
    """1-8 GiB all-reduce rows at a published bus bandwidth (the write-up's message range)."""
    rows = []
    for size in (2**30, 2**31, 2**32, 2**33):
        busbw = busbw_gb_s * 1e9
        algbw = busbw * ranks / (2 * (ranks - 1))
        t = size / algbw
        rows.append(NcclTestsRow(size_bytes=size, count=size // 4, dtype="float", redop="sum",
                                 time_s=t, algbw_bytes_per_s=algbw, busbw_bytes_per_s=busbw,
                                 in_place_time_s=t, in_place_algbw_bytes_per_s=algbw,
                                 in_place_busbw_bytes_per_s=busbw))
    return rows


def _gpu_point(model: str, t: int) -> Point:
    return Point("hw.gpu.up", 1.0, t, {"gpu.index": "0", "hw.name": model})


def _published(machine: str, degraded: bool) -> Callable[[], Built]:
    model, ranks, fast, slow = PUBLISHED[machine]

    def build() -> Built:
        rows = published_rows(ranks, fast) * 2
        if degraded:  # the fast path is lost half way through
            rows = rows[:4] + published_rows(ranks, slow)
        points = nccl_tests_points(NcclTestsResult(rows=tuple(rows), avg_busbw_bytes_per_s=None),
                                   job=JOB, start_ns=1000 * S)
        points += [_gpu_point(model, 1000 * S + k * S) for k in range(len(rows) + 1)]
        times = [1000 * S + k * S for k in range(3, len(rows) + 1)]
        return Built(FrameStore.from_points(points), times, 2 if degraded else None, 3.5)

    return build


def _sweep(file: str) -> Callable[[], Built]:
    def build() -> Built:
        result = parse_nccl_tests((SAMPLES / file).read_text())
        points = nccl_tests_points(result, job=JOB, start_ns=1000 * S)
        times = [1000 * S + k * S for k in range(len(result.rows) + 1)]
        return Built(FrameStore.from_points(points), times[3:], None, 1e6)  # whole sweep so far

    return build


# -- autoscaler thrash (synthetic: no serving fleet on this machine) --------------------------

def thrash_points(*, thrash: bool, minutes: int = 20) -> list[Point]:
    """SYNTHETIC serving job, one interval a minute: replicas and request-duration buckets.

    Healthy: 8 static replicas, latencies ~0.2-0.6 s. Thrash from minute 6: the replica count
    flips between 4 and 8 every 2 minutes and the minute after each flip serves 2.4 s requests
    (cold starts).
    """
    bounds = ("0.25", "0.5", "1.0", "2.5", "5.0", "+Inf")
    steady = (30, 90, 100, 100, 100, 100)
    cold = (5, 20, 40, 90, 100, 100)
    points, cum = [], [0.0] * len(bounds)
    replicas = 8
    for m in range(minutes):
        t = 1000 * S + m * 60 * S
        flip = thrash and m >= 6 and m % 2 == 0
        if flip:
            replicas = 4 if replicas == 8 else 8
        shape = cold if flip else steady
        cum = [c + n for c, n in zip(cum, shape, strict=True)]
        attrs = {"service.name": JOB}
        points.append(Point("seedance.serve.replicas", float(replicas), t, attrs))
        points += [Point("gen_ai.server.request.duration.bucket", c, t, {**attrs, "le": le})
                   for le, c in zip(bounds, cum, strict=True)]
    return points


def _thrash(thrash: bool) -> Callable[[], Built]:
    def build() -> Built:
        points = thrash_points(thrash=thrash)
        times = sorted({p.time_ns for p in points})[4:]
        # onset: the first flip is at minute 6 (times[2]); 3 changes needed: minute 10
        return Built(FrameStore.from_points(points), times, 2 if thrash else None, 600.0)

    return build


def _with_peak(peak: float) -> Callable[[], Detector]:
    return lambda: CommunicationDegradationDetector(
        CommunicationConfig(link_peak_bytes_per_s=peak))


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("healthy_h100_gpu_burn", "bandwidth_saturation", "replayed", _trace(
        "h100_gpu_burn.jsonl"), BandwidthSaturationDetector),
    Scenario("healthy_h100_idle", "bandwidth_saturation", "replayed", _trace("h100_idle.jsonl"),
             BandwidthSaturationDetector),
    Scenario("healthy_l40s_pcie", "bandwidth_saturation", "replayed", _trace("l40s_pcie.jsonl"),
             BandwidthSaturationDetector),
    Scenario("positive_a100_memory_bound", "bandwidth_saturation", "derived", _derived(
        "a100_sxm4.jsonl", "nvmlDeviceGetUtilizationRates.memory", 30, 85,
        "memory utilisation synthesised (30% then 85%), other readings real"),
        BandwidthSaturationDetector),
    Scenario("positive_l40s_pcie_full", "bandwidth_saturation", "derived", _derived(
        "l40s_pcie.jsonl", "nvmlDeviceGetPcieThroughput.RX_BYTES", 2_012_109, 27_000_000,
        "PCIe RX synthesised (real 2.0 GB/s, then 27 GB/s of a 31.5 GB/s link)"),
        BandwidthSaturationDetector),
    *(Scenario(f"healthy_{m}_fast_path", "communication_degradation", "published",
               _published(m, degraded=False), CommunicationDegradationDetector) for m in PUBLISHED),
    *(Scenario(f"positive_{m}_p2p_lost", "communication_degradation", "published",
               _published(m, degraded=True), CommunicationDegradationDetector) for m in PUBLISHED),
    *(Scenario(f"healthy_sweep_{f.split('_')[4].removesuffix('.txt')}",
               "communication_degradation", "replayed", _sweep(f),
               _with_peak(peak)) for f, peak in EFA_PEAK.items()),
    Scenario("healthy_static_replicas", "autoscaler_thrash", "synthetic", _thrash(False),
             AutoscalerThrashDetector),
    Scenario("positive_replica_thrash", "autoscaler_thrash", "synthetic", _thrash(True),
             AutoscalerThrashDetector),
)
