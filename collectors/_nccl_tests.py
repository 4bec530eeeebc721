"""Read nccl-tests output (``all_reduce_perf`` and friends) as recorded collective timings.

nccl-tests prints one row per message size: size (B), count, type, redop, root, then time
(us), algbw and busbw (GB/s) and #wrong for the out-of-place and the in-place run. Launchers
prefix lines (srun ``0: ``, mpirun ``[1,0]<stdout>:``); both are stripped. The footer
``# Avg bus bandwidth : X`` is kept when present.

:func:`nccl_tests_points` turns a sweep into the points the DDP comm hook emits (cumulative
``seedance.comm.allreduce.calls``/``bytes``, the ``duration`` histogram's ``.count``/``.sum``,
the ``algbw``/``busbw`` gauges), one export interval per row, so detectors judge a recorded
sweep exactly as a live job. Every point carries ``seedance.replayed="true"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from collectors._points import REPLAYED_ATTR, Point
from collectors.names import (
    ATTR_SEEDANCE_COMM_BACKEND,
    ATTR_SEEDANCE_RANK,
    ATTR_SERVICE_NAME,
    COMM_ALLREDUCE_ALGBW,
    COMM_ALLREDUCE_BUSBW,
    COMM_ALLREDUCE_BYTES,
    COMM_ALLREDUCE_CALLS,
    COMM_ALLREDUCE_DURATION_COUNT,
    COMM_ALLREDUCE_DURATION_SUM,
)

_PREFIX = re.compile(r"^\s*(?:\d+:\s?|\[\d+,\d+\]<std(?:out|err)>:)")
_ROW = re.compile(
    r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)"
    r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)"
    r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s*$"
)
_AVG = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([\d.]+)")
GB = 1e9  # nccl-tests prints decimal GB/s


@dataclass(frozen=True, slots=True, kw_only=True)
class NcclTestsRow:
    """One message size of a sweep: out-of-place and in-place time (s) and bandwidths (B/s)."""

    size_bytes: int
    count: int
    dtype: str
    redop: str
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    in_place_time_s: float
    in_place_algbw_bytes_per_s: float
    in_place_busbw_bytes_per_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class NcclTestsResult:
    """A parsed sweep, rows in printed order, and the printed average bus bandwidth."""

    rows: tuple[NcclTestsRow, ...]
    avg_busbw_bytes_per_s: float | None

    @property
    def world_size(self) -> int | None:
        """Ranks in the test, from busbw/algbw = 2(n-1)/n at the largest message."""
        big = max(self.rows, key=lambda r: r.size_bytes, default=None)
        if big is None or big.algbw_bytes_per_s <= 0:
            return None
        ratio = big.busbw_bytes_per_s / big.algbw_bytes_per_s
        return round(2 / (2 - ratio)) if ratio < 2 else None


def parse_nccl_tests(text: str) -> NcclTestsResult:
    """Parse nccl-tests output; lines that are not data rows are skipped."""
    rows = []
    average = None
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw, count=1)
        if (found := _AVG.search(line)) is not None:
            average = float(found.group(1)) * GB
            continue
        if (m := _ROW.match(line)) is None:
            continue
        g = m.groups()
        rows.append(NcclTestsRow(
            size_bytes=int(g[0]), count=int(g[1]), dtype=g[2], redop=g[3],
            time_s=float(g[5]) * 1e-6, algbw_bytes_per_s=float(g[6]) * GB,
            busbw_bytes_per_s=float(g[7]) * GB, in_place_time_s=float(g[9]) * 1e-6,
            in_place_algbw_bytes_per_s=float(g[10]) * GB,
            in_place_busbw_bytes_per_s=float(g[11]) * GB))
    return NcclTestsResult(rows=tuple(rows), avg_busbw_bytes_per_s=average)


def nccl_tests_points(result: NcclTestsResult, *, job: str, start_ns: int,
                      interval_s: float = 1.0, backend: str = "nccl",
                      rank: str = "0") -> list[Point]:
    """One export interval per row, as the DDP hook's metrics (replayed, see module doc).

    Interval k ends at ``start_ns + (k + 1) * interval_s``; a point at ``start_ns`` holds the
    counters at zero so the first row has an interval too.
    """
    attrs = {ATTR_SERVICE_NAME: job, ATTR_SEEDANCE_RANK: rank, ATTR_SEEDANCE_COMM_BACKEND: backend,
             REPLAYED_ATTR: "true"}
    step_ns = int(interval_s * 1e9)
    calls = sent = latency = 0.0
    points = [Point(name, 0.0, start_ns, attrs) for name in (
        COMM_ALLREDUCE_CALLS, COMM_ALLREDUCE_BYTES,
        COMM_ALLREDUCE_DURATION_COUNT, COMM_ALLREDUCE_DURATION_SUM)]
    for k, row in enumerate(result.rows):
        t = start_ns + (k + 1) * step_ns
        calls += 1
        sent += row.size_bytes
        latency += row.time_s
        points += [
            Point(COMM_ALLREDUCE_CALLS, calls, t, attrs),
            Point(COMM_ALLREDUCE_BYTES, sent, t, attrs),
            Point(COMM_ALLREDUCE_DURATION_COUNT, calls, t, attrs),
            Point(COMM_ALLREDUCE_DURATION_SUM, latency, t, attrs),
            Point(COMM_ALLREDUCE_ALGBW, row.algbw_bytes_per_s, t, attrs),
            Point(COMM_ALLREDUCE_BUSBW, row.busbw_bytes_per_s, t, attrs),
        ]
    return points
