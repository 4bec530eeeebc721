"""Build the replay traces in this folder from real nvidia-smi captures; re-runnable.

    python -m collectors.traces.build_from_captures [--captures DIR] [--out DIR]

Every value in a trace is read from a capture (see README.md here for their sources and
licences) and converted to the unit the NVML call returns (W -> mW, MiB -> bytes); the header
says, per raw field, which capture, section and column it came from. A field no capture holds
(memory bus width, NVLink counters, XID events) is recorded as unsupported, never invented.
Where a trace has several polls, the series fields come from ``nvidia-smi dmon`` (5 rows, 1 s
apart); fields that only a single ``--query-gpu``/``-q`` snapshot holds are repeated in every
poll, and the header labels them "synthesised from single snapshot".
"""

from __future__ import annotations

import argparse
import csv
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors._nvml_live import ALL_FIELDS
from collectors._nvml_trace import write_trace

CAPTURES_DIR = Path(__file__).resolve().parents[2] / "tests" / "data"  # copies, sources in its README
OUT_DIR = Path(__file__).resolve().parent

H100 = "nvidia-smi_capture_linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"
H100_MIG = "nvidia-smi_capture_linux-x86_64__nvidia-h100-mig__590.48.01.txt"
L40S = "nvidia-smi_capture_linux-x86_64__nvidia-l40s__595.80.txt"
A100 = "nvidia-smi_q-x_a100-sxm4_telegraf-testdata.xml"
ORIGIN = {
    H100: "utkuozdemir/nvidia_gpu_exporter internal/captures/ @ e656cd81 (MIT)",
    H100_MIG: "utkuozdemir/nvidia_gpu_exporter internal/captures/ @ e656cd81 (MIT)",
    L40S: "utkuozdemir/nvidia_gpu_exporter internal/captures/ @ e656cd81 (MIT)",
    A100: "influxdata/telegraf plugins/inputs/nvidia_smi/testdata/a100-sxm4-v12.xml "
          "@ 6f6d5b5b (MIT)",
}
MIB = 2**20
SINGLE = "synthesised from single snapshot (the same value in every poll)"
_MISSING = re.compile(r"^\[?(N/A|Not Supported|Requested functionality has been deprecated|-)\]?$")

Convert = Callable[[str], int | str]


def _number(text: str) -> float:
    match = re.match(r"[-+]?\d+(\.\d+)?", text)  # "69.85 W", "16x", "2619 MHz"
    if match is None:
        raise ValueError(f"no number in {text!r}")
    return float(match.group(0))


def _int(text: str) -> int:
    return int(round(_number(text)))


def _milli(text: str) -> int:
    return int(round(_number(text) * 1000))


def _mib(text: str) -> int:
    return _int(text) * MIB


def _hex(text: str) -> int:
    return int(text, 16)


# raw field -> (query-gpu column, conversion to the unit NVML returns)
QUERY_GPU: dict[str, tuple[str, Convert]] = {
    "nvmlDeviceGetName": ("name", str),
    "nvmlDeviceGetUUID": ("uuid", str),
    "nvmlDeviceGetPciInfo.busId": ("pci.bus_id", str),
    "nvmlDeviceGetUtilizationRates.gpu": ("utilization.gpu", _int),
    "nvmlDeviceGetUtilizationRates.memory": ("utilization.memory", _int),
    "nvmlDeviceGetMemoryInfo.used": ("memory.used", _mib),
    "nvmlDeviceGetMemoryInfo.total": ("memory.total", _mib),
    "nvmlDeviceGetCurrPcieLinkGeneration": ("pcie.link.gen.current", _int),
    "nvmlDeviceGetMaxPcieLinkGeneration": ("pcie.link.gen.max", _int),
    "nvmlDeviceGetCurrPcieLinkWidth": ("pcie.link.width.current", _int),
    "nvmlDeviceGetMaxPcieLinkWidth": ("pcie.link.width.max", _int),
    # NVML docs: on Ampere (except GA100) and newer, nvmlDeviceGetPowerUsage is a 1 s average.
    "nvmlDeviceGetPowerUsage": ("power.draw.average", _milli),
    "nvmlDeviceGetEnforcedPowerLimit": ("enforced.power.limit", _milli),
    "nvmlDeviceGetClockInfo.SM": ("clocks.current.sm", _int),
    "nvmlDeviceGetClockInfo.MEM": ("clocks.current.memory", _int),
    "nvmlDeviceGetClockInfo.GRAPHICS": ("clocks.current.graphics", _int),
    "nvmlDeviceGetMaxClockInfo.SM": ("clocks.max.sm", _int),
    "nvmlDeviceGetMaxClockInfo.MEM": ("clocks.max.memory", _int),
    "nvmlDeviceGetTemperature.GPU": ("temperature.gpu", _int),
    "nvmlDeviceGetCurrentClocksEventReasons": ("clocks_event_reasons.active", _hex),
    "nvmlDeviceGetTotalEccErrors.CORRECTED": ("ecc.errors.corrected.volatile.total", _int),
    "nvmlDeviceGetTotalEccErrors.UNCORRECTED": ("ecc.errors.uncorrected.volatile.total", _int),
}

