"""One shape for every GPU-truth JSON: who measured (device, driver, torch, time), what was
compared to what (``check``), and what failed (``Part.attempt``), so one reader reads them all.

Without a GPU a part runs only in a labelled CPU mode (``simulated``), so a test exercises the
same code and nobody mistakes its figures for the GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NO_GPU = "no GPU: CPU mode, simulated; these figures are not the GPU's"


def environment(*, simulated: bool) -> dict[str, Any]:
    """Device name, driver, torch and CUDA versions and the time; each read that fails says so
    instead of failing the part."""
    env: dict[str, Any] = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "python": platform.python_version(), "host": platform.node(),
                           "simulated": simulated}
    if simulated:
        env["label"] = NO_GPU
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name(0)
            env["compute_capability"] = list(torch.cuda.get_device_capability(0))
        else:
            env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    except Exception as e:  # noqa: BLE001 - the header reports, it never fails the part
        env["torch_error"] = f"{type(e).__name__}: {e}"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
            env["nvml_device"] = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - no NVML is a fact to record, not a failure
        env["nvml_error"] = f"{type(e).__name__}: {e}"
    return env


def check(value: float | None, target: float, *, at_most: bool = False,
          peer: str = "") -> dict[str, Any]:
    """A measured figure against its target: ``met`` is None when nothing was measured."""
    met = None if value is None else (value <= target if at_most else value >= target)
    out: dict[str, Any] = {"value": value, "target": target,
                           "op": "<=" if at_most else ">=", "met": met}
    if peer:
        out["compared_to"] = peer
    return out


class Part:
    """One part's result: measurements go in ``data``, failed steps in ``errors``; ``write``
    stamps the environment and writes ``OUT/<name>.json``."""

    def __init__(self, name: str, out: Path, *, simulated: bool) -> None:
        self.name = name
        self.out = Path(out)
        self.simulated = simulated
        self.data: dict[str, Any] = {}
        self.errors: dict[str, str] = {}

    @contextlib.contextmanager
    def attempt(self, step: str) -> Iterator[None]:
        """Run one measurement; an exception is recorded under ``step`` and the part goes on."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - recorded, and the next measurement still runs
            self.errors[step] = f"{type(e).__name__}: {e}"
            traceback.print_exc()

    def write(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{self.name}.json"
        doc = {"part": self.name, "environment": environment(simulated=self.simulated),
               **self.data, "errors": self.errors}
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"{self.name}: {len(self.errors)} error(s) -> {path}", flush=True)
        return path


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every part takes: ``--out`` and ``--cpu`` (the labelled CPU mode)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for <part>.json")
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: run on CPU, every output labelled simulated")
    return p


def record_failure(argv: list[str] | None = None) -> Path:
    """``python -m bench.gpu_truth._record PART RC LOG --out DIR``: the part's process died or
    ran out of time (RC 124), so its JSON says so, with the end of its log."""
    p = argparse.ArgumentParser(description="record a part that failed")
    p.add_argument("part")
    p.add_argument("rc", type=int)
    p.add_argument("log", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    part = Part(args.part, args.out, simulated=args.cpu)
    previous = args.out / f"{args.part}.json"
    if previous.exists():  # it wrote some figures before it died: keep them
        with contextlib.suppress(ValueError):
            kept = json.loads(previous.read_text())
            part.errors.update(kept.pop("errors", {}))
            part.data.update({k: v for k, v in kept.items() if k not in ("part", "environment")})
    why = "timed out" if args.rc in (124, 137) else f"exited with code {args.rc}"
    tail = args.log.read_text(errors="replace")[-2000:] if args.log.exists() else ""
    part.errors["process"] = f"{why}; log tail: {tail}"
    return part.write()


if __name__ == "__main__":
    record_failure()
