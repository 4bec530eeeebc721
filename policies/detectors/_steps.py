"""Reading training telemetry per optimizer step, and histogram totals over a window.

The training instrumentation sets synchronous gauges once per step, and the OpenTelemetry SDK
re-exports a gauge's last value at every collection (cumulative temporality). So a store holds
one reading per export, not per step: a slow step is seen several times, and with exports
slower than steps some steps are never seen. :func:`per_step` pairs each reading with the
``seedance.train.step`` gauge of the same collection and keeps one reading per step, so rules
that count steps (the seed's gradient-collapse rule) count steps and not exports. For the exact
per-step rule the job must export at least once a step (``export_interval_s`` <= step time).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from collectors import CONFIG_VERSION_ATTR
from collectors.names import (
    ATTR_SEEDANCE_MODULE_GROUP,
    ATTR_SEEDANCE_RANK,
    TRAIN_DATA_WAIT_DURATION,
    TRAIN_GRAD_GROUP_NORM,
    TRAIN_GRAD_NONFINITE,
    TRAIN_GRAD_NORM,
    TRAIN_GRAD_SCALER_SCALE,
    TRAIN_GRAD_ZERO_FRACTION,
    TRAIN_LEARNING_RATE,
    TRAIN_LOSS,
    TRAIN_STEP,
    TRAIN_STEP_DURATION,
    TRAIN_TOKENS_PER_SECOND,
)
from policies._window import StoreWindow
from policies.detectors._series import increase

RANK_ATTR = ATTR_SEEDANCE_RANK
MODULE_GROUP_ATTR = ATTR_SEEDANCE_MODULE_GROUP
"""Attribute of per-group gradient metrics (``collectors.torch_training.MODULE_GROUP_ATTR``)."""
PRECISION_ATTR = "seedance.precision"
"""Optional attribute: the precision a point was measured under (fp32, bf16, fp16, fp8), for
the whole job or, on per-group gradient metrics, for that group."""
BATCH_SIZE_ATTR = "seedance.batch_size"
"""Optional attribute: samples per optimizer step on this rank when the point was measured."""
REDUCED_PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp8")

STEP = TRAIN_STEP
STEP_DURATION = TRAIN_STEP_DURATION
DATA_WAIT = TRAIN_DATA_WAIT_DURATION
LOSS = TRAIN_LOSS
GRAD_NORM = TRAIN_GRAD_NORM
GROUP_NORM = TRAIN_GRAD_GROUP_NORM
ZERO_FRACTION = TRAIN_GRAD_ZERO_FRACTION
NONFINITE = TRAIN_GRAD_NONFINITE
SCALE = TRAIN_GRAD_SCALER_SCALE
TOKENS_PER_S = TRAIN_TOKENS_PER_SECOND
LEARNING_RATE = TRAIN_LEARNING_RATE


def attribute_columns(frame: pd.DataFrame) -> list[str]:
    """The attribute columns of a store frame (all but ``time`` and ``value``)."""
    return [c for c in frame.columns if c not in ("time", "value", "step")]


def per_step(window: StoreWindow, name: str) -> pd.DataFrame:
    """Readings of gauge ``name`` with a ``step`` column, one per step and series, by time.

    Time orders them, not the step index, which restarts with the job. Without
    ``seedance.train.step`` points in the window every reading is kept, with ``step`` NaN.
    Readings that no step reading shares a collection with are dropped.
    """
    frame = window.query(name)
    if frame.empty:
        return frame.assign(step=pd.Series(dtype="float64"))
    steps = window.query(STEP)
    if steps.empty:
        return frame.assign(step=float("nan"))
    keys = [c for c in (RANK_ATTR, CONFIG_VERSION_ATTR)
            if c in frame.columns and c in steps.columns]
    paired = frame.merge(
        steps[["time", *keys, "value"]].rename(columns={"value": "step"})
        .drop_duplicates(["time", *keys]),
        on=["time", *keys], how="inner")
    paired = paired.drop_duplicates([*attribute_columns(frame), "step"], keep="first")
    return paired.sort_values("time", kind="stable").reset_index(drop=True)


def by(frame: pd.DataFrame, columns: Sequence[str]) -> list[tuple[dict[str, str], pd.DataFrame]]:
    """Split ``frame`` by the ``columns`` it has: (values of those columns, rows)."""
    present = [c for c in columns if c in frame.columns]
    if frame.empty:
        return []
    if not present:
        return [({}, frame)]
    out = []
    for values, rows in frame.groupby(present, dropna=False, sort=True):
        values = values if isinstance(values, tuple) else (values,)
        key = {c: str(v) for c, v in zip(present, values, strict=True) if isinstance(v, str)}
        out.append((key, rows.reset_index(drop=True)))
    return out


def histogram_totals(window: StoreWindow, name: str, group: Sequence[str]) -> pd.DataFrame:
    """Seconds and observations a histogram gained in the window, summed per ``group`` values.

    Each histogram series is cumulative (``NAME.sum``, ``NAME.count``); what it gained is the
    increase of its points inside the window (the first point is the baseline), summed over
    series that share the ``group`` attributes. Columns: the group attributes present, ``sum``
    and ``count``.
    """
    totals: dict[tuple[str, ...], list[float]] = {}
    columns: list[str] = []
    for part, index in ((".sum", 0), (".count", 1)):
        frame = window.query(name + part)
        if frame.empty:
            continue
        columns = [c for c in group if c in frame.columns]
        for _, rows in by(frame, attribute_columns(frame)):
            key = tuple(str(rows[c].iloc[0]) for c in columns)
            totals.setdefault(key, [0.0, 0.0])[index] += increase(rows)
    return pd.DataFrame([{**dict(zip(columns, k, strict=True)), "sum": s, "count": n}
                         for k, (s, n) in totals.items()],
                        columns=[*columns, "sum", "count"])
