"""The NVML sampler, fed by traces built from real nvidia-smi captures (replayed, not live).

Expected readings are the capture's own numbers (quoted next to each assertion); derived values
are recomputed here from the PCIe spec rates, not copied from the code under test.
"""

from __future__ import annotations

import json
import logging
import threading
import types
from pathlib import Path

import pynvml
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from collectors._nvml import THROTTLE_REASONS, GpuSampler, GpuSamplerConfig
from collectors._nvml_backends import (
    NvmlBackend,
    NvmlGpuLost,
    NvmlNotSupported,
    NvmlUnavailable,
    RawPoll,
    translate,
)
from collectors._nvml_live import ALL_FIELDS, LiveNvmlBackend
from collectors._nvml_trace import RecordingBackend, ReplayBackend, read_trace, write_trace
from collectors._points import REPLAYED_ATTR, Point
from collectors.traces import TRACES_DIR, trace_names, trace_path
from collectors.traces.build_from_captures import CAPTURES_DIR, build

MIB = 2**20
NVML_LOG = "collectors._nvml"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingBackend(NvmlBackend):
    """Wraps a backend and counts the polls that reach it."""

    def __init__(self, inner: NvmlBackend) -> None:
        self.inner = inner
        self.polls = 0
        self.replayed = inner.replayed

    def open(self) -> None:
        self.inner.open()

    def poll(self) -> RawPoll:
        self.polls += 1
        return self.inner.poll()

    def close(self) -> None:
        self.inner.close()


def replay(name: str, polls: int, **kwargs: object) -> list[list[Point]]:
    sampler = GpuSampler(ReplayBackend(trace_path(name), **kwargs),  # type: ignore[arg-type]
                         config=GpuSamplerConfig(interval_s=1.0, host_name="test-host"))
    try:
        return [sampler.poll_once() for _ in range(polls)]
    finally:
        sampler.shutdown()


def values(points: list[Point], name: str, **attrs: str) -> list[float]:
    return [p.value for p in points
            if p.name == name and all(p.attributes.get(k) == v for k, v in attrs.items())]


def test_shipped_traces_are_the_ones_the_issue_asks_for() -> None:
    assert {"h100_idle", "h100_gpu_burn", "l40s_pcie", "a100_sxm4", "h100_mig"} <= set(
        trace_names())


def test_h100_gpu_burn_replays_the_dmon_series() -> None:
    polls = replay("h100_gpu_burn", 5)
    # capture "load :: dmon": pwr 631 634 633 634 636 W, sm 100 %, pclk 1980 MHz
    assert [values(p, "hw.power")[0] for p in polls] == [631.0, 634.0, 633.0, 634.0, 636.0]
    assert [values(p, "hw.gpu.utilization")[0] for p in polls] == [1.0] * 5
    assert values(polls[0], "seedance.gpu.clock", clock="graphics") == [1980.0]
    # capture "load :: query-gpu": memory.total 81559 MiB, used 19818 MiB, limit 700 W
    assert values(polls[0], "hw.gpu.memory.limit") == [81559 * MIB]
    assert values(polls[0], "hw.gpu.memory.usage") == [19818 * MIB]
    assert values(polls[0], "seedance.gpu.power.limit") == [700.0]
    times = [p[0].time_ns for p in polls]
    assert [b - a for a, b in zip(times, times[1:], strict=False)] == [1_000_000_000] * 4
    assert all(pt.attributes[REPLAYED_ATTR] == "true" for p in polls for pt in p)


def test_h100_pcie_link_and_its_peak() -> None:
    points = replay("h100_gpu_burn", 1)[0]
    # capture: pcie.link.gen.current/max 5, width 16; -q Tx 3092 KB/s, Rx 6346 KB/s
    for state in ("current", "max"):
        assert values(points, "seedance.gpu.pcie.link.generation", state=state) == [5.0]
        assert values(points, "seedance.gpu.pcie.link.width", state=state) == [16.0]
    gen5_lane = 32e9 * (128 / 130) / 8  # 32 GT/s, 128b/130b coding
    assert values(points, "seedance.gpu.pcie.link.peak_bandwidth") == [
        pytest.approx(16 * gen5_lane)]
    assert values(points, "hw.gpu.io", **{"network.io.direction": "transmit"}) == [3092e3]
    assert values(points, "hw.gpu.io", **{"network.io.direction": "receive"}) == [6346e3]


