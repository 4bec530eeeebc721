"""Scrape sources against real exporter output (tests/data/README.md says where it came from).

Expected values are read from the fixture text with a regex, independently of the parser under
test, and converted with the unit factors the exporters' HELP text states. The dcgm fixture's
own ``# NOTE`` lines mark dummy series (unlabelled zeros, and FB_RESERVED copied from FB_TOTAL):
tests use those only for names and shapes, never as measurements. Lines written inside a test
are synthetic and say so.
"""

from __future__ import annotations

import csv
import http.server
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors._catalogue import BY_NAME
from collectors._points import MetricKind, Point
from collectors._scrape import Scraper, ScrapeSource
from collectors._scrape_mapping import ScrapeError, map_exposition
from collectors._scrape_rules import DCGM_RULES, SOURCE_ATTR, VLLM_RULES

DATA = Path(__file__).resolve().parents[1] / "data"
DCGM_TEXT = (DATA / "dcgm-exporter_metrics_datadog-fixture_T4_partial-dummy.prom").read_text()
VLLM_TEXT = (DATA / "vllm_metrics_datadog-fixture_opt-125m_mixed-v0-v1.prom").read_text()
T4_UUID = "GPU-20c56d28-0da5-6d26-a36a-e7af1ce2586e"
MIB = 1024 * 1024
NOW_NS = 1_700_000_000_000_000_000


def raw(text: str, series: str, **labels: str) -> float:
    """The value of the one exposition line of ``series`` whose labels include ``labels``."""
    found = []
    for m in re.finditer(rf"^{re.escape(series)}(\{{(.*?)\}})? (\S+)$", text, re.M):
        line_labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(line_labels.get(k) == v for k, v in labels.items()):
            found.append(float(m.group(3)))
    assert len(found) == 1, f"{series} {labels}: {len(found)} lines"
    return found[0]


def only(points: list[Point], name: str, **attrs: str) -> Point:
    hits = [p for p in points if p.name == name
            and all(p.attributes.get(k.replace("__", ".")) == v for k, v in attrs.items())]
    assert len(hits) == 1, f"{name} {attrs}: {len(hits)} points"
    return hits[0]


@pytest.fixture(scope="module")
def dcgm() -> list[Point]:
    return map_exposition(DCGM_TEXT, time_ns=NOW_NS)


@pytest.fixture(scope="module")
def vllm() -> list[Point]:
    return map_exposition(VLLM_TEXT, time_ns=NOW_NS)


# --- dcgm-exporter -------------------------------------------------------------------------


@pytest.mark.parametrize(("series", "name", "factor", "attrs"), [
    ("DCGM_FI_DEV_GPU_UTIL", "hw.gpu.utilization", 0.01, {"hw__gpu__task": "general"}),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "hw.gpu.memory.utilization", 0.01, {}),
    ("DCGM_FI_DEV_FB_USED", "hw.gpu.memory.usage", MIB, {}),
    ("DCGM_FI_DEV_FB_FREE", "seedance.gpu.memory.free", MIB, {}),
    ("DCGM_FI_DEV_POWER_USAGE", "hw.power", 1.0, {}),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "hw.energy", 1e-3, {}),
    ("DCGM_FI_DEV_GPU_TEMP", "hw.temperature", 1.0, {}),
    ("DCGM_FI_DEV_SM_CLOCK", "seedance.gpu.clock", 1.0, {"clock": "sm"}),
    ("DCGM_FI_DEV_MEM_CLOCK", "seedance.gpu.clock", 1.0, {"clock": "memory"}),
    ("DCGM_FI_DEV_XID_ERRORS", "seedance.gpu.xid.last", 1.0, {}),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "seedance.gpu.nvlink.raw_bandwidth", 1.0, {}),
])
def test_t4_series_map_with_their_units(
    dcgm: list[Point], series: str, name: str, factor: float, attrs: dict[str, str]
) -> None:
    point = only(dcgm, name, hw__id=T4_UUID, **attrs)
    assert point.value == pytest.approx(raw(DCGM_TEXT, series, UUID=T4_UUID) * factor)
    assert point.time_ns == NOW_NS


def test_t4_nonzero_readings_in_our_units(dcgm: list[Point]) -> None:
    """The idle T4's non-zero readings, converted: 15109 MiB free, 8.969 W, ~129 kJ."""
    free = only(dcgm, "seedance.gpu.memory.free", hw__id=T4_UUID).value
    assert free == 15109 * MIB and free > 15e9
    assert only(dcgm, "hw.power", hw__id=T4_UUID).value == pytest.approx(8.969)
    assert only(dcgm, "hw.energy", hw__id=T4_UUID).value == pytest.approx(128996.013)