# raw field -> (dmon column, conversion); dmon prints whole watts, so power keeps 1 W steps.
DMON: dict[str, tuple[str, Convert]] = {
    "nvmlDeviceGetPowerUsage": ("pwr", _milli),
    "nvmlDeviceGetTemperature.GPU": ("gtemp", _int),
    "nvmlDeviceGetUtilizationRates.gpu": ("sm", _int),
    "nvmlDeviceGetUtilizationRates.memory": ("mem", _int),
    "nvmlDeviceGetClockInfo.MEM": ("mclk", _int),
    "nvmlDeviceGetClockInfo.GRAPHICS": ("pclk", _int),
}

# raw field -> (-q line label under "PCI", conversion)
QUERY_PCIE: dict[str, tuple[str, Convert]] = {
    "nvmlDeviceGetPcieThroughput.TX_BYTES": ("Tx Throughput", _int),
    "nvmlDeviceGetPcieThroughput.RX_BYTES": ("Rx Throughput", _int),
}


@dataclass
class Built:
    """One trace being assembled: per-poll readings and errors, and per-field provenance."""

    polls: list[dict[str, Any]]
    sources: dict[str, str]

    def set(self, field: str, values: list[int | str | None], source: str) -> None:
        """Put one value per poll (None: the capture says N/A there) and say where from."""
        for poll, value in zip(self.polls, values, strict=True):
            gpu = poll["gpus"][0]
            if value is None:
                gpu["errors"][field] = "not_supported"
                gpu["readings"].pop(field, None)
            else:
                gpu["readings"][field] = value
                gpu["errors"].pop(field, None)
        self.sources[field] = source


def _new(times: list[float]) -> Built:
    return Built(polls=[{"t_s": t, "gpus": [{"index": 0, "readings": {}, "errors": {},
                                             "lost": False}]} for t in times], sources={})


def _convert(text: str, convert: Convert) -> int | str | None:
    text = text.strip()
    return None if not text or _MISSING.match(text) else convert(text)


