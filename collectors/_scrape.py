"""Scrape sources: Prometheus exporters a user already runs (dcgm-exporter, vLLM) -> Points.

Users who already run dcgm-exporter or vLLM should not need a second agent on the GPU: the
sidecar reads their ``/metrics`` and files the numbers under the project's names, so policies
read one vocabulary whether a number came from NVML, a job or a scrape.

Mapping (:func:`map_exposition`, pure, what the tests drive):

- The text is parsed by ``prometheus_client.parser``. Each family the exporter's rule table
  knows becomes our name (see ``collectors/_catalogue.py``), its value multiplied into our unit
  (percent -> fraction, MiB -> bytes, mJ -> J), its labels renamed (:data:`DCGM_LABELS`,
  :data:`VLLM_LABELS`; other labels are kept as they are) and constant attributes added
  (``hw.gpu.task``, ``network.io.direction``, ``clock``, ``pipe``).
- ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` is a bitmask; it becomes a point of value 1 per
  active reason (``reason`` as in :data:`THROTTLE_REASONS`, ``bit_0x...`` for bits NVML does
  not name) and none while nothing throttles, as the NVML sampler emits them.
- Where an exporter exposes the same quantity under an old and a new name at once (vLLM v1
  kept v0's ``gpu_cache_usage_perc`` and ``time_per_output_token_seconds`` beside
  ``kv_cache_usage_perc`` and ``inter_token_latency_seconds`` for a while) the rule listed
  first (the newer name) wins; the other family is kept under its own name, never doubled.
- Unknown families are kept under their own names with their (renamed) labels.
- Counters: the parser removes ``_total`` from a counter's family name (and adds it to its
  samples even where the exporter wrote none, as dcgm-exporter does). We name a kept counter
  after the family, without ``_total``, as OpenTelemetry's Prometheus receiver does; an
  OpenTelemetry Prometheus exporter adds ``_total`` back, so a re-exported name matches the
  original and never becomes ``_total_total``. ``_created`` series (a counter's or
  histogram's creation time, not a measurement) are dropped.
- Histograms: ``NAME.bucket`` (cumulative, attribute ``le`` formatted as Prometheus does,
  ``+Inf`` last), ``NAME.count``, ``NAME.sum``; summaries: ``NAME.count``, ``NAME.sum`` and
  ``NAME`` with attribute ``quantile`` (as ``collectors/_otlp_decode.py`` does for OTLP).
- Every point carries ``seedance.source`` (``dcgm-exporter``, ``vllm``, or ``prometheus`` for
  an exposition from neither). A sample's own timestamp is used when it has one, else the
  scrape time.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import httpx
import pynvml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from collectors._catalogue import BY_NAME
from collectors._errors import ConfigError, SeedanceError
from collectors._points import MetricKind, Point

log = logging.getLogger(__name__)

SOURCE_ATTR = "seedance.source"
"""Which exporter a scraped point came from."""

ScrapeKind = Literal["dcgm", "vllm", "auto"]

_PERCENT = 0.01
_MIB = float(2**20)
_MILLI = 1e-3

DCGM_LABELS: Mapping[str, str] = {
    "gpu": "gpu.index",
    "UUID": "hw.id",
    "pci_bus_id": "gpu.pci_address",
    "modelName": "hw.name",
    "Hostname": "host.name",
    "container": "k8s.container.name",
    "namespace": "k8s.namespace.name",
    "pod": "k8s.pod.name",
}
"""dcgm-exporter label -> our attribute; labels not listed are kept as they are."""

VLLM_LABELS: Mapping[str, str] = {
    "model_name": "gen_ai.request.model",
    "engine": "seedance.vllm.engine",
}
"""vLLM label -> our attribute; labels not listed are kept as they are."""

THROTTLE_REASONS: Mapping[int, str] = {
    pynvml.nvmlClocksThrottleReasonGpuIdle: "gpu_idle",
    pynvml.nvmlClocksThrottleReasonApplicationsClocksSetting: "applications_clocks_setting",
    pynvml.nvmlClocksThrottleReasonSwPowerCap: "sw_power_cap",
    pynvml.nvmlClocksThrottleReasonHwSlowdown: "hw_slowdown",
    pynvml.nvmlClocksThrottleReasonSyncBoost: "sync_boost",
    pynvml.nvmlClocksThrottleReasonSwThermalSlowdown: "sw_thermal_slowdown",
    pynvml.nvmlClocksThrottleReasonHwThermalSlowdown: "hw_thermal_slowdown",
    pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown: "hw_power_brake_slowdown",
    pynvml.nvmlClocksThrottleReasonDisplayClockSetting: "display_clock_setting",
}
"""NVML clock-throttle bits (DCGM's mask is the same, 1:1) -> ``reason`` attribute values."""


class ScrapeError(SeedanceError):
    """A scrape failed: the endpoint did not answer in time, or answered with no exposition."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SeriesRule:
    """How one exporter family becomes one catalogue name.

    ``series`` is the family name as prometheus_client's parser gives it (counters without
    ``_total``). ``scale`` converts ``source_unit`` (the unit the exporter's HELP text states)
    into the catalogue unit; it applies to gauge and counter values, and histogram rules keep 1
    (every mapped histogram is already in seconds). ``bits`` turns a bitmask into one point
    per set bit, named by the attribute ``bit_attribute``.
    """

    series: str
    name: str
    source_unit: str
    scale: float = 1.0
    attributes: Mapping[str, str] = field(default_factory=dict)
    bits: Mapping[int, str] = field(default_factory=dict)
    bit_attribute: str = ""

    def __post_init__(self) -> None:
        if self.name not in BY_NAME:
            raise ConfigError(f"SeriesRule.name: {self.name!r} is not in the metric catalogue")
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ConfigError(f"SeriesRule.scale: expected a positive number, got {self.scale}")
        if bool(self.bits) != bool(self.bit_attribute):
            raise ConfigError("SeriesRule.bit_attribute: set it exactly when bits are set")

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Rules with the same key fill the same series; the first one present wins."""
        return self.name, tuple(sorted(self.attributes.items()))


def _rule(
    series: str, name: str, source_unit: str, scale: float = 1.0, **attrs: str
) -> SeriesRule:
    """A rule; attribute keywords spell dots as ``__`` (``hw__gpu__task`` = ``hw.gpu.task``)."""
    return SeriesRule(series=series, name=name, source_unit=source_unit, scale=scale,
                      attributes={key.replace("__", "."): v for key, v in attrs.items()})


DCGM_RULES: tuple[SeriesRule, ...] = (
    _rule("DCGM_FI_DEV_GPU_UTIL", "hw.gpu.utilization", "%", _PERCENT, hw__gpu__task="general"),
    _rule("DCGM_FI_DEV_ENC_UTIL", "hw.gpu.utilization", "%", _PERCENT, hw__gpu__task="encoder"),
    _rule("DCGM_FI_DEV_DEC_UTIL", "hw.gpu.utilization", "%", _PERCENT, hw__gpu__task="decoder"),
    _rule("DCGM_FI_DEV_MEM_COPY_UTIL", "hw.gpu.memory.utilization", "%", _PERCENT),
    _rule("DCGM_FI_DEV_FB_USED", "hw.gpu.memory.usage", "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_TOTAL", "hw.gpu.memory.limit", "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_FREE", "seedance.gpu.memory.free", "MiB", _MIB),
    _rule("DCGM_FI_DEV_FB_RESERVED", "seedance.gpu.memory.reserved", "MiB", _MIB),
    _rule("DCGM_FI_DEV_POWER_USAGE", "hw.power", "W"),
    _rule("DCGM_FI_DEV_POWER_MGMT_LIMIT", "seedance.gpu.power.limit", "W"),
    _rule("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "hw.energy", "mJ", _MILLI),
    _rule("DCGM_FI_DEV_GPU_TEMP", "hw.temperature", "C"),
    _rule("DCGM_FI_DEV_MEMORY_TEMP", "seedance.gpu.memory.temperature", "C"),
    _rule("DCGM_FI_DEV_SM_CLOCK", "seedance.gpu.clock", "MHz", clock="sm"),
    _rule("DCGM_FI_DEV_MEM_CLOCK", "seedance.gpu.clock", "MHz", clock="memory"),
    _rule("DCGM_FI_DEV_XID_ERRORS", "seedance.gpu.xid.last", "code"),
    SeriesRule(series="DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", name="seedance.gpu.throttle_reasons",
               source_unit="bitmask", bits=THROTTLE_REASONS, bit_attribute="reason"),
    _rule("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "seedance.gpu.pcie.replays", "count"),
    _rule("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "seedance.gpu.nvlink.raw_bandwidth", "raw"),
    _rule("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "seedance.gpu.graphics_engine.active", "ratio"),
    _rule("DCGM_FI_PROF_SM_ACTIVE", "seedance.gpu.sm.active", "ratio"),
    _rule("DCGM_FI_PROF_SM_OCCUPANCY", "seedance.gpu.sm.occupancy", "ratio"),
    _rule("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "seedance.gpu.pipe.active", "ratio", pipe="tensor"),
    _rule("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "seedance.gpu.pipe.active", "ratio", pipe="fp64"),
    _rule("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "seedance.gpu.pipe.active", "ratio", pipe="fp32"),
    _rule("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "seedance.gpu.pipe.active", "ratio", pipe="fp16"),
    _rule("DCGM_FI_PROF_DRAM_ACTIVE", "seedance.gpu.dram.active", "ratio"),
    _rule("DCGM_FI_PROF_PCIE_TX_BYTES", "hw.gpu.io", "B/s", network__io__direction="transmit"),
    _rule("DCGM_FI_PROF_PCIE_RX_BYTES", "hw.gpu.io", "B/s", network__io__direction="receive"),
    _rule("DCGM_FI_PROF_NVLINK_TX_BYTES", "seedance.gpu.nvlink.throughput", "B/s",
          network__io__direction="transmit"),
    _rule("DCGM_FI_PROF_NVLINK_RX_BYTES", "seedance.gpu.nvlink.throughput", "B/s",
          network__io__direction="receive"),
)
"""dcgm-exporter fields. DCGM's profiling (``PROF``) fields are ratios in [0, 1] although some
dcgm-exporter CSVs (and the T4 fixture's DRAM_ACTIVE HELP) say "(in %)"; DCGM's field reference
and the values exporters print are ratios, so they are not scaled. ``PROF_PCIE_*_BYTES`` and
``PROF_NVLINK_*_BYTES`` are rates in bytes per second whatever TYPE the exporter declares."""

VLLM_RULES: tuple[SeriesRule, ...] = (
    # v1 name first: where both are exposed, the newer one fills the series.
    _rule("vllm:kv_cache_usage_perc", "seedance.serve.kv_cache.usage", "ratio"),
    _rule("vllm:gpu_cache_usage_perc", "seedance.serve.kv_cache.usage", "ratio"),
    _rule("vllm:inter_token_latency_seconds", "gen_ai.server.time_per_output_token", "s"),
    _rule("vllm:time_per_output_token_seconds", "gen_ai.server.time_per_output_token", "s"),
    _rule("vllm:time_to_first_token_seconds", "gen_ai.server.time_to_first_token", "s"),
    _rule("vllm:e2e_request_latency_seconds", "gen_ai.server.request.duration", "s"),
    _rule("vllm:prefix_cache_hits", "seedance.serve.prefix_cache.hit_tokens", "token"),
    _rule("vllm:prefix_cache_queries", "seedance.serve.prefix_cache.query_tokens", "token"),
    _rule("vllm:gpu_prefix_cache_hit_rate", "seedance.serve.prefix_cache.hit_ratio", "ratio"),
    _rule("vllm:num_preemptions", "seedance.serve.preemptions", "request"),
    _rule("vllm:num_requests_running", "seedance.serve.batch_size", "request"),
    _rule("vllm:num_requests_waiting", "seedance.serve.queue_depth", "request"),
    _rule("vllm:prompt_tokens", "seedance.serve.prompt_tokens", "token"),
    _rule("vllm:generation_tokens", "seedance.serve.generation_tokens", "token"),
    _rule("vllm:avg_generation_throughput_toks_per_s", "seedance.serve.tokens_per_second",
          "token/s"),
)
"""vLLM (``vllm:*``), v0 and v1 names. ``*_perc`` are fractions ("1 means 100 percent").
Prefix-cache hits and queries count tokens in v1, hence their own ``*_tokens`` names."""


@dataclass(frozen=True, slots=True)
class Exporter:
    """One exporter's vocabulary: how to recognise its families and what they become."""

    kind: str
    source: str
    prefix: str
    labels: Mapping[str, str]
    rules: tuple[SeriesRule, ...]


EXPORTERS: Mapping[str, Exporter] = {
    "dcgm": Exporter("dcgm", "dcgm-exporter", "DCGM_", DCGM_LABELS, DCGM_RULES),
    "vllm": Exporter("vllm", "vllm", "vllm:", VLLM_LABELS, VLLM_RULES),
}
_GENERIC = Exporter("prometheus", "prometheus", "", {}, ())
_SCALAR_TYPES = frozenset({"gauge", "counter", "unknown", "untyped"})


def map_exposition(
    text: str,
    *,
    time_ns: int,
    kind: str = "auto",
    attributes: Mapping[str, str] | None = None,
) -> list[Point]:
    """Parse Prometheus text exposition and map it to Points (see the module docstring).

    ``kind`` picks the rule table ("dcgm", "vllm"), or "auto" recognises the exporter from
    its families' prefixes. ``attributes`` are added to every point (a clash: the label wins).
    Raises :class:`ScrapeError` when the text is not a valid exposition.
    """
    if kind != "auto" and kind not in EXPORTERS:
        raise ValueError(f"kind: expected 'auto' or one of {sorted(EXPORTERS)}, got {kind!r}")
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError, KeyError) as e:
        raise ScrapeError(f"not a Prometheus text exposition: {e}") from e
    if kind == "auto":
        candidates = list(EXPORTERS.values())
        default = next(  # for families with no exporter prefix (process_*, python_gc_*)
            (e for e in candidates if any(f.name.startswith(e.prefix) for f in families)),
            _GENERIC,
        )
    else:
        candidates = [EXPORTERS[kind]]
        default = EXPORTERS[kind]
    winners = _winning_rules(families, candidates)
    created = _created_families(families)
    extra = dict(attributes or {})
    points: list[Point] = []
    try:
        for family in families:
            if family.name in created:
                continue
            exporter = next((e for e in candidates if family.name.startswith(e.prefix)), default)
            base = {**extra, SOURCE_ATTR: exporter.source}
            rule = winners.get(family.name)
            if rule is not None and not _fits(rule, family):
                log.warning("scrape: %s has TYPE %s, %s expects %s; kept unmapped",
                            family.name, family.type, rule.name, BY_NAME[rule.name].kind.value)
                rule = None
            points.extend(_family_points(family, rule, exporter.labels, base, time_ns))
    except ValueError as e:  # an unparseable ``le`` or ``quantile`` label
        raise ScrapeError(f"not a Prometheus text exposition: {e}") from e
    return points


def _winning_rules(families: list[Metric], exporters: list[Exporter]) -> dict[str, SeriesRule]:
    present = {family.name for family in families}
    winners: dict[str, SeriesRule] = {}
    for exporter in exporters:
        taken: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for rule in exporter.rules:
            if rule.series in present and rule.key not in taken:
                winners[rule.series] = rule
                taken.add(rule.key)
    return winners


def _created_families(families: list[Metric]) -> set[str]:
    """``X_created`` families that only timestamp a counter, histogram or summary ``X``."""
    cumulative = {f.name for f in families if f.type in ("counter", "histogram", "summary")}
    return {
        f.name for f in families
        if f.name.endswith("_created") and f.name.removesuffix("_created") in cumulative
    }


def _fits(rule: SeriesRule, family: Metric) -> bool:
    if BY_NAME[rule.name].kind is MetricKind.HISTOGRAM:
        return family.type == "histogram"
    return family.type in _SCALAR_TYPES


def _family_points(
    family: Metric,
    rule: SeriesRule | None,
    labels: Mapping[str, str],
    base: Mapping[str, str],
    time_ns: int,
) -> Iterator[Point]:
    name = family.name if rule is None else rule.name
    constant = {} if rule is None else dict(rule.attributes)
    scale = 1.0 if rule is None else rule.scale
    for sample in family.samples:
        attrs = {**base, **constant}
        for label, label_value in sample.labels.items():
            attrs[labels.get(label, label)] = label_value
        if family.type in ("histogram", "summary"):
            series, value = _histogram_part(family, sample, name, attrs)
        else:
            series, value = name, float(sample.value) * scale
        t_ns = time_ns if sample.timestamp is None else _ms_to_ns(float(sample.timestamp))
        if rule is not None and rule.bits:
            yield from _bit_points(series, value, rule, attrs, t_ns)
        else:
            yield Point(series, float(value), t_ns, attrs)


def _ms_to_ns(timestamp_s: float) -> int:
    """Exposition timestamps are whole milliseconds; the parser hands them over as float s."""
    return round(timestamp_s * 1000) * 1_000_000


def _histogram_part(
    family: Metric, sample: Sample, name: str, attrs: dict[str, str]
) -> tuple[str, float]:
    suffix = sample.name[len(family.name):]
    if suffix == "_bucket":
        attrs["le"] = floatToGoString(float(sample.labels["le"]))
        return f"{name}.bucket", sample.value
    if suffix in ("_count", "_sum"):
        return f"{name}.{suffix[1:]}", sample.value
    if "quantile" in sample.labels:
        attrs["quantile"] = floatToGoString(float(sample.labels["quantile"]))
    return name, sample.value


def _bit_points(
    name: str, value: float, rule: SeriesRule, attrs: Mapping[str, str], time_ns: int
) -> Iterable[Point]:
    mask = int(value)
    for bit in (1 << i for i in range(mask.bit_length())):
        if mask & bit:
            reason = rule.bits.get(bit, f"bit_{bit:#x}")
            yield Point(name, 1.0, time_ns, {**attrs, rule.bit_attribute: reason})


class PointSink(Protocol):
    """Where a scraper hands each scrape's points; called from the scraper's thread."""

    def __call__(self, points: list[Point], /) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ScrapeSource:
    """One exporter endpoint to scrape; ``job`` becomes the points' ``service.name``."""

    url: str
    job: str
    interval_s: float = 5.0
    timeout_s: float = 2.0
    kind: ScrapeKind = "auto"

    def __post_init__(self) -> None:
        try:
            url = httpx.URL(self.url)
        except httpx.InvalidURL as e:
            raise ConfigError(f"ScrapeSource.url: {e}") from e
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"ScrapeSource.url: expected an http(s) URL, got {self.url!r}")
        if not self.job:
            raise ConfigError("ScrapeSource.job: must not be empty")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ConfigError(f"ScrapeSource.interval_s: expected > 0, got {self.interval_s}")
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= self.interval_s):
            raise ConfigError(
                f"ScrapeSource.timeout_s: expected 0 < timeout_s <= interval_s "
                f"({self.interval_s}), got {self.timeout_s}"
            )
        if self.kind != "auto" and self.kind not in EXPORTERS:
            raise ConfigError(
                f"ScrapeSource.kind: expected 'auto' or one of {sorted(EXPORTERS)}, "
                f"got {self.kind!r}"
            )


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """What one scrape did: how many points it handed on, or why it failed."""

    ok: bool
    points: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ScrapeStats:
    """Counts since start; ``last_error`` is the most recent failure's message."""

    scrapes_ok: int = 0
    scrapes_failed: int = 0
    points_total: int = 0
    last_error: str | None = None
    up: bool | None = None
    """Whether the last scrape worked (None before the first)."""


_ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"


class Scraper:
    """Scrapes one source every ``interval_s`` on its own daemon thread and feeds a sink.

    A failing fetch, parse or sink is logged (on the first failure and on recovery; repeats at
    debug level) and counted in :attr:`stats`; the loop goes on. ``start()`` and
    ``shutdown(timeout_s)`` are idempotent and it is a context manager. Scrapes are scheduled
    on a fixed grid of ``interval_s``; a scrape that overruns skips the slots it missed. The
    HTTP client ignores proxy settings from the environment: exporters are node-local.
    """

    def __init__(self, source: ScrapeSource, sink: PointSink) -> None:
        self.source = source
        self._sink = sink
        self._client = httpx.Client(trust_env=False, headers={"Accept": _ACCEPT})
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stats = ScrapeStats()
        self._failing = False

    @property
    def stats(self) -> ScrapeStats:
        with self._lock:
            return self._stats

    def scrape_once(self) -> ScrapeResult:
        """Fetch, map and hand on one scrape; a failure comes back as the result."""
        try:
            text = self._fetch()
            points = map_exposition(text, time_ns=time.time_ns(), kind=self.source.kind,
                                    attributes={"service.name": self.source.job})
        except ScrapeError as e:
            return self._record(ScrapeResult(ok=False, error=str(e)))
        try:
            self._sink(points)
        except Exception as e:  # a broken sink must not stop the loop
            log.debug("scrape sink failed", exc_info=True)
            return self._record(ScrapeResult(ok=False, error=f"sink failed: {e!r}"))
        return self._record(ScrapeResult(ok=True, points=len(points)))

    def _fetch(self) -> str:
        deadline = time.monotonic() + self.source.timeout_s
        try:
            with self._client.stream("GET", self.source.url,
                                     timeout=self.source.timeout_s) as response:
                response.raise_for_status()
                chunks = []
                for chunk in response.iter_bytes():
                    if time.monotonic() > deadline:
                        raise ScrapeError(
                            f"{self.source.url}: no full answer within "
                            f"timeout_s={self.source.timeout_s}"
                        )
                    chunks.append(chunk)
                return b"".join(chunks).decode(response.encoding or "utf-8", errors="replace")
        except httpx.HTTPError as e:
            raise ScrapeError(f"{self.source.url}: {type(e).__name__}: {e}") from e

    def _record(self, result: ScrapeResult) -> ScrapeResult:
        with self._lock:
            s = self._stats
            if result.ok:
                self._stats = ScrapeStats(s.scrapes_ok + 1, s.scrapes_failed,
                                          s.points_total + result.points, s.last_error, True)
            else:
                self._stats = ScrapeStats(s.scrapes_ok, s.scrapes_failed + 1, s.points_total,
                                          result.error, False)
            was_failing, self._failing = self._failing, not result.ok
        if not result.ok:
            level = logging.DEBUG if was_failing else logging.WARNING
            log.log(level, "scrape of %s (job %s) failed: %s", self.source.url,
                    self.source.job, result.error)
        elif was_failing:
            log.info("scrape of %s (job %s) works again", self.source.url, self.source.job)
        return result

    def start(self) -> None:
        with self._lock:
            if self._stop.is_set():
                raise ScrapeError(f"scraper for {self.source.url} was shut down; make a new one")
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, name=f"seedance-scrape-{self.source.job}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        interval_s = self.source.interval_s
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.scrape_once()
            except Exception:  # a bug, but the loop never dies
                log.exception("scrape of %s crashed; going on", self.source.url)
            now = time.monotonic()
            next_at += interval_s * max(1, math.ceil((now - next_at) / interval_s))
            self._stop.wait(max(0.0, next_at - now))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and close the client; waits up to ``timeout_s`` for a scrape."""
        with self._lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        self._client.close()

    def __enter__(self) -> Scraper:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
