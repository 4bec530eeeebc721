"""``bench/overhead.py`` with the training job on CUDA, against the issue's targets: median
instrumented/bare step ratio <= 1.003 and the upper end of its 95% CI <= 1.006.

    python -m bench.gpu_truth.overhead --out bench/results/gpu [--pairs 60]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import overhead
from bench.gpu_truth._record import Part, check, parser

MEDIAN_TARGET = 1.003
CI_HIGH_TARGET = 1.006


def bench_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """``bench/overhead.py``'s own settings, its defaults resolved as its command line does."""
    bench_args = overhead.arguments([
        "--receiver", args.receiver, "--pairs", str(args.pairs), "--block-steps", "1",
        "--global-batch", str(args.global_batch), "--micro-batch", str(args.global_batch),
        "--device", "cpu" if args.cpu else "cuda", "--out", str(args.out / "overhead_raw.json")])
    if not args.cpu:
        bench_args.threads = None  # torch's own thread count on the GPU host
    return bench_args


def main(argv: list[str] | None = None) -> Path:
    p = parser(__doc__)
    p.add_argument("--pairs", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--receiver", choices=("sidecar", "router"), default="sidecar")
    args = p.parse_args(argv)
    part = Part("overhead", args.out, simulated=args.cpu)
    bench_args = bench_arguments(args)
    with part.attempt("overhead"):
        result = overhead.run(bench_args)
        result["machine"].pop("note", None)  # the 2-core box's note; not this machine's
        part.data["result"] = result
        part.data["median_ratio"] = check(result["median_ratio"], MEDIAN_TARGET, at_most=True,
                                          peer="bare arm (NullTrainingInstrumentation)")
        part.data["ratio_ci95_high"] = check(result["ratio_ci95"][1], CI_HIGH_TARGET,
                                             at_most=True, peer="bare arm, 95% bootstrap CI")
    part.data.setdefault("median_ratio", check(None, MEDIAN_TARGET, at_most=True))
    part.data.setdefault("ratio_ci95_high", check(None, CI_HIGH_TARGET, at_most=True))
    return part.write()


if __name__ == "__main__":
    main()
