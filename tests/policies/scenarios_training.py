"""Scenario builders for the training-side detectors (bench/detection.py; Scenario and Built
come from :mod:`tests.policies.scenarios_hardware`).

Every detector gets a positive and a healthy scenario. Sources are labelled:

``real``: a small torch job runs on this CPU when the scenario is built, its telemetry going
through the real ``TrainingInstrumentation`` and OTel set-up into a real ``TimeSeriesStore``
(the DDP ones: a real 2-rank gloo job, ``tests.policies.ddp_job``); the store's raw frames are
copied into a ``FrameStore`` under the scenarios' job name. Each job is recorded once per
process (the bench's repeats re-evaluate the same recording). ``synthetic``: made up here.

Every job exports once per step. Evaluations run at successive export times (after both ranks
exported, for DDP) with a window of ``window_steps`` median export intervals, starting once a
full window exists, so a delay counts evaluations. The onset is the first evaluation whose
window holds the first faulty step, which the job itself reports (the first step whose
gradients it saw zeroed or non-finite, the first slow batch, the first bf16 step) or None.
"""

from __future__ import annotations

import functools
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from collectors import Point
from policies import Detector, FrameStore
from policies._window import JOB_ATTRIBUTE
from policies.detectors import (
    BATCH_SIZE_ATTR,
    PRECISION_ATTR,
    CollapseConfig,
    GradientCollapseDetector,
    GradientUnderflowDetector,
    ImbalanceConfig,
    InputBoundDetector,
    LoadImbalanceDetector,
    NonFiniteDetector,
    SmallBatchPrecisionConfig,
    SmallBatchPrecisionDetector,
    TinyBucketDetector,
)
from policies.detectors._steps import STEP, STEP_DURATION
from tests.policies.scenarios_hardware import JOB, Built, S, Scenario

if TYPE_CHECKING:
    from collectors._store import TimeSeriesStore
    from tests.policies.training_jobs import Run

RANK = "seedance.rank"
CHANGE_AT = 10
"""The step at which each single-process job takes a new config version: the faulty change
(fp16 group, lr 50, slow loader) in the positive job, a no-op change in the healthy one. The
precision job changes later: its 16-step window must hold 6 exports of each precision."""


def _windows(store: FrameStore, times_ns: list[int], fault_ns: int | None,
             window_steps: int) -> Built:
    """Evaluations at ``times_ns[window_steps - 1:]``, each over ``window_steps - 0.5`` times
    the median export interval of the job's first window (so a fault that slows the steps does
    not stretch the window); onset: the first evaluation at or after the first faulty export."""
    interval_s = float(np.median(np.diff(times_ns[:window_steps]))) / S
    evals = times_ns[window_steps - 1:]
    onset = None
    if fault_ns is not None:
        onset = next((k for k, t in enumerate(evals) if t >= fault_ns), None)
        if onset is None:
            raise ValueError(f"the fault at {fault_ns} ns comes after the last evaluation")
    return Built(store, evals, onset, (window_steps - 0.5) * interval_s)


def _step_times(store: FrameStore, name: str = STEP) -> list[int]:
    """Export times of ``name`` per step: the later rank's when several ranks export."""
    frame = store.query(name, resolution="raw")
    frame = frame.assign(t=frame["time"].astype("int64"))
    if RANK not in frame.columns:
        return sorted(set(frame["t"].tolist()))
    per_rank = [sorted(set(rows["t"].tolist())) for _, rows in frame.groupby(RANK)]
    return [max(ts) for ts in zip(*per_rank, strict=False)]


# -- real single-process jobs ------------------------------------------------------------------

def _paced(steps: int, period_s: float) -> Iterator[int]:
    """Step indices, each yielded ``period_s`` after the one before (at once when late).

    These jobs' steps take a few ms, no steadier than the shared box, so an N-second window
    would hold anywhere from 1 to 20 of them; a job that starts a step every ``period_s``
    keeps the windows comparable. The pause falls between an export and the next step, outside
    every duration the job measures (step, data wait).
    """
    start = time.perf_counter()
    for step in range(steps):
        time.sleep(max(0.0, start + step * period_s - time.perf_counter()))
        yield step


