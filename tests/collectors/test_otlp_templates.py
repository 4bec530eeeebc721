"""Templates decode repeat OTLP exports exactly as the reference path does, and only when they
safely can: real SDK exports, changed shapes, never-repeating shapes, bad bodies, bounded
memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collectors._cardinality import CardinalityLimit, SeriesLimiter
from collectors._otlp_decode import (
    DecodedMetrics,
    OtlpDecodeError,
    decode_json,
    decode_protobuf,
    points_from_request,
)
from collectors._otlp_templates import (
    BUILDS_PER_S,
    MIN_TEMPLATE_POINTS,
    ExportTemplates,
    protobuf_templates,
)
from collectors._prometheus import LatestValueCollector
from collectors._store import TimeSeriesStore

DATA = Path(__file__).resolve().parents[1] / "data"


def reference(body: bytes) -> DecodedMetrics:
    return points_from_request(decode_protobuf(body))


def same(templates: ExportTemplates, body: bytes) -> None:
    got, expected = templates.decode(body), reference(body)
    assert got.points == expected.points
    assert got.metrics == expected.metrics


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def gauges(series: int, *, stamp: int, version: str = "1", rank: str = "0",
           flagged: tuple[int, ...] = ()) -> bytes:
    """One export of ``series`` double gauges; ``flagged`` points carry no recorded value."""
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    rm.resource.attributes.extend([_kv("service.name", "job"), _kv("seedance.rank", rank)])
    gauge = rm.scope_metrics.add().metrics.add(name="grad.norm", unit="1").gauge
    for s in range(series):
        dp = gauge.data_points.add(time_unix_nano=1_700_000_000_000_000_000 + stamp,
                                   as_double=s * 1.5 + stamp,
                                   attributes=[_kv("module", f"layer{s:03d}"),
                                               _kv("seedance.config.version", version)])
        if s in flagged:
            dp.flags = 1
    return request.SerializeToString()


def sdk_exports(count: int, *, delta: bool = False) -> Iterator[bytes]:
    """``count`` consecutive exports of a real OpenTelemetry SDK: gauges, int and double
    counters, an up-down counter and histograms, over several attribute sets (counters and
    histograms in delta temporality when ``delta``)."""
    reader = InMemoryMetricReader(preferred_temporality={
        Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA,
    } if delta else None)
    provider = MeterProvider(resource=Resource.create({"service.name": "sdk-job",
                                                       "seedance.rank": "1"}),
                             metric_readers=[reader])
    meter = provider.get_meter("test")
    step = {"n": 0}

    def norms(options: CallbackOptions) -> list[Observation]:
        return [Observation(0.1 * m + step["n"], {"module": f"m{m}"}) for m in range(12)]

    meter.create_observable_gauge("grad.norm", callbacks=[norms])
    tokens = meter.create_counter("tokens")
    loss = meter.create_counter("loss.sum")
    inflight = meter.create_up_down_counter("inflight")
    latency = meter.create_histogram("step.seconds", unit="s")
    try:
        for n in range(count):
            step["n"] = n
            for phase in ("fwd", "bwd", "opt"):
                tokens.add(100 + n, {"phase": phase})
                loss.add(0.25 * n + 0.5, {"phase": phase})
                inflight.add(1 if n % 2 else -1, {"phase": phase})
                latency.record(0.01 * (n + 1), {"phase": phase})
                latency.record(3.0 + n, {"phase": phase})
            data = reader.get_metrics_data()
            assert data is not None
            yield encode_metrics(data).SerializeToString()
    finally:
        provider.shutdown()


def test_repeat_sdk_exports_decode_from_a_template_exactly_as_the_reference() -> None:
    templates = protobuf_templates(decode_protobuf)
    bodies = list(sdk_exports(6))
    assert len(reference(bodies[0]).points) >= MIN_TEMPLATE_POINTS
    for body in bodies:
        same(templates, body)
    # the first two are learnt (seen, then built); the rest repeat the shape
    assert templates.hits == 4
    assert templates.builds == 1


def test_a_changed_attribute_is_a_new_shape_and_both_decode_right() -> None:
    templates = protobuf_templates(decode_protobuf)
    for version in ("1", "2"):  # a new config version: same length, other bytes
        for stamp in range(4):
            same(templates, gauges(64, stamp=stamp, version=version))
    # version 1 is learnt over two exports; version 2 replaces it at its first export, as an
    # exporter already seen changed shape
    assert templates.hits == 2 + 3
    assert templates.builds == 2


def test_points_without_a_recorded_value_are_left_out_as_the_reference_does() -> None:
    templates = protobuf_templates(decode_protobuf)
    for stamp in range(4):
        same(templates, gauges(40, stamp=stamp, flagged=(3, 17)))
    assert templates.hits == 2
    assert len(templates.decode(gauges(40, stamp=9, flagged=(3, 17))).points) == 38


def test_exports_that_never_repeat_stop_costing_template_builds() -> None:
    templates = protobuf_templates(decode_protobuf)
    bodies = [gauges(64, stamp=1, version=f"{v:04d}") for v in range(60)]
    for body in bodies:
        same(templates, body)
    assert templates.hits == 0
    assert templates.builds <= 4  # three strikes, then the shape is left alone


def test_new_shapes_every_export_cost_at_most_the_build_budget() -> None:
    """Each export from a new rank (its resource differs before the first number): no template
    is ever used, so builds are held to BUILDS_PER_S a second, however many exports come."""
    now = [0.0]
    templates = ExportTemplates(reference, clock=lambda: now[0])
    for rank in range(100, 400):  # 300 exports, the same length, each a new shape
        same(templates, gauges(32, stamp=1, rank=str(rank)))
    assert templates.hits == 0
    assert templates.builds == BUILDS_PER_S
    now[0] += 1.0  # a second later the budget is back
    same(templates, gauges(32, stamp=1, rank="999"))
    assert templates.builds == BUILDS_PER_S + 1


def test_shapes_a_template_cannot_hold_are_decoded_by_the_reference() -> None:
    """The opentelemetry-proto example holds exponential histograms, summaries and
    exemplars."""
    request = decode_json((DATA / "otlp_opentelemetry-proto_examples_metrics.json").read_bytes())
    body = request.SerializeToString()
    templates = protobuf_templates(decode_protobuf)
    for _ in range(3):
        same(templates, body)
    assert templates.hits == 0


def test_small_exports_are_not_worth_a_template() -> None:
    templates = protobuf_templates(decode_protobuf)
    for stamp in range(4):
        same(templates, gauges(MIN_TEMPLATE_POINTS - 1, stamp=stamp))
    assert templates.hits == 0


def test_a_bad_body_of_a_known_shape_gets_the_reference_error() -> None:
    templates = protobuf_templates(decode_protobuf)
    for stamp in range(3):
        templates.decode(gauges(64, stamp=stamp))
    good = gauges(64, stamp=7)
    # same length and first bytes, a broken length prefix in the middle
    broken = bytearray(good)
    middle = good.index(b"layer032") - 3
    broken[middle] = 0xFF
    with pytest.raises(OtlpDecodeError):
        reference(bytes(broken))
    with pytest.raises(OtlpDecodeError):
        templates.decode(bytes(broken))
    same(templates, good)


def test_templates_are_bounded_in_number_and_points() -> None:
    templates = ExportTemplates(reference, max_templates=4, max_points=200)
    for stamp in range(3):
        for rank in range(10):  # ten exporters, one shape each
            same(templates, gauges(32, stamp=stamp, rank=str(rank)))
    assert len(templates._shapes) <= 4
    assert templates._points <= 200


class Pipeline:
    """The sidecar's sink, in order: cardinality limit, /metrics view, store."""

    def __init__(self, path: Path, limit: CardinalityLimit) -> None:
        self.limiter = SeriesLimiter(limit)
        self.latest = LatestValueCollector()
        self.registry = CollectorRegistry()
        self.registry.register(self.latest)
        self.store = TimeSeriesStore(path)

    def sink(self, decoded: DecodedMetrics) -> None:
        decoded = self.limiter.admit_decoded(decoded)
        self.latest.update(decoded)
        self.store.write_decoded(decoded)


