"""The GPU truth's CPU side: nvidia-smi CSV parsing and per-second alignment on real captures,
the target/met/error shape of the JSONs, and the script's orchestration in its labelled CPU mode
(a part that times out is recorded and the others still run). Nothing here writes into
bench/results/gpu: every run goes to tmp_path."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_truth import _smi, demo, nvml
from bench.gpu_truth._record import NO_GPU, Part, check, record_failure
from collectors import SeedanceError
from collectors._nvml_trace import ReplayBackend, read_trace
from workloads.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
H100 = DATA / "nvidia-smi_capture_linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"
L40S = DATA / "nvidia-smi_capture_linux-x86_64__nvidia-l40s__595.80.txt"
SCRIPT = REPO / "bench" / "gpu_truth.sh"
RESULTS = REPO / "bench" / "results" / "gpu"


def query_gpu_section(capture: Path, phase: str) -> list[str]:
    """The header and row that the capture's ``--query-gpu ... --format=csv`` printed."""
    lines = capture.read_text().splitlines()
    start = lines.index(f"# {phase} :: query-gpu (csv, what the exporter parses)") + 3
    end = lines.index("", start)
    return lines[start:end]


def test_parse_csv_reads_the_real_h100_capture_with_units() -> None:
    idle, load = (_smi.parse_csv(query_gpu_section(H100, p)) for p in ("idle", "load"))
    assert len(idle) == len(load) == 1
    assert idle[0].values["utilization.gpu"] == 0
    assert idle[0].values["power.draw"] == pytest.approx(69.85)
    assert idle[0].values["clocks.sm"] == 345  # printed as clocks.current.sm [MHz]
    assert load[0].values["utilization.gpu"] == 100
    assert load[0].values["memory.used"] == 19818
    assert load[0].values["power.draw"] == pytest.approx(631.95)
    assert load[0].values["clocks.sm"] == 1980
    assert "hostname" not in load[0].values  # "[N/A]" is no number
    assert load[0].t_s - idle[0].t_s == pytest.approx(14.657, abs=1e-3)  # 08:12:38.696 -> 53.353


def test_parse_csv_reads_nounits_rows_and_skips_repeated_headers() -> None:
    header, row = query_gpu_section(L40S, "load")
    # the same real row as --format=csv,nounits prints it: unit suffixes dropped
    bare = ", ".join(v.rsplit(" ", 1)[0] if v.endswith((" W", " MiB", " MHz", " %")) else v
                     for v in row.split(", "))
    samples = _smi.parse_csv([header, row, "", header, bare, "garbage, 1"])
    assert len(samples) == 2
    assert samples[0].values == samples[1].values
    assert samples[0].values["power.draw"] > 0


def test_smi_command_asks_for_every_compared_field() -> None:
    command = _smi.smi_command(500)
    assert command[0] == "nvidia-smi" and "--loop-ms=500" in command
    assert set(_smi.COMPARED) <= set(command[1].split("=", 1)[1].split(","))


def test_compare_aligns_replayed_nvml_with_the_capture_second_by_second() -> None:
    """The gpu_burn trace (NVML units) against the capture's load row (nvidia-smi units) of the
    same H100: once converted, they agree where both measured the same thing."""
    backend = ReplayBackend(REPO / "collectors" / "traces" / "h100_gpu_burn.jsonl")
    backend.open()
    polls = [backend.poll() for _ in range(3)]
    backend.close()
    base_ns = 1_000_000_000_000_000_000
    nvml_polls = [(base_ns + i * 400_000_000, {g.index: dict(g.readings) for g in p.gpus})
                  for i, p in enumerate(polls)]  # t = 0.0, 0.4, 0.8 s: one second
    smi_row = _smi.parse_csv(query_gpu_section(H100, "load"))[0]
    smi = [_smi.Sample(base_ns / 1e9 + 0.5, smi_row.values),
           _smi.Sample(base_ns / 1e9 + 7.5, smi_row.values)]  # a second NVML lacks
    fields = _smi.compare(_smi.nvml_samples(nvml_polls), smi)
    assert fields["memory.used"]["seconds"] == 1
    assert fields["memory.used"]["median_abs_diff"] == pytest.approx(0.0)  # bytes -> MiB
    assert fields["clocks.sm"]["median_abs_diff"] == 0
    assert fields["power.draw"]["median_abs_diff"] < 5  # mW -> W; dmon's 631 vs 631.95
    assert fields["power.draw"]["nvml_median"] == pytest.approx(631, abs=10)
    assert fields["utilization.memory"]["seconds"] == 1


