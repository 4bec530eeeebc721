"""Small frame helpers the hardware, communication and balance detectors share."""

from __future__ import annotations

import numpy as np
import pandas as pd

from collectors.names import ATTR_SEEDANCE_CONFIG_VERSION


def increase(frame: pd.DataFrame) -> float:
    """How much a cumulative counter grew over the frame's points (one series, time-sorted).

    A drop is a restart of the counter (the process came back): the value after it counts from
    zero, as Prometheus' ``increase`` treats resets.
    """
    values = frame["value"].to_numpy(dtype=np.float64)
    if values.size < 2:
        return 0.0
    steps = np.diff(values)
    return float(np.where(steps >= 0, steps, values[1:]).sum())


def interval_increases(frame: pd.DataFrame) -> pd.DataFrame:
    """Per export interval of one cumulative series: ``time`` (interval end) and ``delta``."""
    values = frame["value"].to_numpy(dtype=np.float64)
    if values.size < 2:
        return pd.DataFrame({"time": frame["time"].iloc[0:0], "delta": np.empty(0)})
    steps = np.diff(values)
    return pd.DataFrame({"time": frame["time"].iloc[1:].to_numpy(),
                         "delta": np.where(steps >= 0, steps, values[1:])})


def latest_version(frame: pd.DataFrame, column: str = ATTR_SEEDANCE_CONFIG_VERSION) -> pd.DataFrame:
    """The rows measured under the newest config version in the frame (all rows if untagged).

    A window that straddles a config change is judged on the config in force now.
    """
    if column not in frame.columns or frame.empty:
        return frame
    versions = pd.to_numeric(frame[column], errors="coerce")
    if versions.isna().all():
        return frame
    return frame[versions == versions.max()].reset_index(drop=True)