def test_l40s_is_pcie_only_gen4() -> None:
    points = replay("l40s_pcie", 1)[0]
    info = [p for p in points if p.name == "seedance.gpu.info"][0]
    assert info.attributes["hw.name"] == "NVIDIA L40S"
    assert info.attributes["numa.node"] == "0"  # topo -m: NUMA Affinity 0
    assert values(points, "seedance.gpu.pcie.link.generation", state="current") == [4.0]
    # -q: Tx 259423 KB/s, Rx 2012109 KB/s under the NVENC load
    assert values(points, "hw.gpu.io", **{"network.io.direction": "receive"}) == [2012109e3]
    assert values(points, "seedance.gpu.pcie.link.peak_bandwidth") == [
        pytest.approx(16 * 16e9 * (128 / 130) / 8)]
    assert values(points, "seedance.gpu.nvlink.throughput") == []


def test_idle_h100_reports_gpu_idle_throttle_reason_and_load_reports_none() -> None:
    idle = replay("h100_idle", 1)[0]
    load = replay("h100_gpu_burn", 1)[0]
    # query-gpu clocks_event_reasons.active: 0x...01 idle, 0x...00 under load
    assert [p.attributes["reason"] for p in idle if p.name == "seedance.gpu.throttle_reasons"] \
        == ["gpu_idle"]
    assert values(load, "seedance.gpu.throttle_reasons") == []