def test_compare_reports_a_field_with_no_common_second() -> None:
    nvml_side = [_smi.Sample(10.2, {"power.draw": 100.0})]
    smi_side = [_smi.Sample(11.2, {"power.draw": 90.0})]
    assert _smi.compare(nvml_side, smi_side)["power.draw"] == {
        "seconds": 0, "median_abs_diff": None, "nvml_samples": 1, "smi_samples": 1}
    same = _smi.compare(nvml_side + [_smi.Sample(10.9, {"power.draw": 110.0})],
                        [_smi.Sample(10.5, {"power.draw": 90.0})])
    assert same["power.draw"]["median_abs_diff"] == pytest.approx(15.0)  # mean(100, 110) - 90


def test_check_met_flags() -> None:
    assert check(0.6, 0.5)["met"] is True
    assert check(0.4, 0.5)["met"] is False
    assert check(1.002, 1.003, at_most=True) == {"value": 1.002, "target": 1.003, "op": "<=",
                                                 "met": True}
    assert check(None, 0.5)["met"] is None


def test_part_records_a_failed_step_and_goes_on(tmp_path: Path) -> None:
    part = Part("p", tmp_path, simulated=True)
    with part.attempt("broken"):
        raise RuntimeError("no fp8 here")
    with part.attempt("fine"):
        part.data["x"] = 1
    doc = json.loads(part.write().read_text())
    assert doc["errors"] == {"broken": "RuntimeError: no fp8 here"}
    assert doc["x"] == 1
    assert doc["environment"]["simulated"] is True and doc["environment"]["label"] == NO_GPU
    assert {"time_utc", "torch", "device"} <= doc["environment"].keys()


def test_record_failure_keeps_what_the_part_wrote(tmp_path: Path) -> None:
    part = Part("kv", tmp_path, simulated=True)
    part.data["memcpy_bytes_per_s"] = 5.0
    part.errors["bits_2"] = "OOM"
    part.write()
    log = tmp_path / "kv.log"
    log.write_text("...\nTraceback: killed\n")
    doc = json.loads(record_failure(["kv", "124", str(log), "--out", str(tmp_path),
                                     "--cpu"]).read_text())
    assert doc["memcpy_bytes_per_s"] == 5.0
    assert doc["errors"]["bits_2"] == "OOM"
    assert doc["errors"]["process"].startswith("timed out; log tail: ")
    assert "Traceback: killed" in doc["errors"]["process"]


def test_nvml_part_records_a_replayable_trace_in_cpu_mode(tmp_path: Path) -> None:
    doc = json.loads(nvml.main(["--out", str(tmp_path), "--cpu", "--seconds", "1.2"])
                     .read_text())
    assert doc["environment"]["simulated"] is True
    for load in ("memory_bound", "compute_bound"):
        result = doc["loads"][load]
        assert result["replayed"] is True and result["nvml_polls"] >= 2
        trace = read_trace(tmp_path / result["trace"])
        assert "simulated" in trace.header["note"]
        assert len(trace.polls) == result["nvml_polls"]
        assert set(trace.header["sources"].values()) == {
            "recorded by RecordingBackend from ReplayBackend"}
        if shutil.which("nvidia-smi") is None:
            assert doc["errors"][f"{load}.nvidia_smi"] == "nvidia-smi is not on the PATH"


def test_demo_live_nvml_check_reads_the_demo_summary() -> None:
    summary = json.loads((DATA / "demo_run" / "summary.json").read_text())
    assert summary["gpu"]["replayed"] is True
    assert demo.live_gpu(summary)["met"] is False  # replayed points are not live ones
    live = {**summary, "gpu": {**summary["gpu"], "replayed": False}}
    assert demo.live_gpu(live)["met"] is True


