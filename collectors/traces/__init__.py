"""Recorded NVML traces (package data) that the sampler can replay when no GPU is here.

Each ``NAME.jsonl`` was built from real nvidia-smi captures by ``build_from_captures.py``;
its header says where every value came from. Replayed points carry ``seedance.replayed``.
"""

from __future__ import annotations

from pathlib import Path

from collectors._nvml_backends import NvmlTraceError

TRACES_DIR = Path(__file__).resolve().parent


def trace_names() -> list[str]:
    """Names of the traces shipped with the package."""
    return sorted(path.stem for path in TRACES_DIR.glob("*.jsonl"))


def trace_path(name: str) -> Path:
    """A shipped trace by name (``h100_gpu_burn``), or any trace file by path."""
    given = Path(name)
    if given.suffix == ".jsonl" and given.is_file():
        return given
    path = TRACES_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise NvmlTraceError(f"no NVML trace {name!r}; shipped: {', '.join(trace_names())}")
    return path