def test_dcgm_labels_become_our_attributes(dcgm: list[Point]) -> None:
    point = only(dcgm, "hw.power", hw__id=T4_UUID)
    assert point.attributes["gpu.index"] == "0"
    assert point.attributes["hw.name"] == "Tesla T4"
    assert point.attributes["host.name"] == "424773df46e0"
    assert point.attributes[SOURCE_ATTR] == "dcgm-exporter"
    for label in ("gpu", "UUID", "modelName", "Hostname"):
        assert label not in point.attributes
    # labels we have no name for are kept as they are
    assert point.attributes["device"] == "nvidia0"
    assert point.attributes["DCGM_FI_DRIVER_VERSION"] == "460.106.00"


def test_percent_and_pci_address_on_a_busy_gpu() -> None:
    # synthetic line: the fixture's GPU is idle (0 %) and has no pci_bus_id label
    text = ('# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n'
            'DCGM_FI_DEV_GPU_UTIL{gpu="3",pci_bus_id="00000000:3B:00.0"} 87\n')
    (point,) = map_exposition(text, time_ns=NOW_NS)
    assert point.name == "hw.gpu.utilization"
    assert point.value == pytest.approx(0.87)
    assert point.attributes["gpu.pci_address"] == "00000000:3B:00.0"
    assert point.attributes["gpu.index"] == "3"