def _store_frames(store: TimeSeriesStore) -> FrameStore:
    """Every raw frame of ``store``, its job attribute renamed to the scenarios' job."""
    store.flush()
    frames = {}
    for name in store.metrics()["name"].astype(str):
        frame = store.query(name, resolution="raw")
        if JOB_ATTRIBUTE in frame.columns:
            frame[JOB_ATTRIBUTE] = JOB
        frames[name] = frame
    return FrameStore(frames)


def _record(job: Callable[[Run], int | None]) -> tuple[FrameStore, int | None]:
    """Run ``job`` (returns its first faulty step or None) on one thread into a real store."""
    import torch

    from tests.policies.training_jobs import store_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the box is shared; one thread keeps step times steadier
    try:
        with tempfile.TemporaryDirectory() as tmp, store_run(Path(tmp)) as run:
            fault_step = job(run)
            return _store_frames(run.store), fault_step
    finally:
        torch.set_num_threads(threads)


def _underflow_job(run: Run, *, fault: bool, steps: int = 24, period_s: float = 0.02
                   ) -> int | None:
    """The residual-free MLP under a GradScaler with a tiny loss scale (2^-30); from
    ``CHANGE_AT`` group "4" computes in fp16 (``fault``) or stays fp32. Returns the first step
    whose group-"4" gradients were all exactly zero."""
    import torch
    from torch import nn

    from tests.policies.training_jobs import HalfLinear, mlp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-30, growth_interval=10**6)
    instr = run.instrument(model, opt, version=1, grad_scaler=scaler)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    first_zero = None
    for step in _paced(steps, period_s):
        if step == CHANGE_AT:
            lowered = model[4]
            if fault and isinstance(lowered, nn.Linear):
                model[4] = HalfLinear(lowered)
            instr.config_version = 2
        with instr.step(samples=32):
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if first_zero is None and not any(p.grad is not None and bool(p.grad.any())
                                              for p in model[4].parameters()):
                first_zero = step
            instr.after_backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            instr.record_loss(loss)
        run.export()
    return first_zero


def _blow_up_job(run: Run, *, fault: bool, steps: int = 24, period_s: float = 0.02
                 ) -> int | None:
    """The MLP on SGD at lr 1e-3 against large targets; from ``CHANGE_AT`` the lr is 50
    (``fault``) or unchanged. Returns the first step whose loss or global gradient norm (fp32,
    as ``clip_grad_norm_`` computes it; it overflows before the elements do) is not finite. The
    SDK drops NaN and infinite gauge values: the job's ``seedance.train.nonfinite_steps``
    counter and the per-group element counts carry them to the store."""
    import torch
    from torch import nn

    from tests.policies.training_jobs import mlp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    instr = run.instrument(model, opt, version=1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), 100 * torch.randn(32, 4, generator=g)
    first_bad = None
    for step in _paced(steps, period_s):
        if step == CHANGE_AT:
            for group in opt.param_groups:
                group["lr"] = 50.0 if fault else group["lr"]
            instr.config_version = 2
        with instr.step(samples=32):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
            if first_bad is None and not (math.isfinite(float(loss.detach()))
                                          and math.isfinite(float(norm))):
                first_bad = step
            instr.after_backward()
            opt.step()
            opt.zero_grad()
            instr.record_loss(loss)
        run.export()
    return first_bad


