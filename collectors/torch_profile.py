"""Where a step's forward time goes, and what each dtype's matmul buys on this device.

These are the inputs of the compute-aware priors (``policies.detectors.ComputePriorsDetector``):
a group that holds most of the forward time and computes in fp32 on a device where bf16
matmuls are measured faster is the first thing worth trying. This module imports torch, so
only a job imports it.

- :func:`dtype_speedups`: a matmul micro-benchmark (fp32, bf16, fp16, and fp8 where the device
  has scaled fp8 matmuls) giving each dtype's speed relative to fp32, cached per device model.
- :class:`ModuleGroupProfiler`: every ``every_n_steps`` steps (and the first), forward hooks
  time each module group, each repeated block (``blocks.N``, ``layers.N``) and the root
  forward; they also note the order in which groups first run and the dtypes their parameters
  have while they run. The hooks exist only for a sampled step, so other steps cost nothing.

Usage, with the groups of the ``precision.<group>`` knobs (``Session.precision_groups``)::

    profiler = ModuleGroupProfiler(model, session.precision_groups, meter,
                                   config_version=lambda: session.version)
    for i, batch in enumerate(batches):
        with profiler.step(i):
            loss = model(batch); loss.backward(); optimizer.step()
    profiler.close()

Not for a ``torch.compile``-d model: hooks added and removed every sampled step change what
Dynamo traced.

This module is the public face; the code lives in ``_matmul_speedups`` (the benchmark and its
cache), ``_forward_profile`` (settings, result, group matching) and ``_group_profiler`` (hooks).
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
