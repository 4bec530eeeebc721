"""How far apart two jobs are, by their fingerprints, for the fleet priors.

A past job's kept config is a good first trial for a new job when the two spend their time
alike: the same kinds of layers in a similar mix, a similar size, on the same kind of device
and number of ranks, with the same fast precisions. The distance (0 = alike) adds:

- the model family, from the leaf module classes (``module_distance``): the mean of the
  Jaccard distance of the two sets of classes (which kinds of layers) and the cosine distance
  of their log counts (the mix; a log, so a deeper model of the same family, which repeats
  its blocks, stays near, and a model of Linear layers with a few norms is not taken for a
  plain MLP). In [0, 1];
- ``PARAM_BUCKET_PENALTY`` per half decade of parameters between them (a 10x bigger model
  is 0.1 further);
- ``DEVICE_PENALTY`` for another device model, ``WORLD_SIZE_PENALTY`` for another world
  size, ``DTYPE_PENALTY`` per lower precision fast on one device and not on the other.

A past job is near when its distance is under ``NEAR_DISTANCE``. On the five model families
of ``workloads.families`` on one CPU, two sizes of a family (1-2 buckets apart) are 0.05-0.10
apart, two families at least 0.43 (mlp and wide_transformer, both mostly Linear layers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from collectors import JobFingerprint

PARAM_BUCKET_PENALTY = 0.05
DEVICE_PENALTY = 0.15
WORLD_SIZE_PENALTY = 0.1
DTYPE_PENALTY = 0.05
NEAR_DISTANCE = 0.25
"""A past job this close or closer (exclusive) is near enough for its kept config to be
tried first: a size or two of one family on one device, not another family."""


def module_distance(a: Mapping[str, int], b: Mapping[str, int]) -> float:
    """The model-family part of the distance, in [0, 1] (module docstring)."""
    kinds = set(a) | set(b)
    if not kinds:
        return 0.0
    jaccard = 1.0 - len(set(a) & set(b)) / len(kinds)
    va = {k: math.log1p(a.get(k, 0)) for k in kinds}
    vb = {k: math.log1p(b.get(k, 0)) for k in kinds}
    norm = math.sqrt(sum(v * v for v in va.values()) * sum(v * v for v in vb.values()))
    cosine = 1.0 - sum(va[k] * vb[k] for k in kinds) / norm if norm else 1.0
    return 0.5 * (jaccard + max(0.0, cosine))


def fingerprint_distance(a: JobFingerprint, b: JobFingerprint) -> float:
    """How far apart two jobs are (0: alike); near when under ``NEAR_DISTANCE``."""
    return (module_distance(a.modules, b.modules)
            + PARAM_BUCKET_PENALTY * abs(a.param_bucket - b.param_bucket)
            + DEVICE_PENALTY * (a.device != b.device)
            + WORLD_SIZE_PENALTY * (a.world_size != b.world_size)
            + DTYPE_PENALTY * len(set(a.fast_dtypes) ^ set(b.fast_dtypes)))
