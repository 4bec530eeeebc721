"""nvidia-smi ``--query-gpu`` CSV against the project's raw NVML polls, second by second.

nvidia-smi writes its header with units in brackets (``power.draw [W]``) and, without
``nounits``, values with units (``69.85 W``); both forms parse. Readings that nvidia-smi and the
live backend both give are compared in nvidia-smi's units, per wall-clock second: the samples of
each side inside one second are averaged, and the per-field figure is the median absolute
difference over the seconds both sides have.
"""

from __future__ import annotations

import csv
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

QUERY = ("timestamp", "utilization.gpu", "utilization.memory", "memory.used", "power.draw",
         "clocks.sm", "clocks.mem", "temperature.gpu")
"""The ``--query-gpu`` fields asked for, in order (timestamp first)."""

# nvidia-smi field -> (raw NVML field as the backend keys it, factor into nvidia-smi's unit)
COMPARED: dict[str, tuple[str, float]] = {
    "utilization.gpu": ("nvmlDeviceGetUtilizationRates.gpu", 1.0),
    "utilization.memory": ("nvmlDeviceGetUtilizationRates.memory", 1.0),
    "memory.used": ("nvmlDeviceGetMemoryInfo.used", 1 / 2**20),  # bytes -> MiB
    "power.draw": ("nvmlDeviceGetPowerUsage", 1e-3),  # mW -> W
    "clocks.sm": ("nvmlDeviceGetClockInfo.SM", 1.0),
    "clocks.mem": ("nvmlDeviceGetClockInfo.MEM", 1.0),
    "temperature.gpu": ("nvmlDeviceGetTemperature.GPU", 1.0),
}
ALIASES = {"clocks.current.sm": "clocks.sm", "clocks.current.memory": "clocks.mem"}
"""Long names nvidia-smi prints in a header for the short ones asked for."""

_UNIT = re.compile(r"\s*\[[^\]]*\]$")
_VALUE = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)(?:\s*\S+)?\s*$")


def smi_command(interval_ms: int = 500) -> list[str]:
    """The nvidia-smi command whose output ``parse_csv`` reads (header kept, units dropped)."""
    return ["nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv,nounits",
            f"--loop-ms={interval_ms}"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading time (Unix seconds) and the numeric fields read then."""

    t_s: float
    values: Mapping[str, float]


def _name(header: str) -> str:
    name = _UNIT.sub("", header.strip())
    return ALIASES.get(name, name)


def _number(text: str) -> float | None:
    match = _VALUE.match(text)
    return float(match.group(1)) if match else None  # "[N/A]", "[Not Supported]" -> None


def parse_timestamp(text: str) -> float:
    """nvidia-smi's ``2026/07/14 08:12:38.696`` (the machine's local time) as Unix seconds."""
    return datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()


def parse_csv(lines: Iterable[str]) -> list[Sample]:
    """Rows of ``--query-gpu=timestamp,... --format=csv[,nounits]`` output, header first;
    repeated headers (a restarted loop) and rows that do not parse are skipped."""
    header: list[str] | None = None
    samples = []
    for row in csv.reader((line for line in lines if line.strip()), skipinitialspace=True):
        if row and _name(row[0]) == "timestamp":
            header = [_name(h) for h in row]
            continue
        if header is None or len(row) != len(header):
            continue
        try:
            t_s = parse_timestamp(row[0])
        except ValueError:
            continue
        values = {h: v for h, v in ((h, _number(x)) for h, x in zip(header[1:], row[1:],
                                                                    strict=True))
                  if v is not None}
        samples.append(Sample(t_s, values))
    return samples


def nvml_samples(polls: Sequence[tuple[int, Mapping[int, Mapping[str, Any]]]],
                 gpu: int = 0) -> list[Sample]:
    """(time_ns, {index: readings}) polls of the backend as samples in nvidia-smi's units."""
    samples = []
    for time_ns, gpus in polls:
        readings = gpus.get(gpu, {})
        values = {smi: float(readings[raw]) * factor for smi, (raw, factor) in COMPARED.items()
                  if isinstance(readings.get(raw), int | float)}
        samples.append(Sample(time_ns / 1e9, values))
    return samples


def _per_second(samples: Iterable[Sample], field: str) -> dict[int, float]:
    buckets: dict[int, list[float]] = {}
    for s in samples:
        if field in s.values:
            buckets.setdefault(int(s.t_s), []).append(s.values[field])
    return {second: statistics.fmean(v) for second, v in buckets.items()}


def compare(nvml: Sequence[Sample], smi: Sequence[Sample]) -> dict[str, dict[str, Any]]:
    """Per compared field: seconds both sides hold, median |NVML - nvidia-smi| over them (in
    nvidia-smi's unit), and each side's median, so a constant offset reads as one."""
    out: dict[str, dict[str, Any]] = {}
    for field in COMPARED:
        ours, theirs = _per_second(nvml, field), _per_second(smi, field)
        common = sorted(ours.keys() & theirs.keys())
        if not common:
            out[field] = {"seconds": 0, "median_abs_diff": None,
                          "nvml_samples": len(ours), "smi_samples": len(theirs)}
            continue
        out[field] = {
            "seconds": len(common),
            "median_abs_diff": statistics.median(abs(ours[s] - theirs[s]) for s in common),
            "nvml_median": statistics.median(ours[s] for s in common),
            "smi_median": statistics.median(theirs[s] for s in common),
        }
    return out