def test_throttle_bitmask_becomes_one_point_per_active_reason(dcgm: list[Point]) -> None:
    mask = int(raw(DCGM_TEXT, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"))
    points = [p for p in dcgm if p.name == "seedance.gpu.throttle_reasons"]
    assert len(points) == bin(mask).count("1")
    assert mask == 1 and points[0].attributes["reason"] == "gpu_idle"  # an idle T4
    assert points[0].value == 1.0


def test_prof_ratios_are_not_scaled_and_k8s_labels_map(dcgm: list[Point]) -> None:
    point = only(dcgm, "seedance.gpu.dram.active", hw__id="GPU-abc")
    assert point.value == raw(DCGM_TEXT, "DCGM_FI_PROF_DRAM_ACTIVE") <= 1.0
    assert point.attributes["k8s.pod.name"] == "ray-1111111"
    assert point.attributes["k8s.namespace.name"] == "ray-llm"


def test_unknown_series_are_kept_with_their_labels(dcgm: list[Point]) -> None:
    slowdown = only(dcgm, "DCGM_FI_DEV_SLOWDOWN_TEMP")
    assert slowdown.value == raw(DCGM_TEXT, "DCGM_FI_DEV_SLOWDOWN_TEMP")
    assert slowdown.attributes["hw.name"] == "Tesla T4"
    assert slowdown.attributes["DCGM_FI_DEV_SERIAL"] == "1565220008176"
    # a counter is kept under its family name; the parser's added "_total" is not used
    assert only(dcgm, "DCGM_FI_DEV_COUNT").value == raw(DCGM_TEXT, "DCGM_FI_DEV_COUNT")
    assert not [p for p in dcgm if p.name.endswith("_total")]


@pytest.mark.parametrize("text", [DCGM_TEXT, VLLM_TEXT], ids=["dcgm", "vllm"])
def test_every_family_is_mapped_or_kept(text: str) -> None:
    points = map_exposition(text, time_ns=NOW_NS)
    names = {p.name for p in points}
    rules = {r.series: r for r in DCGM_RULES + VLLM_RULES}
    for series, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        family = series.removesuffix("_total") if kind == "counter" else series
        suffix = ".count" if kind in ("histogram", "summary") else ""
        if family + suffix not in names:
            assert rules[family].name + suffix in names, series
    assert all(p.attributes[SOURCE_ATTR] in ("dcgm-exporter", "vllm") for p in points)


# --- vLLM ----------------------------------------------------------------------------------

MODEL = "facebook/opt-125m"


def test_vllm_counters_and_gauges(vllm: list[Point]) -> None:
    for series, name in (
        ("vllm:prefix_cache_queries_total", "seedance.serve.prefix_cache.query_tokens"),
        ("vllm:prefix_cache_hits_total", "seedance.serve.prefix_cache.hit_tokens"),
        ("vllm:num_preemptions_total", "seedance.serve.preemptions"),
        ("vllm:generation_tokens_total", "seedance.serve.generation_tokens"),
        ("vllm:prompt_tokens_total", "seedance.serve.prompt_tokens"),
        ("vllm:num_requests_running", "seedance.serve.batch_size"),
        ("vllm:num_requests_waiting", "seedance.serve.queue_depth"),
    ):
        point = only(vllm, name)
        assert point.value == raw(VLLM_TEXT, series), series
        assert point.attributes["gen_ai.request.model"] == MODEL
        assert point.attributes[SOURCE_ATTR] == "vllm"
        assert "model_name" not in point.attributes
    assert only(vllm, "seedance.serve.prefix_cache.hit_tokens").value == 64


def test_v1_name_wins_and_the_v0_duplicate_is_kept_apart(vllm: list[Point]) -> None:
    """The mixed fixture exposes v0 and v1 names at once; each series is filled once."""
    itl_count = raw(VLLM_TEXT, "vllm:inter_token_latency_seconds_count")
    assert only(vllm, "gen_ai.server.time_per_output_token.count").value == itl_count
    v0_count = raw(VLLM_TEXT, "vllm:time_per_output_token_seconds_count")
    assert only(vllm, "vllm:time_per_output_token_seconds.count").value == v0_count
    assert itl_count != v0_count  # the two really are different series in this fixture
    only(vllm, "seedance.serve.kv_cache.usage")
    assert only(vllm, "vllm:gpu_cache_usage_perc").value == raw(
        VLLM_TEXT, "vllm:gpu_cache_usage_perc")


def test_v0_scrape_alone_maps_v0_names() -> None:
    """The fixture's real top half (before the appended v1 names) is a v0 scrape."""
    v0_text = VLLM_TEXT.split("# HELP vllm:kv_cache_usage_perc")[0]
    points = map_exposition(v0_text, time_ns=NOW_NS, kind="vllm")
    assert only(points, "gen_ai.server.time_per_output_token.count").value == raw(
        VLLM_TEXT, "vllm:time_per_output_token_seconds_count")
    assert only(points, "seedance.serve.kv_cache.usage").value == raw(
        VLLM_TEXT, "vllm:gpu_cache_usage_perc")
    assert not [p for p in points if p.name.startswith("vllm:gpu_cache_usage")]


@pytest.mark.parametrize(("series", "name"), [
    ("vllm:time_to_first_token_seconds", "gen_ai.server.time_to_first_token"),
    ("vllm:e2e_request_latency_seconds", "gen_ai.server.request.duration"),
    ("vllm:inter_token_latency_seconds", "gen_ai.server.time_per_output_token"),
])
def test_histograms_become_cumulative_buckets_count_and_sum(
    vllm: list[Point], series: str, name: str
) -> None:
    buckets = [p for p in vllm if p.name == f"{name}.bucket"]
    bounds = re.findall(rf'^{re.escape(series)}_bucket\{{le="([^"]+)"', VLLM_TEXT, re.M)
    assert len(buckets) == len(bounds) > 1
    assert buckets[-1].attributes["le"] == "+Inf"
    assert [float(p.attributes["le"]) for p in buckets] == sorted(float(b) for b in bounds)
    counts = [p.value for p in buckets]
    assert counts == sorted(counts)  # cumulative
    for point in buckets:
        assert point.value == raw(VLLM_TEXT, f"{series}_bucket", le=_as_written(
            series, point.attributes["le"]))
    assert only(vllm, f"{name}.count").value == counts[-1] == raw(VLLM_TEXT, f"{series}_count")
    assert only(vllm, f"{name}.sum").value == raw(VLLM_TEXT, f"{series}_sum")


def _as_written(series: str, le: str) -> str:
    written = re.findall(rf'^{re.escape(series)}_bucket\{{le="([^"]+)"', VLLM_TEXT, re.M)
    return next(b for b in written if float(b) == float(le))


def test_engine_label_and_v0_hit_rate_gauge() -> None:
    # synthetic lines: real v1 output carries "engine", the fixture's v1 half does not; the v0
    # hit-rate gauge is not in the fixture
    text = ('# TYPE vllm:kv_cache_usage_perc gauge\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            '# TYPE vllm:gpu_prefix_cache_hit_rate gauge\n'
            'vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.5\n')
    points = map_exposition(text, time_ns=NOW_NS)
    usage = only(points, "seedance.serve.kv_cache.usage")
    assert usage.value == 0.25 and usage.attributes["seedance.vllm.engine"] == "0"
    assert only(points, "seedance.serve.prefix_cache.hit_ratio").value == 0.5


# --- exposition details --------------------------------------------------------------------


def test_created_series_dropped_timestamps_kept_and_extra_attributes() -> None:
    # synthetic: prometheus_client's own _created series and an explicit sample timestamp
    text = ('# TYPE vllm:request_success_total counter\n'
            'vllm:request_success_total{finished_reason="stop"} 3\n'
            'vllm:request_success_created{finished_reason="stop"} 1.7e9\n'
            'other_metric 7 1700000000123\n')
    points = map_exposition(text, time_ns=NOW_NS, attributes={"service.name": "serve-a"})
    assert [p.name for p in points] == ["vllm:request_success", "other_metric"]
    assert points[0].attributes["finished_reason"] == "stop"
    assert points[1].time_ns == 1_700_000_000_123_000_000
    assert all(p.attributes["service.name"] == "serve-a" for p in points)


def test_plain_prometheus_output_is_kept_under_source_prometheus() -> None:
    points = map_exposition("# TYPE up gauge\nup 1\n", time_ns=NOW_NS)
    assert [(p.name, p.attributes[SOURCE_ATTR]) for p in points] == [("up", "prometheus")]


def test_explicit_kind_applies_only_its_rules() -> None:
    points = map_exposition(DCGM_TEXT, time_ns=NOW_NS, kind="vllm")
    assert "hw.power" not in {p.name for p in points}
    assert only(points, "DCGM_FI_DEV_POWER_USAGE", UUID=T4_UUID).attributes[SOURCE_ATTR] == "vllm"


@pytest.mark.parametrize("text", ["not an exposition at all\n", 'a{b="1" 3\n',
                                  '# TYPE h histogram\nh_bucket{le="x"} 1\n'])
def test_malformed_exposition_is_a_scrape_error(text: str) -> None:
    with pytest.raises(ScrapeError, match="not a Prometheus text exposition"):
        map_exposition(text, time_ns=NOW_NS)


# --- the rule tables against the exporters' own HELP text ----------------------------------

_HELP_UNIT = {"%": "(in %)", "MiB": "(in MiB)", "mJ": "(in mJ)", "W": "(in W)", "C": "(in C)",
              "MHz": "(in MHz)", "B/s": "in bytes per second", "ratio": "ratio"}
_OUR_UNIT = {"%": "1", "MiB": "By", "mJ": "J", "W": "W", "C": "Cel", "MHz": "MHz",
             "B/s": "By/s", "ratio": "1"}


def _dcgm_csv_help() -> dict[str, str]:
    """Field -> HELP from dcgm-exporter's CSVs; an active line wins over a commented-out one
    (default-counters.csv keeps a stale "Total number of bytes" HELP for the PCIe rate fields
    in a comment; DCGM documents them as bytes per second, as dcp-metrics-included.csv says)."""
    active: dict[str, str] = {}
    commented: dict[str, str] = {}
    for path in sorted(DATA.glob("dcgm-exporter_*.csv")):
        for row in csv.reader(path.read_text().splitlines()):
            if len(row) >= 3:
                where = commented if row[0].startswith("#") else active
                where.setdefault(row[0].lstrip("# ").strip(), ",".join(row[2:]).lower())
    return {**commented, **active}


def test_dcgm_conversions_match_the_exporters_help_text() -> None:
    helps = _dcgm_csv_help()
    checked = set()
    for rule in DCGM_RULES:
        if rule.source_unit in _HELP_UNIT and rule.series in helps:
            assert _HELP_UNIT[rule.source_unit].lower() in helps[rule.series], rule.series
            assert BY_NAME[rule.name].unit == _OUR_UNIT[rule.source_unit], rule.series
            checked.add(rule.series)
    core = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE",
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_TEMP",
            "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES"}
    assert core <= checked


def test_vllm_units_match_the_help_text() -> None:
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", VLLM_TEXT, re.M))
    expected = {"ratio": "1 means 100 percent", "s": "seconds", "token": "tokens"}
    checked = 0
    for rule in VLLM_RULES:
        help_text = helps.get(rule.series) or helps.get(rule.series + "_total")
        if help_text and rule.source_unit in expected:
            assert expected[rule.source_unit] in help_text, rule.series
            checked += 1
    assert checked >= 8


def test_histogram_rules_are_unscaled() -> None:
    for rule in DCGM_RULES + VLLM_RULES:
        if BY_NAME[rule.name].kind is MetricKind.HISTOGRAM:
            assert rule.scale == 1.0 and BY_NAME[rule.name].unit == "s", rule.series


# --- the scraper over real HTTP ------------------------------------------------------------


class _Exporter(http.server.ThreadingHTTPServer):
    """Serves ``body`` at /metrics; the first ``fail_first`` requests get a 503."""

    daemon_threads = True

    def __init__(self, body: bytes, *, fail_first: int = 0, drip_s: float = 0.0) -> None:
        self.body, self.fail_first, self.drip_s, self.requests = body, fail_first, drip_s, 0
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/metrics"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Exporter

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.requests += 1
        if self.server.requests <= self.server.fail_first:
            self.send_error(503)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        if self.server.drip_s:
            for i in range(len(self.server.body)):
                self.wfile.write(self.server.body[i:i + 1])
                self.wfile.flush()
                time.sleep(self.server.drip_s)
        else:
            self.wfile.write(self.server.body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(server: _Exporter) -> Iterator[_Exporter]:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def exporter() -> Iterator[_Exporter]:
    yield from _serve(_Exporter(DCGM_TEXT.encode()))


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.mark.integration
def test_scrape_over_http_feeds_the_sink(exporter: _Exporter) -> None:
    received: list[list[Point]] = []
    source = ScrapeSource(url=exporter.url, job="gpu-node-1", interval_s=1.0, timeout_s=1.0)
    scraper = Scraper(source, received.append)
    result = scraper.scrape_once()
    scraper.shutdown()
    assert result.ok and result.error is None
    (points,) = received
    assert result.points == len(points) == len(map_exposition(DCGM_TEXT, time_ns=0))
    power = only(points, "hw.power", hw__id=T4_UUID)
    assert power.value == raw(DCGM_TEXT, "DCGM_FI_DEV_POWER_USAGE", UUID=T4_UUID)
    assert power.attributes["service.name"] == "gpu-node-1"
    assert scraper.stats.scrapes_ok == 1 and scraper.stats.points_total == len(points)


@pytest.mark.integration
def test_failing_endpoint_does_not_kill_the_loop() -> None:
    for server in _serve(_Exporter(VLLM_TEXT.encode(), fail_first=3)):
        received: list[list[Point]] = []
        source = ScrapeSource(url=server.url, job="serve", interval_s=0.25, timeout_s=0.25)
        with Scraper(source, received.append) as scraper:
            _wait_for(lambda: scraper.stats.scrapes_ok >= 2)
        stats = scraper.stats
        assert stats.scrapes_failed >= 3 and "503" in (stats.last_error or "")
        assert only(received[-1], "seedance.serve.prefix_cache.hit_tokens").value == 64


@pytest.mark.integration
def test_dead_endpoint_and_broken_sink_are_counted_not_fatal() -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = ScrapeSource(url=f"http://127.0.0.1:{port}/metrics", job="dead",
                        interval_s=0.02, timeout_s=0.02)
    with Scraper(dead, lambda points: None) as scraper:
        _wait_for(lambda: scraper.stats.scrapes_failed >= 3)
        assert scraper._thread is not None and scraper._thread.is_alive()
    assert scraper.stats.scrapes_ok == 0 and "ConnectError" in (scraper.stats.last_error or "")

    def broken_sink(points: list[Point]) -> None:
        raise RuntimeError("store is full")

    for server in _serve(_Exporter(DCGM_TEXT.encode())):
        source = ScrapeSource(url=server.url, job="x", interval_s=0.25, timeout_s=0.25)
        with Scraper(source, broken_sink) as scraper:
            _wait_for(lambda: scraper.stats.scrapes_failed >= 2)
        assert "store is full" in (scraper.stats.last_error or "")


@pytest.mark.integration
def test_a_slow_answer_is_cut_at_the_deadline() -> None:
    for server in _serve(_Exporter(DCGM_TEXT.encode(), drip_s=0.01)):  # ~100 s to send it all
        source = ScrapeSource(url=server.url, job="slow", interval_s=1.0, timeout_s=0.3)
        scraper = Scraper(source, lambda points: None)
        result = scraper.scrape_once()
        scraper.shutdown()
        assert not result.ok and "timeout_s=0.3" in (result.error or "")


def test_lifecycle_is_idempotent(exporter: _Exporter) -> None:
    source = ScrapeSource(url=exporter.url, job="j", interval_s=5.0, timeout_s=1.0)
    scraper = Scraper(source, lambda points: None)
    scraper.start()
    scraper.start()
    scraper.shutdown(5.0)
    scraper.shutdown(5.0)
    with pytest.raises(ScrapeError, match="shut down"):
        scraper.start()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"url": "ftp://x/metrics"}, "url"),
    ({"url": "not a url"}, "url"),
    ({"job": ""}, "job"),
    ({"interval_s": 0}, "interval_s"),
    ({"timeout_s": 10.0}, "timeout_s"),
    ({"kind": "nvml"}, "kind"),
])
def test_source_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    config = {"url": "http://127.0.0.1:9400/metrics", "job": "j", "interval_s": 5.0,
              "timeout_s": 2.0, **kwargs}
    with pytest.raises(ValueError, match=f"ScrapeSource.{field}"):
        ScrapeSource(**config)  # type: ignore[arg-type]
