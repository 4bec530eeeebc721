"""Matmul throughput per dtype (fp32, tf32, bf16, fp16, fp8 where supported), the project's own
``dtype_speedups`` on the device, and the precision knob on a CUDA training job.

Throughput: square n x n products timed with CUDA events (mean of ``--repeats`` after 3
warm-ups), 2 n^3 FLOP each. References, not targets (the issue gives none): 788 TFLOP/s bf16 on
random data measured on one H200 of this workplace (device README, KINDS.md) and the
datasheet's dense 990. The training job is ``workloads.train.Trainer`` on the device at each
``TrainConfig.precision``, steps interleaved across precisions, median step time.

    python -m bench.gpu_truth.matmul --out bench/results/gpu
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu_truth._record import Part, parser
from collectors.torch_profile import dtype_speedups

REFERENCE_TFLOPS = {"bf16": {"measured_h200_here": 788.0, "datasheet_dense_h200": 990.0}}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}


def _product(device: torch.device, precision: str, n: int) -> Callable[[], object]:
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=g) for _ in range(2))
    if precision == "fp8":
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16)
    a, b = a.to(DTYPES[precision]), b.to(DTYPES[precision])
    return lambda: torch.mm(a, b)


def time_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean seconds per call after 3 warm-ups (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    torch.cuda.synchronize(device)
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / repeats


def throughput(part: Part, device: torch.device, n: int, repeats: int) -> None:
    rows = part.data.setdefault("matmul_tflops", {})
    precisions = ["fp32", "tf32", "bf16", "fp16"]
    if device.type == "cuda":
        precisions.append("fp8")
    for precision in precisions:
        with part.attempt(f"matmul.{precision}"):
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
            try:
                seconds = time_s(_product(device, precision, n), device, repeats)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False
            rows[precision] = {"n": n, "seconds": seconds, "tflops": 2 * n**3 / seconds / 1e12,
                               "reference": REFERENCE_TFLOPS.get(precision)}


def training_precision(part: Part, device: torch.device, steps: int, batch: int) -> None:
    """Median step time of the demo training job per precision knob value, interleaved."""
    from collectors.torch_training import NullTrainingInstrumentation
    from workloads.train import PRECISIONS, TrainConfig, Trainer

    trainers = {p: Trainer(TrainConfig(precision=p, device=str(device), global_batch=batch,
                                       micro_batch=batch, seq_len=128)) for p in PRECISIONS}
    null = NullTrainingInstrumentation()
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for i in range(steps + 3):
        for p, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(null)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 3:  # warm-up steps not counted
                times[p].append(time.perf_counter() - start)
    base = statistics.median(times["fp32"])
    part.data["training_job"] = {
        "job": f"workloads.train.Trainer, global batch {batch} x 128 tokens", "steps": steps,
        "median_step_s": {p: statistics.median(t) for p, t in times.items()},
        "speedup_vs_fp32": {p: base / statistics.median(t) for p, t in times.items()}}


def main(argv: list[str] | None = None) -> Path:
    p = parser(__doc__)
    p.add_argument("--n", type=int, default=None, help="default 8192 (128 with --cpu)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--train-steps", type=int, default=None, help="default 40 (2 with --cpu)")
    p.add_argument("--train-batch", type=int, default=None, help="default 32 (2 with --cpu)")
    args = p.parse_args(argv)
    part = Part("matmul", args.out, simulated=args.cpu)
    device = torch.device("cpu" if args.cpu else "cuda")
    with part.attempt("device"):
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    if not part.errors:
        throughput(part, device, args.n or (128 if args.cpu else 8192), args.repeats)
        with part.attempt("dtype_speedups"), tempfile.TemporaryDirectory() as cache:
            part.data["project_dtype_speedups"] = dtype_speedups(device, cache_dir=cache)
        with part.attempt("training_job"):
            training_precision(part, device, args.train_steps or (2 if args.cpu else 40),
                               args.train_batch or (2 if args.cpu else 32))
    return part.write()


if __name__ == "__main__":
    main()