def sections(text: str) -> dict[str, str]:
    """Split an nvidia_gpu_exporter capture into {"phase :: title": body}."""
    parts = re.split(r"^#{80}\n# ([a-z-]+ :: [^\n]+)\n(?:# \$[^\n]*\n(?:# [^\n]*\n)*)?#{80}\n",
                     text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _query_gpu(body: str) -> dict[str, str]:
    rows = list(csv.reader(body.strip().splitlines(), skipinitialspace=True))
    header = [name.split(" [")[0] for name in rows[0]]
    return dict(zip(header, rows[1], strict=True))


def _dmon(body: str) -> list[dict[str, str]]:
    lines = [line for line in body.strip().splitlines() if line.strip()]
    columns = lines[0].lstrip("#").split()
    return [dict(zip(columns, line.split(), strict=True)) for line in lines[2:]]


def from_exporter_capture(captures: Path, name: str, phase: str) -> Built:
    """A trace from one phase (idle|load) of an nvidia_gpu_exporter capture, timed by dmon."""
    parts = sections((captures / name).read_text(encoding="utf-8"))
    dmon = _dmon(parts[f"{phase} :: dmon (per-device monitor, incl. PCIe rx/tx)"])
    trace = _new([float(i) for i in range(len(dmon))])
    n = len(dmon)
    query = _query_gpu(parts[f"{phase} :: query-gpu (csv, what the exporter parses)"])
    for field, (column, convert) in QUERY_GPU.items():
        trace.set(field, [_convert(query[column], convert)] * n,
                  f"{name} :: {phase} :: query-gpu column {column}; {SINGLE}")
    q = parts[f"{phase} :: query (-q)"]
    for field, (label, convert) in QUERY_PCIE.items():
        match = re.search(rf"^\s+{label}\s+: (.+)$", q, flags=re.M)
        trace.set(field, [_convert(match.group(1), convert) if match else None] * n,
                  f"{name} :: {phase} :: query (-q) PCI / {label} (KB/s); {SINGLE}")
    topo = re.search(r"^GPU0\s+X\s+(\S+)\s+(\S+)", parts["capabilities :: topo -m"], flags=re.M)
    trace.set("nvmlDeviceGetMemoryAffinity.node",
              [_convert(topo.group(2), _int) if topo else None] * n,
              f"{name} :: capabilities :: topo -m, column NUMA Affinity; {SINGLE}")
    for field, (column, convert) in DMON.items():
        trace.set(field, [_convert(row[column], convert) for row in dmon],
                  f"{name} :: {phase} :: dmon column {column} ({n} rows, 1 s apart)")
    return trace


_A100_REASONS = {
    "clocks_event_reason_gpu_idle": 0x001,
    "clocks_event_reason_applications_clocks_setting": 0x002,
    "clocks_event_reason_sw_power_cap": 0x004,
    "clocks_event_reason_hw_slowdown": 0x008,
    "clocks_event_reason_sync_boost": 0x010,
    "clocks_event_reason_sw_thermal_slowdown": 0x020,
    "clocks_event_reason_hw_thermal_slowdown": 0x040,
    "clocks_event_reason_hw_power_brake_slowdown": 0x080,
    "clocks_event_reason_display_clocks_setting": 0x100,
}

_A100_XML: dict[str, tuple[str, Convert]] = {
    "nvmlDeviceGetName": ("product_name", str),
    "nvmlDeviceGetUUID": ("uuid", str),
    "nvmlDeviceGetPciInfo.busId": ("pci/pci_bus_id", str),
    "nvmlDeviceGetUtilizationRates.gpu": ("utilization/gpu_util", _int),
    "nvmlDeviceGetUtilizationRates.memory": ("utilization/memory_util", _int),
    "nvmlDeviceGetMemoryInfo.used": ("fb_memory_usage/used", _mib),
    "nvmlDeviceGetMemoryInfo.total": ("fb_memory_usage/total", _mib),
    "nvmlDeviceGetPcieThroughput.TX_BYTES": ("pci/tx_util", _int),
    "nvmlDeviceGetPcieThroughput.RX_BYTES": ("pci/rx_util", _int),
    "nvmlDeviceGetCurrPcieLinkGeneration": ("pci/pci_gpu_link_info/pcie_gen/current_link_gen",
                                            _int),
    "nvmlDeviceGetMaxPcieLinkGeneration": ("pci/pci_gpu_link_info/pcie_gen/max_link_gen", _int),
    "nvmlDeviceGetCurrPcieLinkWidth": ("pci/pci_gpu_link_info/link_widths/current_link_width",
                                       _int),
    "nvmlDeviceGetMaxPcieLinkWidth": ("pci/pci_gpu_link_info/link_widths/max_link_width", _int),
    # GA100: nvmlDeviceGetPowerUsage is instantaneous, which is what power_draw shows there.
    "nvmlDeviceGetPowerUsage": ("gpu_power_readings/power_draw", _milli),
    "nvmlDeviceGetEnforcedPowerLimit": ("gpu_power_readings/current_power_limit", _milli),
    "nvmlDeviceGetClockInfo.SM": ("clocks/sm_clock", _int),
    "nvmlDeviceGetClockInfo.MEM": ("clocks/mem_clock", _int),
    "nvmlDeviceGetClockInfo.GRAPHICS": ("clocks/graphics_clock", _int),
    "nvmlDeviceGetMaxClockInfo.SM": ("max_clocks/sm_clock", _int),
    "nvmlDeviceGetMaxClockInfo.MEM": ("max_clocks/mem_clock", _int),
    "nvmlDeviceGetTemperature.GPU": ("temperature/gpu_temp", _int),
}


def from_a100_xml(captures: Path) -> Built:
    """A one-poll trace from the A100 ``nvidia-smi -q -x`` document (MIG on: no utilisation)."""
    gpu = ET.parse(captures / A100).getroot().find("gpu")
    assert gpu is not None, f"{A100}: no <gpu> element"
    trace = _new([0.0])

    def text(path: str) -> str:
        node = gpu.find(path)
        return "" if node is None or node.text is None else node.text

    for field, (path, convert) in _A100_XML.items():
        trace.set(field, [_convert(text(path), convert)], f"{A100} :: <gpu>/{path}")
    active = [bit for tag, bit in _A100_REASONS.items()
              if text(f"clocks_event_reasons/{tag}") == "Active"]
    trace.set("nvmlDeviceGetCurrentClocksEventReasons", [sum(active)],
              f"{A100} :: <gpu>/clocks_event_reasons/*: bitmask of the reasons marked Active "
              "(nvml.h bit values)")
    for field, kind in (("nvmlDeviceGetTotalEccErrors.CORRECTED", "correctable"),
                        ("nvmlDeviceGetTotalEccErrors.UNCORRECTED", "uncorrectable")):
        parts = [_convert(text(f"ecc_errors/volatile/{m}_{kind}"), _int) for m in ("sram", "dram")]
        total = None if None in parts else sum(int(p) for p in parts if p is not None)
        trace.set(field, [total], f"{A100} :: <gpu>/ecc_errors/volatile/sram_{kind} + "
                                  f"dram_{kind}")
    return trace


def _finish(trace: Built) -> Built:
    """Every field no capture holds is marked unsupported, with the reason in the header."""
    for field in ALL_FIELDS:
        if field not in trace.sources:
            trace.set(field, [None] * len(trace.polls),
                      "not in the captures: left out (unsupported), never invented")
    return trace


TRACES: dict[str, tuple[str, Callable[[Path], Built], list[str]]] = {
    "h100_idle": ("H100 80GB HBM3 (SXM), idle, driver 590.48.01",
                  lambda c: from_exporter_capture(c, H100, "idle"), [H100]),
    "h100_gpu_burn": ("H100 80GB HBM3 (SXM) under gpu-burn (compute-bound) + 2 memhogs",
                      lambda c: from_exporter_capture(c, H100, "load"), [H100]),
    "h100_mig": ("H100 80GB HBM3 with MIG on (3g.40gb+2g.20gb+2x1g.10gb), gpu-burn load",
                 lambda c: from_exporter_capture(c, H100_MIG, "load"), [H100_MIG]),
    "l40s_pcie": ("L40S (PCIe only, no NVLink) under 2 NVENC ffmpeg encodes",
                  lambda c: from_exporter_capture(c, L40S, "load"), [L40S]),
    "a100_sxm4": ("A100-SXM4-80GB, MIG on, idle; one -q -x snapshot",
                  from_a100_xml, [A100]),
}


def build(captures: Path, out: Path) -> list[Path]:
    """Write every trace in ``TRACES`` to ``out``; returns the paths written."""
    written = []
    for name, (description, make, used) in TRACES.items():
        trace = _finish(make(captures))
        header: Mapping[str, Any] = {
            "trace": name,
            "description": description,
            "built_by": "collectors/traces/build_from_captures.py",
            "captures": {capture: ORIGIN[capture] for capture in used},
            "replay": "values replayed from real nvidia-smi captures, converted to NVML units",
            "sources": dict(sorted(trace.sources.items())),
        }
        path = out / f"{name}.jsonl"
        with path.open("w", encoding="utf-8") as handle:
            write_trace(handle, header, trace.polls)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    """Rebuild every trace from the captures and print the paths written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--captures", type=Path, default=CAPTURES_DIR)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    for path in build(args.captures, args.out):
        print(path)


if __name__ == "__main__":
    main()
