"""Live NVML against nvidia-smi on the same seconds, under a memory-bound and a compute-bound
load; each load's polls are recorded as a replayable trace (``RecordingBackend``).

The project's live backend is polled every ``--interval-ms`` in a thread while ``nvidia-smi
--query-gpu ... -lms`` runs beside it; ``_smi.compare`` aligns both by wall-clock second. The
issue sets no target for the agreement: the per-field differences are reported as measured.

    python -m bench.gpu_truth.nvml --out bench/results/gpu            # on the GPU
    python -m bench.gpu_truth.nvml --out /tmp/x --cpu --seconds 2     # no GPU: replayed trace
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu_truth import _smi
from bench.gpu_truth._record import Part, parser
from collectors._nvml_backends import NvmlBackend
from collectors._nvml_live import LiveNvmlBackend
from collectors._nvml_trace import RecordingBackend, ReplayBackend

REPLAYED = Path(__file__).resolve().parents[2] / "collectors" / "traces" / "h100_gpu_burn.jsonl"


def memory_bound(device: torch.device) -> Callable[[], None]:
    """Device-to-device copies of a buffer far larger than L2 (1 GiB on a GPU)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 20)
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)

    def step() -> None:
        dst.copy_(src)
    return step


def compute_bound(device: torch.device) -> Callable[[], None]:
    """bf16 8192^3 matmuls (a small fp32 one on CPU)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def step() -> None:
        torch.mm(a, b)
    return step


LOADS = {"memory_bound": memory_bound, "compute_bound": compute_bound}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def run_load(step: Callable[[], None], seconds: float, device: torch.device) -> int:
    """Run ``step`` back to back for ``seconds``; returns how many ran."""
    deadline, count = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        for _ in range(10):
            step()
        count += 10
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return count


def poll_during(backend: NvmlBackend, interval_s: float, stop: threading.Event,
                polls: list[tuple[int, dict[int, dict[str, Any]]]]) -> None:
    """Poll ``backend`` every ``interval_s`` until ``stop``; appends (time_ns, readings)."""
    while not stop.is_set():
        poll = backend.poll()
        polls.append((poll.time_ns, {g.index: dict(g.readings) for g in poll.gpus}))
        stop.wait(interval_s)


def measure(part: Part, name: str, device: torch.device, *, seconds: float,
            interval_ms: int, cpu: bool) -> None:
    """One load: the recorded trace, nvidia-smi's CSV beside it, and their comparison."""
    label = _slug(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    trace = part.out / f"trace_{label}_{name}.jsonl"
    inner: NvmlBackend = ReplayBackend(REPLAYED) if cpu else LiveNvmlBackend()
    backend = RecordingBackend(inner, trace, note=f"bench.gpu_truth.nvml: {name} load "
                               f"({LOADS[name].__doc__}) on {label}"
                               + (" [no GPU: replayed h100_gpu_burn, simulated]" if cpu else ""))
    smi_csv = part.out / f"smi_{name}.csv"
    step = LOADS[name](device)
    polls: list[tuple[int, dict[int, dict[str, Any]]]] = []
    stop = threading.Event()
    smi = None
    backend.open()
    try:
        if shutil.which("nvidia-smi"):
            with smi_csv.open("w") as f:
                smi = subprocess.Popen(_smi.smi_command(interval_ms), stdout=f,
                                       stderr=subprocess.STDOUT)
        else:
            part.errors[f"{name}.nvidia_smi"] = "nvidia-smi is not on the PATH"
        sampler = threading.Thread(target=poll_during,
                                   args=(backend, interval_ms / 1e3, stop, polls))
        sampler.start()
        steps = run_load(step, seconds, device)
        stop.set()
        sampler.join()
    finally:
        stop.set()
        if smi is not None:
            smi.terminate()
            smi.wait(10)
        backend.close()
    result: dict[str, Any] = {"seconds": seconds, "steps": steps, "nvml_polls": len(polls),
                              "trace": trace.name, "replayed": inner.replayed}
    if smi is not None:
        samples = _smi.parse_csv(smi_csv.read_text(errors="replace").splitlines())
        result["smi_rows"] = len(samples)
        result["smi_csv"] = smi_csv.name
        result["fields"] = _smi.compare(_smi.nvml_samples(polls), samples)
    part.data.setdefault("loads", {})[name] = result


def main(argv: list[str] | None = None) -> Path:
    p = parser(__doc__)
    p.add_argument("--seconds", type=float, default=None,
                   help="per load; default 20 (2 with --cpu)")
    p.add_argument("--interval-ms", type=int, default=500)
    args = p.parse_args(argv)
    part = Part("nvml", args.out, simulated=args.cpu)
    device = torch.device("cpu" if args.cpu else "cuda")
    part.data["method"] = ("live NVML backend polled every interval beside nvidia-smi "
                           "--query-gpu -lms at the same interval; both averaged per wall-clock "
                           "second; median |NVML - nvidia-smi| per field in nvidia-smi's unit")
    part.data["interval_ms"] = args.interval_ms
    part.data["target"] = "none given by the issue: differences reported as measured"
    for name in LOADS:
        with part.attempt(name):
            measure(part, name, device, seconds=args.seconds or (2.0 if args.cpu else 20.0), interval_ms=args.interval_ms,
                    cpu=args.cpu)
    return part.write()


if __name__ == "__main__":
    main()
