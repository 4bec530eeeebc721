"""``seedancectl demo --minutes 2`` with live NVML (``--nvml-trace off`` turns the replayed
trace off, so the sidecar's NVML setting stays ``auto``: the live GPU where there is one).

The demo's training and serving jobs run on CPU (``workloads.train`` as the demo starts it);
the GPU it samples is whatever the other parts load meanwhile. Recorded: the demo's own
summary (its ``gpu`` block says whether the utilisation points were replayed), the wall time,
and whether live GPU points reached the store.

    python -m bench.gpu_truth.demo --out bench/results/gpu
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from bench.gpu_truth._record import Part, check, parser

REPO = Path(__file__).resolve().parents[2]


def live_gpu(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Whether the demo's store holds GPU utilisation points that were not replayed."""
    gpu = summary.get("gpu", {})
    points = int(gpu.get("utilization_points", 0)) if not gpu.get("replayed") else 0
    return check(points, 1, peer="GPU utilisation points from live (not replayed) NVML")


def _interruptible() -> None:
    """In the demo's process before it starts: Ctrl+C's default back. ``gpu_truth.sh`` runs
    the demo's part in the background, and a non-interactive shell starts background jobs
    with SIGINT ignored, which Python keeps: the demo would then never see the interrupt,
    and its jobs would be killed mid-trial 20 s later instead of stopped."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_demo(command: list[str], log: IO[bytes], timeout_s: float) -> int:
    """Run the demo in its own process group; past ``timeout_s`` interrupt it like Ctrl+C (it
    stops its jobs), then kill the group, so no job outlives the part."""
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True, preexec_fn=_interruptible)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise TimeoutError(f"seedancectl demo ran past {timeout_s:.0f} s") from None


def main(argv: list[str] | None = None) -> Path:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=445.0,
                   help="below the script's timeout for this part, so the summary is read")
    args = p.parse_args(argv)
    part = Part("demo", args.out, simulated=args.cpu)
    trace = "h100_gpu_burn" if args.cpu else "off"
    work = Path(tempfile.mkdtemp(prefix="gpu-truth-demo-"))
    command = [sys.executable, "-m", "seedancectl.cli", "demo", "--minutes", str(args.minutes),
               "--nvml-trace", trace, "--out", str(work)]
    part.data["command"] = " ".join(command[1:])
    start = time.monotonic()
    with part.attempt("demo"):
        log = (args.out / "demo.log")
        args.out.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as f:
            rc = run_demo(command, f, args.timeout_s)
        part.data["exit_code"] = rc
        if rc:
            raise RuntimeError(f"seedancectl demo exited with {rc}; see demo.log")
    part.data["wall_s"] = time.monotonic() - start
    with part.attempt("summary"):
        summary = json.loads((work / "summary.json").read_text())
        part.data["summary"] = summary
        part.data["live_nvml"] = live_gpu(summary)
    part.data.setdefault("live_nvml", check(None, 1))
    return part.write()


if __name__ == "__main__":
    main()