def _loader_job(run: Run, *, fault: bool, steps: int = 24, sleep_s: float = 0.005,
                period_s: float = 0.08) -> int | None:
    """Batches of 8 already in memory; from ``CHANGE_AT`` (``fault``) from a DataLoader whose
    items each sleep ``sleep_s`` (a real slow source: decoding, a remote read). Returns the
    first step fed by the slow loader."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from tests.policies.training_jobs import mlp

    class Slow(Dataset[tuple[torch.Tensor, torch.Tensor]]):
        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(sleep_s)
            return torch.randn(16), torch.randn(4)

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    instr = run.instrument(model, opt, version=1)
    memory = iter([(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(steps)])
    slow = iter(DataLoader(Slow(), batch_size=8, num_workers=0))
    for step in _paced(steps, period_s):
        with instr.data_wait():
            x, y = next(slow if fault and step >= CHANGE_AT else memory)
        with instr.step(samples=8):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            instr.after_backward()
            opt.step()
            opt.zero_grad()
        run.export()
    return CHANGE_AT if fault else None


def _precision_job(run: Run, *, fault: bool, steps: int = 44, change_at: int = 20,
                   period_s: float = 0.03) -> int | None:
    """A tiny GPT at batch 2: fp32 under config version 1, then from ``change_at`` (version 2)
    bf16 autocast (``fault``) or fp32 again. The fault is real only where bf16 is not faster:
    returns the first bf16 step if :func:`bf16_over_fp32` finds bf16 steps at least
    ``1 - min_speedup`` of fp32's (the detector's bar) on this machine, else None."""
    import torch

    from workloads.gpt import GPT, GPTConfig

    cfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))

    def step(reduced: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=reduced):
            loss = model(x, x.roll(-1, dims=1))
        loss.backward()
        if instr is not None:
            instr.after_backward()
        opt.step()
        opt.zero_grad()

    instr = None
    for i in _paced(steps, period_s):
        reduced = fault and i >= change_at
        if i in (0, change_at):
            instr = run.instrument(model, opt, version=1 + (i == change_at), attributes={
                PRECISION_ATTR: "bf16" if reduced else "fp32", BATCH_SIZE_ATTR: "2"})
        assert instr is not None
        with instr.step(tokens=x.numel(), samples=2):
            step(reduced)
        run.export()
    if not fault:
        return None
    instr = None
    slower = bf16_over_fp32(step) >= 1 - SmallBatchPrecisionConfig().min_speedup
    return change_at if slower else None


def bf16_over_fp32(step: Callable[[bool], None], *, rounds: int = 6, steps: int = 5) -> float:
    """Median bf16 over median fp32 step time, ``step(reduced)`` timed in interleaved rounds
    (load on the shared box drifts; interleaving spreads it over both). Measured on this 2-core
    AMD EPYC (avx512_bf16) for the precision job's GPT at batch 2: 1.5-2.3 in separate runs."""
    timed: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for reduced in (False, True):
            step(reduced)  # the first step after a switch pays the change
            for _ in range(steps):
                start = time.perf_counter()
                step(reduced)
                timed[reduced].append(time.perf_counter() - start)
    return float(np.median(timed[True]) / np.median(timed[False]))


@functools.cache
def _recorded(job: str, fault: bool) -> tuple[FrameStore, int | None]:
    return _record(functools.partial(_JOBS[job], fault=fault))


_JOBS: dict[str, Callable[..., int | None]] = {
    "underflow": _underflow_job, "blow_up": _blow_up_job, "loader": _loader_job,
    "precision": _precision_job}


def _real(job: str, *, fault: bool, window_steps: int,
          times_of: str = STEP) -> Callable[[], Built]:
    def build() -> Built:
        store, fault_step = _recorded(job, fault)
        times = _step_times(store, times_of)
        return _windows(store, times, None if fault_step is None else times[fault_step],
                        window_steps)

    return build


# -- real 2-rank gloo DDP job ----------------------------------------------------------------

DDP_STEPS = 20
DDP_PHASES = {"tiny": {"bucket_cap_mb": 0.001}, "default": {},
              "slow": {"slow_rank": 1, "sleep_s": 0.1}}


@functools.cache
def _ddp_stores() -> dict[str, FrameStore]:
    """One real run of the three DDP jobs one after another (one pair of processes): per job,
    its points under the scenarios' job name."""
    from tests.policies.ddp_job import Phase, run_ddp_jobs

    points = run_ddp_jobs([Phase(job=job, steps=DDP_STEPS, **kwargs)  # type: ignore[arg-type]
                           for job, kwargs in DDP_PHASES.items()])
    return {job: FrameStore.from_points(
        Point(p.name, p.value, p.time_ns, {**p.attributes, JOB_ATTRIBUTE: JOB})
        for p in points if p.attributes.get(JOB_ATTRIBUTE) == job) for job in DDP_PHASES}