def test_train_config_names_a_bad_device() -> None:
    with pytest.raises(SeedanceError, match="TrainConfig.device 'gpu0'"):
        TrainConfig(device="gpu0")


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def _run_script(out: Path, *parts: str, budget_s: int = 470) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_TRUTH_BUDGET_S": str(budget_s)}
    return subprocess.run(["bash", str(SCRIPT), "--cpu", "--out", str(out), *parts],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_script_records_a_part_that_times_out_and_runs_the_rest(tmp_path: Path) -> None:
    """CPU subset of the real script: env, a part given 1 s (it times out), kv."""
    before = sorted(RESULTS.rglob("*")) if RESULTS.exists() else []
    done = _run_script(tmp_path, "env:60", "overhead:1", "kv:60")
    assert done.returncode == 0, done.stdout + done.stderr
    overhead = json.loads((tmp_path / "overhead.json").read_text())
    assert overhead["errors"]["process"].startswith("timed out")
    assert overhead["environment"]["simulated"] is True
    kv = json.loads((tmp_path / "kv.json").read_text())
    assert kv["errors"] == {}
    assert set(kv["widths"]) == {"8", "6", "4", "2"}
    assert all(isinstance(w["share_of_memcpy"]["met"], bool) for w in kv["widths"].values())
    assert kv["widths"]["4"]["share_of_memcpy"]["target"] == 0.5
    assert kv["widths"]["2"]["share_of_memcpy"]["target"] == 0.3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["parts"]) == {"env", "overhead", "kv"}
    assert summary["parts"]["overhead"]["errors"] == ["process"]
    assert "widths.4.share_of_memcpy" in summary["parts"]["kv"]["targets"]
    assert (tmp_path / "logs" / "kv.log").exists()
    assert (sorted(RESULTS.rglob("*")) if RESULTS.exists() else []) == before


def test_script_records_parts_left_out_when_the_budget_is_spent(tmp_path: Path) -> None:
    done = _run_script(tmp_path, "matmul:60", "kv&", budget_s=0)
    assert done.returncode == 0, done.stdout + done.stderr
    for part in ("matmul", "kv"):
        doc = json.loads((tmp_path / f"{part}.json").read_text())
        assert doc["errors"]["process"].startswith("timed out")
        assert f"{part} skipped" in done.stdout


def test_run_demo_stops_a_demo_that_overruns(tmp_path: Path) -> None:
    """Past its timeout the demo's whole process group is interrupted like Ctrl+C: the demo
    sees the interrupt (so it can stop its jobs) even when started with SIGINT ignored, as
    ``gpu_truth.sh`` starts its background part, and the child it started (standing in for
    the sidecar and jobs) does not outlive the part."""
    pid_file, interrupted = tmp_path / "child.pid", tmp_path / "interrupted"
    command = [sys.executable, "-c",
               "import pathlib, subprocess, sys, time\n"
               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
               f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n"
               "try:\n"
               "    time.sleep(60)\n"
               "except KeyboardInterrupt:\n"
               f"    pathlib.Path({str(interrupted)!r}).touch()\n"]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's disposition
    try:
        with (tmp_path / "demo.log").open("wb") as log, \
                pytest.raises(TimeoutError, match="ran past"):
            demo.run_demo(command, log, 3.0)
    finally:
        signal.signal(signal.SIGINT, before)
    assert interrupted.exists(), "the demo was killed without seeing the interrupt"
    child = int(pid_file.read_text())
    for _ in range(50):  # SIGINT ends it; a zombie awaiting its reaper counts as ended
        if not _running(child):
            break
        time.sleep(0.1)
    assert not _running(child)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_the_overhead_part_runs_the_bench_with_every_setting_resolved(tmp_path: Path) -> None:
    """The part once built the bench's settings by hand and missed one the bench added."""
    from bench import overhead
    from bench.gpu_truth.overhead import bench_arguments

    part_args = argparse.Namespace(receiver="sidecar", pairs=7, global_batch=32, cpu=False,
                                   out=tmp_path)
    settings = vars(bench_arguments(part_args))
    assert settings.keys() == vars(overhead.arguments([])).keys()
    assert settings["device"] == "cuda" and settings["threads"] is None
    assert settings["pairs"] == 7 and settings["block_steps"] == 1
    assert settings["grad_interval_s"] == settings["export_interval_s"]
