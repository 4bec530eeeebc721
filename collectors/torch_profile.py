"""Where a step's forward time goes, and what each dtype's matmul buys on this device.

The inputs of the compute-aware priors (``policies.detectors.ComputePriorsDetector``):
:func:`dtype_speedups` (a matmul micro-benchmark per dtype, cached per device model) and
:class:`ModuleGroupProfiler` (forward hooks that time each module group on sampled steps only).
It imports torch, so only a job imports it; not for a ``torch.compile``-d model. Usage::

    profiler = ModuleGroupProfiler(model, session.precision_groups, meter,
                                   config_version=lambda: session.version)
    for i, batch in enumerate(batches):
        with profiler.step(i):
            loss = model(batch); loss.backward(); optimizer.step()
    profiler.close()

docs/tuning.md, 'Profiling the forward' explains what is timed and where the code lives.
"""

from __future__ import annotations

from collectors._forward_profile import (
    ForwardProfile,
    ProfileError,
    ProfilerConfig,
    repeated_blocks,
)
from collectors._group_profiler import (
    BLOCK_ATTR,
    DEVICE_MODEL_ATTR,
    DTYPE_ATTR,
    DTYPE_SOURCE_ATTR,
    ModuleGroupProfiler,
)
from collectors._matmul_speedups import (
    CACHE_ENV,
    FAST_SPEEDUP,
    PRECISION_DTYPES,
    device_model,
    dtype_name,
    dtype_speedups,
)

__all__ = [
    "BLOCK_ATTR",
    "CACHE_ENV",
    "DEVICE_MODEL_ATTR",
    "DTYPE_ATTR",
    "DTYPE_SOURCE_ATTR",
    "FAST_SPEEDUP",
    "PRECISION_DTYPES",
    "ForwardProfile",
    "ModuleGroupProfiler",
    "ProfileError",
    "ProfilerConfig",
    "device_model",
    "dtype_name",
    "dtype_speedups",
    "repeated_blocks",
]
