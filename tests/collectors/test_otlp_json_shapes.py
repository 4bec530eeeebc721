"""Repeat OTLP/JSON exports are handed on as columns over a shared shape: the same Points as
the fast path gives, the same store and /metrics downstream, bounded memory, and no shape
for what does not repeat."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from collectors._cardinality import CardinalityLimit
from collectors._otlp_decode import DecodedMetrics
from collectors._otlp_json import points_from_json
from collectors._otlp_json_shapes import JsonShapes
from tests.collectors.test_otlp_templates import Pipeline, gauges, scraped, sdk_exports


def as_json(body: bytes) -> bytes:
    """A protobuf export as an OTLP/JSON exporter sends it (camelCase, 64-bit ints as
    strings)."""
    return json_format.MessageToJson(
        ExportMetricsServiceRequest.FromString(body)).encode()


def test_repeat_sdk_exports_are_columns_with_the_fast_paths_points() -> None:
    shapes = JsonShapes()
    bodies = [as_json(b) for b in sdk_exports(6, delta=True)]
    for n, body in enumerate(bodies):
        decoded, expected = shapes.decode(body), points_from_json(body)
        assert (decoded.shape is not None) == (n > 0)  # the first sighting only notes it
        assert decoded.points == expected.points
        assert decoded.metrics == expected.metrics
    assert shapes.hits == 5


def test_a_changed_attribute_is_another_shape_and_small_bodies_none() -> None:
    shapes = JsonShapes()
    for version in "1212":
        for stamp in range(2):
            body = as_json(gauges(20, stamp=stamp, version=version))
            decoded = shapes.decode(body)
            assert decoded.points == points_from_json(body).points
    first, second = (shapes.decode(as_json(gauges(20, stamp=9, version=v))) for v in "12")
    assert first.shape is not None and second.shape is not None
    assert first.shape is not second.shape
    assert first.shape.attributes[0]["seedance.config.version"] == "1"
    small = as_json(gauges(4, stamp=0))
    assert all(shapes.decode(small).shape is None for _ in range(3))


def test_times_past_int64_keep_the_points_path() -> None:
    shapes = JsonShapes()
    request = ExportMetricsServiceRequest.FromString(gauges(20, stamp=0))
    for dp in request.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points:
        dp.time_unix_nano = 2**63 + 5
    late = json_format.MessageToJson(request).encode()
    for _ in range(3):
        decoded = shapes.decode(late)
        assert decoded.shape is None
        assert decoded.points == points_from_json(late).points
    assert decoded.points[0].time_ns == 2**63 + 5
    assert shapes.hits == 0


def test_shapes_are_bounded_in_number_and_points() -> None:
    shapes = JsonShapes(max_shapes=4, max_points=100)
    for stamp in range(3):
        for rank in range(10):
            body = as_json(gauges(32, stamp=stamp, rank=str(rank)))
            assert shapes.decode(body).points == points_from_json(body).points
    assert len(shapes._shapes) <= 4 and shapes._points <= 100
    assert shapes.hits == 0  # ten shapes in turn through room for three: none comes back


def test_repeat_json_exports_land_where_their_points_would(tmp_path: Path) -> None:
    """The sink, fed columns or the same exports' Points, must give the same store rows,
    /metrics and limiter counts."""
    shapes = JsonShapes()
    sunk_alike(shapes.decode, [as_json(b) for b in [
        *sdk_exports(4, delta=True), *(gauges(40, stamp=s, version=v) for v in "12"
                                       for s in range(3))]], tmp_path)
    assert shapes.hits >= 6


def sunk_alike(decode: Callable[[bytes], DecodedMetrics], bodies: list[bytes],
               tmp_path: Path) -> None:
    """Store rows, /metrics and limiter counts must be the same whether the sink is fed
    ``decode``'s answers or the fast path's Points of the same bodies."""
    shaped, plain = (Pipeline(tmp_path / f"{n}.db", CardinalityLimit()) for n in "ab")
    for body in bodies:
        shaped.sink(decode(body))
        plain.sink(points_from_json(body))
    assert shaped.limiter.series() == plain.limiter.series()
    assert scraped(shaped.registry) == pytest.approx(scraped(plain.registry), rel=1e-12)
    names = sorted(plain.store.metrics()["name"])
    assert names == sorted(shaped.store.metrics()["name"]) and len(names) >= 6
    for name in names:
        pd.testing.assert_frame_equal(shaped.store.query(name, resolution="raw"),
                                      plain.store.query(name, resolution="raw"))
    for store in (shaped.store, plain.store):
        store.close()