def test_unsupported_fields_are_left_out_and_logged_once(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    caplog.set_level(logging.INFO, logger=NVML_LOG)
    polls = replay("a100_sxm4", 3)
    for points in polls:  # MIG on: utilization N/A in the XML; bus width in no capture
        assert values(points, "hw.gpu.utilization") == []
        assert values(points, "seedance.gpu.memory.bus_width") == []
        assert values(points, "seedance.gpu.memory.peak_bandwidth") == []
        assert values(points, "hw.power") == [67.03]  # <power_draw>67.03 W</power_draw>
        assert values(points, "seedance.gpu.clock.max", clock="sm") == [1410.0]
    logged = [r for r in caplog.records if "nvmlDeviceGetUtilizationRates.gpu" in r.getMessage()]
    assert len(logged) == 1


def test_mig_h100_has_no_utilisation_but_power() -> None:
    points = replay("h100_mig", 1)[0]
    assert values(points, "hw.gpu.utilization") == []
    assert values(points, "hw.power") == [438.0]  # load dmon row 1: pwr 438


def write_two_gpu_trace_with_loss(path: Path) -> None:
    """Test fixture: GPU 0 from the H100 trace, GPU 1 from the L40S trace; GPU 1 is lost at the
    third poll (simulated: no capture shows a GPU falling off the bus)."""
    h100 = read_trace(trace_path("h100_gpu_burn"))
    l40s = read_trace(trace_path("l40s_pcie"))
    records = []
    for i in range(4):
        t_s, (gpu0,) = h100.polls[i]
        _, (gpu1,) = l40s.polls[i]
        lost = i >= 2
        records.append({"t_s": t_s, "gpus": [
            {"index": 0, "readings": dict(gpu0.readings), "errors": dict(gpu0.errors)},
            {"index": 1, "readings": {} if lost else dict(gpu1.readings),
             "errors": {} if lost else dict(gpu1.errors), "lost": lost},
        ]})
    with path.open("w") as out:
        write_trace(out, {"trace": "two_gpu_loss", "note": "test fixture: loss simulated"},
                    records)


def test_lost_gpu_reports_down_while_the_other_goes_on(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=NVML_LOG)
    path = tmp_path / "two_gpu_loss.jsonl"
    write_two_gpu_trace_with_loss(path)
    sampler = GpuSampler(ReplayBackend(path), config=GpuSamplerConfig(host_name="h"))
    polls = [sampler.poll_once() for _ in range(4)]
    assert [values(p, "hw.gpu.up", **{"gpu.index": "1"}) for p in polls] == [
        [1.0], [1.0], [0.0], [0.0]]
    down = [p for p in polls[2] if p.name == "hw.gpu.up" and p.attributes["gpu.index"] == "1"]
    assert down[0].attributes["hw.name"] == "NVIDIA L40S"  # identity kept from before the loss
    assert values(polls[2], "hw.power", **{"gpu.index": "1"}) == []
    assert values(polls[3], "hw.power", **{"gpu.index": "0"}) == [634.0]  # dmon row 4
    assert sum("is lost" in r.getMessage() for r in caplog.records) == 1


def test_no_library_makes_a_null_sampler_that_says_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    caplog.set_level(logging.INFO, logger=NVML_LOG)
    with GpuSampler(LiveNvmlBackend()) as sampler:
        assert sampler.snapshot() == []
        assert sampler.snapshot() == []
        assert sampler.available is False
    sampler.shutdown()
    assert sum("NVML unavailable" in r.getMessage() for r in caplog.records) == 1


def test_pynvml_import_failure_is_unavailable() -> None:
    def broken() -> object:
        raise ImportError("No module named 'pynvml'")

    backend = LiveNvmlBackend(import_nvml=broken)  # type: ignore[arg-type]
    with pytest.raises(NvmlUnavailable):
        backend.open()


def test_live_backend_on_this_machine(caplog: pytest.LogCaptureFixture) -> None:
    """Real NVML: with no GPU/driver it says "NVML unavailable" once; with one it reports."""
    caplog.set_level(logging.INFO, logger=NVML_LOG)
    with GpuSampler(config=GpuSamplerConfig(interval_s=0.05)) as sampler:
        points = sampler.snapshot()
        sampler.snapshot()
    if sampler.available:
        assert values(points, "hw.gpu.up") and set(values(points, "hw.gpu.up")) == {1.0}
        assert all(REPLAYED_ATTR not in p.attributes for p in points)
    else:
        assert points == []
        assert sum("NVML unavailable" in r.getMessage() for r in caplog.records) == 1


def test_one_poll_per_interval_however_many_readers() -> None:
    clock = FakeClock()
    backend = CountingBackend(ReplayBackend(trace_path("h100_gpu_burn")))
    sampler = GpuSampler(backend, config=GpuSamplerConfig(interval_s=10.0, host_name="h"),
                         clock=clock)
    reader = InMemoryMetricReader()
    sampler.register(MeterProvider(metric_readers=[reader]).get_meter("test"))
    first = sampler.snapshot()

    def read() -> None:
        for _ in range(20):
            assert sampler.snapshot() == first

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for _ in range(3):
        reader.get_metrics_data()  # OTel callbacks read the cache, never NVML
    assert backend.polls == 1
    clock.now += 10.0
    second = sampler.snapshot()
    assert backend.polls == 2
    assert values(second, "hw.power") == [634.0]  # the next dmon row
    data = reader.get_metrics_data()
    gauges = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics}
    assert [p.value for p in gauges["hw.power"].data.data_points] == [634.0]
    assert gauges["hw.errors"].data.is_monotonic  # a SUM in the catalogue: observable counter


def test_observations_name_the_job_the_gpus_run_while_one_is_known() -> None:
    """The sidecar's own service.name is not the job's: ``job()`` names it, read at every
    collection, and a GPU with no known job is left unnamed."""
    sampler = GpuSampler(ReplayBackend(trace_path("h100_gpu_burn")),
                         config=GpuSamplerConfig(host_name="h"))
    reader = InMemoryMetricReader()
    running: list[str | None] = [None]
    sampler.register(MeterProvider(metric_readers=[reader]).get_meter("test"),
                     job=lambda: running[0])
    sampler.poll_once()

    def jobs() -> set[object]:
        data = reader.get_metrics_data()
        return {p.attributes.get("seedance.job") for rm in data.resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics if m.name == "hw.power"
                for p in m.data.data_points}

    assert jobs() == {None}
    running[0] = "llm-train"
    assert jobs() == {"llm-train"}
    sampler.shutdown()


