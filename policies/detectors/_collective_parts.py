"""What the all-reduce readers share: the DDP comm hook's series turned into per-rank intervals.

The communication detectors (``_communication_degradation.py``, ``_tiny_buckets.py``) and load
imbalance (``_load_imbalance.py``, for each rank's time waiting in all-reduce) read the DDP comm
hook's metrics (``collectors.torch_collective``) as the store holds them: cumulative
``seedance.comm.allreduce.calls``/``bytes`` and the ``duration`` histogram's ``.count``/``.sum``.
Per export interval that gives the mean message size S and mean latency t; the ranks n come from
the ``busbw``/``algbw`` gauges (their ratio is 2(n-1)/n), so the bus bandwidth is
S x 2(n-1)/n / t, as nccl-tests defines it. Where no link peak is configured, the GPU's NVLink
peak per direction (:data:`NVLINK_PEAK_BYTES_PER_S`) stands in for NVLink models.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from collectors.names import (
    ATTR_HW_NAME,
    ATTR_SEEDANCE_RANK,
    COMM_ALLREDUCE_ALGBW,
    COMM_ALLREDUCE_BUSBW,
    COMM_ALLREDUCE_BYTES,
    COMM_ALLREDUCE_CALLS,
    COMM_ALLREDUCE_DURATION_COUNT,
    COMM_ALLREDUCE_DURATION_SUM,
    HW_GPU_UP,
)
from policies._window import StoreWindow
from policies.detectors._series import interval_increases, latest_version

CALLS = COMM_ALLREDUCE_CALLS
BYTES = COMM_ALLREDUCE_BYTES
DURATION_COUNT = COMM_ALLREDUCE_DURATION_COUNT
DURATION_SUM = COMM_ALLREDUCE_DURATION_SUM
ALGBW = COMM_ALLREDUCE_ALGBW
BUSBW = COMM_ALLREDUCE_BUSBW
RANK = ATTR_SEEDANCE_RANK

# Per-direction NVLink bandwidth per GPU (half the datasheets' bidirectional totals):
# A100 SXM NVLink3 600 GB/s, H100/H200 SXM NVLink4 900 GB/s (A100 and H100 datasheets),
# A40 NVLink bridge 112.5 GB/s (A40 datasheet, 2 GPUs).
NVLINK_PEAK_BYTES_PER_S: tuple[tuple[re.Pattern[str], float], ...] = (
    (re.compile(r"A100(?!.*PCI)", re.I), 300e9),
    (re.compile(r"H[12]00(?!.*PCI)(?!.*NVL)", re.I), 450e9),
    (re.compile(r"A40\b", re.I), 56.25e9),
)


def nvlink_peak_bytes_per_s(device_name: str) -> float | None:
    """Per-direction NVLink peak of an NVLink GPU model (NVML name), else None."""
    for pattern, peak in NVLINK_PEAK_BYTES_PER_S:
        if pattern.search(device_name):
            return peak
    return None


def _bus_factor(window: StoreWindow, ranks_seen: int) -> float:
    """2(n-1)/n from the busbw/algbw gauges; from the ranks seen when the gauges are absent."""
    bus, alg = window.query(BUSBW), window.query(ALGBW)
    if not bus.empty and not alg.empty:
        alg_v = alg["value"].to_numpy(dtype=np.float64)
        bus_v = bus["value"].to_numpy(dtype=np.float64)[: alg_v.size]
        ok = alg_v[: bus_v.size] > 0
        if ok.any():
            return float(np.median(bus_v[ok] / alg_v[: bus_v.size][ok]))
    n = max(ranks_seen, 1)
    return 2 * (n - 1) / n if n > 1 else 1.0


def collective_intervals(window: StoreWindow) -> pd.DataFrame:
    """Per rank and export interval: time, calls, bytes, latency_s (mean per call), busbw.

    Uses the newest config version only. Empty when the hook's counters are missing.
    """
    frames = {name: latest_version(window.query(name))
              for name in (CALLS, BYTES, DURATION_COUNT, DURATION_SUM)}
    if any(f.empty for f in frames.values()):
        return pd.DataFrame()
    rows = []
    for (rank, calls), (_, sent), (_, count), (_, total) in zip(
            *(per_rank(frames[n]) for n in (CALLS, BYTES, DURATION_COUNT, DURATION_SUM)),
            strict=False):
        parts = [interval_increases(f) for f in (calls, sent, count, total)]
        n = min(len(p) for p in parts)
        for k in range(n):
            d_calls, d_bytes, d_count, d_sum = (float(p["delta"].iloc[k]) for p in parts)
            if not (d_calls > 0 and d_count > 0 and d_sum > 0 and math.isfinite(d_bytes)):
                continue  # nothing counted, or missing (NaN) values: no interval
            rows.append({"rank": rank, "interval": k, "time": parts[0]["time"].iloc[k],
                         "calls": d_calls,
                         "bytes": d_bytes, "message_bytes": d_bytes / d_calls,
                         "latency_s": d_sum / d_count})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    factor = _bus_factor(window, out["rank"].nunique())
    out["busbw"] = out["message_bytes"] * factor / out["latency_s"]
    out.attrs["bus_factor"] = factor
    return out.sort_values(["time", "rank"], kind="stable").reset_index(drop=True)


def per_rank(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Each rank's rows of ``frame`` (one rank "0" when the series carry no rank)."""
    if RANK not in frame.columns:
        return [("0", frame)]
    return [(str(r), rows.reset_index(drop=True)) for r, rows in frame.groupby(RANK)]


def device_name(window: StoreWindow) -> str:
    """The GPU model (NVML name) the job reports, "" when it reports none."""
    frame = window.query(HW_GPU_UP)
    if frame.empty or ATTR_HW_NAME not in frame.columns:
        return ""
    return str(frame[ATTR_HW_NAME].iloc[-1])


def ranks_from_factor(factor: float) -> int:
    """The ranks n whose bus factor 2(n-1)/n is ``factor``."""
    return max(1, round(2 / (2 - factor))) if factor < 2 else 1