@pytest.mark.parametrize("limit", [CardinalityLimit(), CardinalityLimit(max_per_metric=5)],
                         ids=["within-limits", "over-the-metric-limit"])
def test_repeat_exports_as_columns_land_where_their_points_would(
        tmp_path: Path, limit: CardinalityLimit) -> None:
    """The same exports through the sink twice: as template columns (no Point built), and as
    the reference path's Points. Store, /metrics and the limiter's counts must agree."""
    templates = protobuf_templates(decode_protobuf)
    shaped, plain = Pipeline(tmp_path / "a.db", limit), Pipeline(tmp_path / "b.db", limit)
    bodies = [*sdk_exports(5), *(gauges(40, stamp=s, version=v) for v in "12" for s in range(3))]
    columns = 0
    for body in bodies:
        decoded = templates.decode(body)
        columns += decoded.shape is not None
        shaped.sink(decoded)
        plain.sink(reference(body))
    assert columns == templates.hits >= 6
    assert shaped.limiter.dropped == plain.limiter.dropped
    assert shaped.limiter.series() == plain.limiter.series()
    if limit.max_per_metric == 5:
        assert sum(shaped.limiter.dropped.values()) > 0
    assert generate_latest(shaped.registry) == generate_latest(plain.registry)
    names = sorted(plain.store.metrics()["name"])
    assert names == sorted(shaped.store.metrics()["name"]) and len(names) >= 6
    for name in names:
        pd.testing.assert_frame_equal(shaped.store.query(name, resolution="raw"),
                                      plain.store.query(name, resolution="raw"))
    shaped.store.close()
    plain.store.close()