def test_record_then_replay_gives_identical_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "recorded.jsonl"
    recorder = RecordingBackend(ReplayBackend(trace_path("h100_gpu_burn")), path)
    config = GpuSamplerConfig(host_name="h")
    sampler = GpuSampler(recorder, config=config)
    recorded = [sampler.poll_once() for _ in range(5)]
    sampler.shutdown()
    replayed = GpuSampler(ReplayBackend(path), config=config)
    again = [replayed.poll_once() for _ in range(5)]
    replayed.shutdown()

    def strip(polls: list[list[Point]]) -> list[list[tuple[object, ...]]]:
        return [[(p.name, p.value, sorted(p.attributes.items())) for p in points]
                for points in polls]

    assert strip(again) == strip(recorded)
    header = json.loads(path.read_text().splitlines()[0])
    assert set(header["sources"]) == set(ALL_FIELDS)
    assert "ReplayBackend" in header["sources"]["nvmlDeviceGetPowerUsage"]


def test_loop_never_dies(caplog: pytest.LogCaptureFixture) -> None:
    class FailsOnce(CountingBackend):
        def poll(self) -> RawPoll:
            self.polls += 1
            if self.polls == 1:
                raise RuntimeError("boom")
            return self.inner.poll()

    backend = FailsOnce(ReplayBackend(trace_path("l40s_pcie")))
    done = threading.Event()
    sampler = GpuSampler(backend, config=GpuSamplerConfig(interval_s=0.01, host_name="h"))
    with sampler:
        for _ in range(500):
            if backend.polls >= 3:
                done.set()
                break
            done.wait(0.01)
    assert done.is_set()
    assert sampler.cached("hw.power")  # the polls after the failure filled the cache
    sampler.shutdown()  # a second shutdown is harmless


def test_vendor_errors_map_through_the_table() -> None:
    assert isinstance(translate(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)),
                      NvmlNotSupported)
    assert isinstance(translate(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)), NvmlGpuLost)
    assert isinstance(translate(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)), NvmlGpuLost)
    assert isinstance(translate(pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)),
                      NvmlUnavailable)


def test_throttle_bits_match_pynvml() -> None:
    names = {"gpu_idle": "GpuIdle", "applications_clocks_setting": "ApplicationsClocksSetting",
             "sw_power_cap": "SwPowerCap", "hw_slowdown": "HwSlowdown",
             "sync_boost": "SyncBoost", "sw_thermal_slowdown": "SwThermalSlowdown",
             "hw_thermal_slowdown": "HwThermalSlowdown",
             "hw_power_brake_slowdown": "HwPowerBrakeSlowdown",
             "display_clock_setting": "DisplayClockSetting"}
    for bit, name in THROTTLE_REASONS.items():
        assert getattr(pynvml, f"nvmlClocksEventReason{names[name]}") == bit


def test_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        GpuSamplerConfig(interval_s=0)


@pytest.mark.skipif(not CAPTURES_DIR.is_dir(), reason="real captures not on this machine")
def test_rebuilding_from_captures_reproduces_the_shipped_traces(tmp_path: Path) -> None:
    for path in build(CAPTURES_DIR, tmp_path):
        assert path.read_text() == (TRACES_DIR / path.name).read_text(), path.name


