"""A torch job's fingerprint (``collectors.JobFingerprint``), measured in the job at attach.

The fleet priors warm-start a new job's search from the configs kept by the past jobs most
like it; this says what "like it" is made of: the leaf module classes and their counts (the
model's family: convolutions and batch norms, or attention and RMSNorm), the parameter count,
the device model, the world size and which lower precisions the device runs fast. Imports
torch, so only a job imports it. Cheap: one walk over the modules, and the matmul speed-ups
the session measures anyway (cached per device model).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import torch
from torch import nn

from collectors._fingerprint import FAST_DTYPES, JobFingerprint
from collectors._matmul_speedups import FAST_SPEEDUP, device_model, dtype_speedups
from collectors.torch_training import _unwrap


def module_histogram(model: nn.Module) -> dict[str, int]:
    """Leaf module class name -> how many the model holds (containers are not counted: a
    ``Sequential`` says how the author wrote it, not what it computes)."""
    counts = collections.Counter(type(m).__name__ for m in _unwrap(model).modules()
                                 if next(m.children(), None) is None)
    return dict(counts)


def job_fingerprint(model: nn.Module, *, world_size: int = 1,
                    speedups: Mapping[str, float] | None = None) -> JobFingerprint:
    """The fingerprint of a job training or serving ``model`` on ``world_size`` ranks.

    ``speedups``: each precision's matmul speed relative to fp32 on the model's device
    (``dtype_speedups``; measured, or read from its cache, when not given); a precision at
    least ``FAST_SPEEDUP`` faster is fast.
    """
    model = _unwrap(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if speedups is None:
        speedups = dtype_speedups(device)
    unique = {id(p): p.numel() for p in model.parameters()}
    return JobFingerprint(
        modules=module_histogram(model), params=sum(unique.values()),
        device=device_model(device), world_size=world_size,
        fast_dtypes=tuple(d for d in FAST_DTYPES if speedups.get(d, 0.0) >= FAST_SPEEDUP))