def test_interleaved_shapes_on_metrics_show_the_last_export_and_add_up_deltas(
        tmp_path: Path) -> None:
    """Repeat exports wait, per shape, for a scrape to fold them in: two shapes over the same
    series, interleaved, and delta counters summed over several exports, must scrape exactly
    as the reference path, which applies every export at once (sums to rounding: they are
    added in another order)."""
    templates = protobuf_templates(decode_protobuf)
    shaped, plain = (Pipeline(tmp_path / f"{n}.db", CardinalityLimit()) for n in "ab")
    wide = [gauges(40, stamp=s) for s in range(0, 12, 2)]
    narrow = [gauges(30, stamp=s) for s in range(1, 12, 2)]  # the first 30 series of wide
    deltas = list(sdk_exports(6, delta=True))
    scrapes = columns = 0
    for i, body in enumerate(b for trio in zip(wide, narrow, deltas, strict=True) for b in trio):
        decoded = templates.decode(body)
        shaped.sink(decoded)
        plain.sink(reference(body))
        if i % 7 == 6:  # a scrape now and then folds what is pending
            assert scraped(shaped.registry) == pytest.approx(scraped(plain.registry), rel=1e-12)
            scrapes += 1
        columns += decoded.shape is not None
    assert columns >= 12  # most exports went the columns' way
    assert scrapes >= 2
    final = scraped(shaped.registry)
    assert final == pytest.approx(scraped(plain.registry), rel=1e-12)
    def norm(module: str) -> float:
        return final["grad_norm", (("module", module), ("seedance_config_version", "1"),
                                   ("seedance_rank", "0"), ("service_name", "job"))]

    assert norm("layer000") == 11.0  # both shapes carry it: narrow's stamp 11 came last
    assert norm("layer035") == 35 * 1.5 + 10.0  # wide's alone: its last, stamp 10
    assert final["tokens_total", (("phase", "fwd"), ("seedance_rank", "1"),
                                  ("service_name", "sdk-job"))] == sum(100 + n for n in range(6))
    for store in (shaped.store, plain.store):
        store.close()


def scraped(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample /metrics shows: (name, sorted labels) -> value."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples}


def test_a_shape_admitted_whole_is_still_kept_alive_and_forgotten_like_its_series() -> None:
    """The limiter skips looking up a shape it admitted whole until its series map rotates:
    series in use must stay counted across rotations, idle ones must go even while only
    repeats arrive, and come back when sent again."""
    now = [0.0]
    limiter = SeriesLimiter(CardinalityLimit(idle_s=10.0), clock=lambda: now[0])
    templates = protobuf_templates(decode_protobuf)
    busy = [templates.decode(gauges(40, stamp=s)) for s in range(4)][-1]
    idle = [templates.decode(gauges(20, stamp=s, rank="1")) for s in range(4)][-1]
    assert busy.shape is not None and idle.shape is not None
    limiter.admit_decoded(idle)
    for step in range(40):  # a repeat every 3 s for 120 s: twelve rotations
        now[0] = 3.0 * step
        assert limiter.admit_decoded(busy) is busy
        if now[0] < 10.0 or now[0] >= 30.0:  # idle goes after 10 to 20 s unused
            assert limiter.series() == (60 if now[0] < 10.0 else 40)
    limiter.admit_decoded(idle)
    assert limiter.series() == 60


def test_metrics_view_bounds_what_waits_for_a_scrape(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes that come and go (exporters restarting, templates rebuilt) must not pile up
    pending values until a scrape that may never come: past the bound they are folded in."""
    monkeypatch.setattr("collectors._prometheus._PENDING_MAX_POINTS", 100)
    templates = protobuf_templates(decode_protobuf)
    shaped, plain = (Pipeline(tmp_path / f"{n}.db", CardinalityLimit()) for n in "ab")
    def send(stamp: int, rank: int) -> None:
        body = gauges(40, stamp=stamp, rank=str(rank))
        shaped.sink(templates.decode(body))
        plain.sink(reference(body))

    for rank in range(10):  # ten shapes of 40 points, each sent until it is templated
        for stamp in range(2):
            send(stamp, rank)
    for stamp in range(2, 5):  # then only repeats, which fold nothing in by themselves
        for rank in range(10):
            send(stamp, rank)
            assert sum(len(shape.names) for shape in shaped.latest._pending) <= 100
    assert templates.hits >= 30
    assert scraped(shaped.registry) == scraped(plain.registry)
    for store in (shaped.store, plain.store):
        store.close()