def _fake_pynvml(nvlink_kib: list[int]) -> types.ModuleType:
    """pynvml's real constants and error classes around canned answers, so the live backend's
    own code runs without a GPU. Test fixture: GPU 0 answers (bus width 5120 bit is the H100
    datasheet figure, the rest as in the H100 capture), GPU 1 is lost."""
    fake = types.ModuleType("fake_pynvml")
    fake.__dict__.update({k: v for k, v in vars(pynvml).items()
                          if k.startswith(("NVML_", "NVMLError", "nvmlEventType"))})

    def gpu0(value: object) -> object:
        def call(handle: int, *_: object) -> object:
            if handle == 1:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            if isinstance(value, Exception):
                raise value
            return value() if callable(value) else value
        return call

    def field_values(handle: int, ids: list[tuple[int, int]]) -> list[object]:
        assert all(scope == 0xFFFFFFFF for _, scope in ids)  # all links, not link 0
        nvlink_kib.append(nvlink_kib[-1] + 4096)
        return [types.SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS,
                                      value=types.SimpleNamespace(ullVal=nvlink_kib[-1]))]

    not_supported = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def no_events() -> None:
        raise not_supported

    fake.__dict__.update(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlEventSetCreate=no_events,
        nvmlDeviceGetName=gpu0("NVIDIA H100 80GB HBM3"),
        nvmlDeviceGetUUID=gpu0("GPU-00000000-0000-0000-0000-000000000000"),
        nvmlDeviceGetPciInfo=gpu0(types.SimpleNamespace(busId=b"00000000:00:09.0")),
        nvmlDeviceGetMemoryAffinity=gpu0([0b100]),
        nvmlDeviceGetUtilizationRates=gpu0(not_supported),
        nvmlDeviceGetMemoryInfo=gpu0(types.SimpleNamespace(used=19818 * MIB, total=81559 * MIB)),
        nvmlDeviceGetPcieThroughput=gpu0(3092),
        nvmlDeviceGetCurrPcieLinkGeneration=gpu0(5), nvmlDeviceGetMaxPcieLinkGeneration=gpu0(5),
        nvmlDeviceGetCurrPcieLinkWidth=gpu0(16), nvmlDeviceGetMaxPcieLinkWidth=gpu0(16),
        nvmlDeviceGetFieldValues=lambda h, ids: (gpu0(None)(h), field_values(h, ids))[1],
        nvmlDeviceGetPowerUsage=gpu0(631000), nvmlDeviceGetEnforcedPowerLimit=gpu0(700000),
        nvmlDeviceGetClockInfo=gpu0(1980), nvmlDeviceGetMaxClockInfo=gpu0(2619),
        nvmlDeviceGetMemoryBusWidth=gpu0(5120), nvmlDeviceGetTemperature=gpu0(63),
        nvmlDeviceGetCurrentClocksEventReasons=gpu0(0x4),
        nvmlDeviceGetTotalEccErrors=gpu0(0),
    )
    return fake


def test_live_backend_code_path_maps_errors_and_derives_rates(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=NVML_LOG)
    nvlink_kib = [0]
    backend = LiveNvmlBackend(import_nvml=lambda: _fake_pynvml(nvlink_kib))
    sampler = GpuSampler(backend, config=GpuSamplerConfig(host_name="h"))
    first, second = sampler.poll_once(), sampler.poll_once()
    sampler.shutdown()
    assert values(second, "hw.gpu.up") == [1.0, 0.0]  # GPU 1 lost, GPU 0 goes on
    assert values(second, "hw.gpu.utilization") == []  # NotSupported: left out
    assert values(second, "hw.errors", **{"error.type": "xid"}) == []  # no event support
    assert [p.attributes["numa.node"] for p in second if p.name == "seedance.gpu.info"] == ["2"]
    assert [p.attributes["reason"] for p in second
            if p.name == "seedance.gpu.throttle_reasons"] == ["sw_power_cap"]
    assert values(second, "seedance.gpu.memory.peak_bandwidth") == [
        pytest.approx(5120 / 8 * 2619e6 * 2)]
    assert values(first, "seedance.gpu.nvlink.throughput") == []  # a rate needs two readings
    dt_s = (second[0].time_ns - first[0].time_ns) / 1e9
    rates = values(second, "seedance.gpu.nvlink.throughput")
    assert rates == [pytest.approx(4096 * 1024 * 2 / dt_s)] * 2  # TX then RX: 2 reads per poll
    assert sum("nvmlDeviceGetUtilizationRates.gpu" in r.getMessage()
               for r in caplog.records) == 1


def test_replay_with_loop_cycles_through_the_trace_not_its_last_poll() -> None:
    """Regression: a looping replay kept serving the last poll after the first pass."""
    from collectors._nvml_trace import ReplayBackend
    from collectors.traces import trace_path

    backend = ReplayBackend(trace_path("h100_gpu_burn"), loop=True)
    backend.open()
    first_pass = [backend.poll() for _ in range(5)]
    second_pass = [backend.poll() for _ in range(5)]
    assert [p.gpus for p in second_pass] == [p.gpus for p in first_pass]
    assert second_pass[0].time_ns > first_pass[-1].time_ns
