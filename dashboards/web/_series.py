"""The series behind a change's evidence plot: the metric that triggered it, read from the store.

Which metric: the change's ``meta["metric"]`` when its proposer named one (a detector's input,
say), else the job's throughput, ``seedance.train.tokens_per_second``, the number every change is
judged by. The page draws the points as inline SVG; the server only selects and thins them, so a
week of history never ships thousands of points to a browser.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from collectors import BY_NAME, CONFIG_VERSION_ATTR, StoreReader
from tuner import ACTIVE, JOB_ATTR, TOKENS_PER_SECOND, Change

LOOKBACK_S = 600.0
"""How far before the proposal the plot starts: the stretch the trigger was seen in."""
AFTER_LAST_WINDOW_S = 60.0
"""How far past its last measured window a finished change's plot runs."""
MAX_POINTS = 240
"""Points per line at most; more are averaged into equal time buckets."""
_HIDDEN_ATTRS = frozenset({JOB_ATTR, CONFIG_VERSION_ATTR})
"""Attributes that do not split a line: the job is fixed and each version is its own series."""
_ROLLUP_ONLY = ("min", "max", "count", "last")


def triggering_metric(change: Change) -> tuple[str, str]:
    """The metric to plot for ``change`` and where that choice came from ("change"|"default")."""
    named = change.meta.get("metric")
    if isinstance(named, str) and named:
        return named, "change"
    return TOKENS_PER_SECOND, "default"


def change_series(change: Change, reader: StoreReader, *, now_s: float,
                  lookback_s: float = LOOKBACK_S, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The JSON body of ``GET /v1/changes/{id}/series`` (contract: dashboards/web/README.md)."""
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    metric, metric_from = triggering_metric(change)
    since_s = change.created_at_s - lookback_s
    ends = [w.end_ns / 1e9 for w in change.windows]
    until_s = now_s if change.state in ACTIVE or not ends else max(ends) + AFTER_LAST_WINDOW_S
    frame = reader.query(metric, where={JOB_ATTR: change.job}, since_ns=int(since_s * 1e9),
                         until_ns=int(until_s * 1e9))
    spec = BY_NAME.get(metric)
    return {
        "change_id": change.id, "job": change.job, "metric": metric, "metric_from": metric_from,
        "unit": spec.unit if spec is not None else "", "since_s": since_s, "until_s": until_s,
        "series": _lines(frame, max_points),
        "marks": [{"t_s": change.created_at_s, "label": "proposed"},
                  *([{"t_s": float(change.plan["applied_at_s"]), "label": "applied"}]
                    if "applied_at_s" in change.plan else [])],
        "windows": [*({"arm": w.arm, "version": w.version, "start_s": w.start_ns / 1e9,
                       "end_s": w.end_ns / 1e9, "running": False} for w in change.windows),
                    *_running_window(change, until_s)],
    }


def _running_window(change: Change, until_s: float) -> list[dict[str, Any]]:
    """The window being measured now (acked, not yet judged), so an in-progress change's plot
    shows the arm in force up to now; none once the change is finished or before the ack."""
    plan = change.plan
    if change.state not in ACTIVE or not plan.get("acked") or "acked_at_s" not in plan:
        return []
    return [{"arm": str(plan["arms"][int(plan["index"])]), "version": int(plan["version"]),
             "start_s": float(plan["acked_at_s"]), "end_s": until_s, "running": True}]


def _lines(frame: pd.DataFrame, max_points: int) -> list[dict[str, Any]]:
    if frame.empty:
        return []
    keys = [c for c in frame.columns
            if c not in ("time", "value", *_ROLLUP_ONLY) and c not in _HIDDEN_ATTRS]
    times_s = pd.DatetimeIndex(frame["time"]).asi8 / 1e9
    values = frame["value"].to_numpy(dtype=float)
    groups: Mapping[Any, np.ndarray] = (
        frame.groupby(keys, dropna=False, sort=True).indices if keys
        else {(): np.arange(len(frame))})
    lines = []
    for group, rows in groups.items():
        labels = group if isinstance(group, tuple) else (group,)
        attributes = {k: str(v) for k, v in zip(keys, labels, strict=True) if isinstance(v, str)}
        t, v = _thin(times_s[rows], values[rows], max_points)
        lines.append({
            "label": ", ".join(f"{k}={a}" for k, a in attributes.items()) or "all",
            "attributes": attributes,
            "points": [[float(ti), float(vi) if math.isfinite(vi) else None]
                       for ti, vi in zip(t, v, strict=True)],
        })
    return lines


def _thin(t: np.ndarray, v: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points: the mean time and value of equal-time buckets.

    Non-finite values are kept as such only where a bucket has nothing else, so a NaN loss
    still shows as a gap instead of vanishing into an average."""
    order = np.argsort(t, kind="stable")
    t, v = t[order], v[order]
    if t.size <= max_points:
        return t, v
    edges = np.linspace(t[0], t[-1], max_points + 1)
    bucket = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, max_points - 1)
    finite = np.isfinite(v)
    n = np.bincount(bucket, minlength=max_points)
    n_finite = np.bincount(bucket, weights=finite, minlength=max_points)
    t_sum = np.bincount(bucket, weights=t, minlength=max_points)
    v_sum = np.bincount(bucket, weights=np.where(finite, v, 0.0), minlength=max_points)
    used = n > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_v = np.where(n_finite > 0, v_sum / n_finite, np.nan)
    return (t_sum / np.maximum(n, 1))[used], mean_v[used]
