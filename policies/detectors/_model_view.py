"""What the job's profiler says about its module groups, as the job sees them: the order they
run in and the dtypes they compute in (``collectors.torch_profile``).

Detectors read this instead of trusting the tuner's knobs: a user who cast a group by hand, or
ran it under autocast, changed what it computes in without touching ``precision.<group>``.
"""

from __future__ import annotations

import pandas as pd

from collectors import CONFIG_VERSION_ATTR
from collectors.names import (
    ATTR_SEEDANCE_DTYPE,
    ATTR_SEEDANCE_DTYPE_SOURCE,
    TRAIN_GROUP_FORWARD_RANK,
    TRAIN_GROUP_PARAM_DTYPE,
)
from policies._window import StoreWindow
from policies.detectors._steps import MODULE_GROUP_ATTR

GROUP_DTYPE = TRAIN_GROUP_PARAM_DTYPE
GROUP_FORWARD_RANK = TRAIN_GROUP_FORWARD_RANK
DTYPE_ATTR = ATTR_SEEDANCE_DTYPE
DTYPE_SOURCE_ATTR = ATTR_SEEDANCE_DTYPE_SOURCE
PRECISION_OF_DTYPE: dict[str, str] = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}
"""Dtype names as the profiler exports them -> ``precision.<group>`` knob values."""


def computes_in(window: StoreWindow, version: float | None = None) -> dict[str, set[str]]:
    """Group -> the precisions (or raw dtype names) it computed in: under ``version``, or, with
    none given, on the newest profiled step of each group. Where autocast was on, its dtype
    (autocast computes matmuls in it whatever the parameters hold); else the parameters'."""
    frame = window.query(GROUP_DTYPE)
    if frame.empty or not {MODULE_GROUP_ATTR, DTYPE_ATTR} <= set(frame.columns):
        return {}
    if version is not None and CONFIG_VERSION_ATTR in frame.columns:
        frame = frame[pd.to_numeric(frame[CONFIG_VERSION_ATTR], errors="coerce") == version]
    elif version is None and "time" in frame.columns:
        newest = frame.groupby(MODULE_GROUP_ATTR)["time"].transform("max")
        frame = frame[frame["time"] == newest]
    sources = (frame[DTYPE_SOURCE_ATTR].astype(str) if DTYPE_SOURCE_ATTR in frame.columns
               else pd.Series("parameters", index=frame.index))
    out: dict[str, set[str]] = {}
    autocast: dict[str, set[str]] = {}
    for group, dtype, source in zip(frame[MODULE_GROUP_ATTR], frame[DTYPE_ATTR], sources,
                                    strict=True):
        into = autocast if source == "autocast" else out
        into.setdefault(str(group), set()).add(PRECISION_OF_DTYPE.get(str(dtype), str(dtype)))
    return {**out, **autocast}  # autocast decides what its matmuls compute in


def single_precisions(window: StoreWindow) -> dict[str, str]:
    """Group -> the one precision it computes in now (groups in mixed dtypes left out)."""
    return {g: next(iter(p)) for g, p in computes_in(window).items() if len(p) == 1}


def forward_order(window: StoreWindow) -> tuple[str, ...]:
    """Module groups from input to loss, by the newest ``forward_rank`` of each."""
    frame = window.query(GROUP_FORWARD_RANK)
    if frame.empty or MODULE_GROUP_ATTR not in frame.columns:
        return ()
    if "time" in frame.columns:
        frame = frame.sort_values("time", kind="stable")
    last = frame.groupby(MODULE_GROUP_ATTR).tail(1).sort_values("value", kind="stable")
    return tuple(str(g) for g in last[MODULE_GROUP_ATTR])