def _ddp(job: str, *, fault: bool, window_steps: int) -> Callable[[], Built]:
    """The fault (tiny buckets, a rank sleeping 0.1 s a step) holds from the job's start."""
    def build() -> Built:
        store = _ddp_stores()[job]
        times = _step_times(store, STEP_DURATION + ".count")
        return _windows(store, times, times[0] if fault else None, window_steps)

    return build


def _no_cooldown() -> Detector:
    """Seed 2.3's cooldown (tau = 45 s of data under the config in force) off: it keeps a
    rebalanced pair from being judged again too soon, and these jobs are never rebalanced (a
    real one runs a second or two)."""
    return LoadImbalanceDetector(ImbalanceConfig(cooldown_s=0.0))


# -- gradient collapse (synthetic: no real job collapses by the seed's rule here) ------------

def collapse_points(*, collapse_at: int | None, steps: int = 40) -> list[Point]:
    """SYNTHETIC per-step global gradient norms, one export a second: a slow noisy decay from
    1.0, and from ``collapse_at`` each norm 1% of the one before."""
    rng = np.random.default_rng(0)
    norms = 0.98 ** np.arange(steps) * (1 + 0.1 * rng.standard_normal(steps))
    if collapse_at is not None:
        norms[collapse_at:] = norms[collapse_at - 1] * 0.01 ** np.arange(1, steps - collapse_at + 1)
    attrs = {JOB_ATTRIBUTE: JOB, RANK: "0", "seedance.config.version": "1"}
    return [p for i, norm in enumerate(norms) for p in (
        Point(STEP, float(i), 1000 * S + i * S, attrs),
        Point("seedance.train.grad.norm", float(norm), 1000 * S + i * S, attrs))]


def _collapse(collapse_at: int | None) -> Callable[[], Built]:
    def build() -> Built:
        store = FrameStore.from_points(collapse_points(collapse_at=collapse_at))
        times = _step_times(store)
        return _windows(store, times, None if collapse_at is None else times[collapse_at], 10)

    return build


def _pair(detector: str, source: str, healthy: tuple[str, Callable[[], Built]],
          positive: tuple[str, Callable[[], Built]],
          make: Callable[[], Detector]) -> tuple[Scenario, Scenario]:
    return (Scenario(f"healthy_{healthy[0]}", detector, source, healthy[1], make),
            Scenario(f"positive_{positive[0]}", detector, source, positive[1], make))


SCENARIOS: tuple[Scenario, ...] = (
    *_pair("gradient_collapse", "synthetic", ("slow_norm_decay", _collapse(None)),
           ("norm_collapse_at_step_20", _collapse(20)),
           lambda: GradientCollapseDetector(CollapseConfig())),
    *_pair("gradient_underflow", "real",
           ("mlp_fp32_tiny_loss_scale", _real("underflow", fault=False, window_steps=8)),
           ("mlp_fp16_group_tiny_loss_scale", _real("underflow", fault=True, window_steps=8)),
           GradientUnderflowDetector),
    *_pair("non_finite", "real",
           ("mlp_lr_1e-3", _real("blow_up", fault=False, window_steps=8)),
           ("mlp_lr_raised_to_50", _real("blow_up", fault=True, window_steps=8)),
           NonFiniteDetector),
    *_pair("input_bound", "real",
           ("in_memory_batches", _real("loader", fault=False, window_steps=8)),
           ("slow_dataloader", _real("loader", fault=True, window_steps=8)),
           InputBoundDetector),
    *_pair("small_batch_precision", "real",
           ("gpt_fp32_then_fp32_batch_2", _real("precision", fault=False, window_steps=16)),
           ("gpt_fp32_then_bf16_batch_2", _real("precision", fault=True, window_steps=16)),
           SmallBatchPrecisionDetector),
    *_pair("tiny_buckets", "real",
           ("ddp_gloo_default_buckets", _ddp("default", fault=False, window_steps=4)),
           ("ddp_gloo_1kb_buckets", _ddp("tiny", fault=True, window_steps=4)),
           TinyBucketDetector),
    *_pair("load_imbalance", "real",
           ("ddp_gloo_even_ranks", _ddp("default", fault=False, window_steps=8)),
           ("ddp_gloo_rank_1_sleeps", _ddp("slow", fault=True, window_steps=8)),
           _no_cooldown),
)

