"""The OpenTelemetry internals the collectors lean on (``collectors._otel_internals``) still do
what the collectors need; a release that moves or changes one fails here first."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from collectors._changed_points import GAUGE_TEMPORALITY
from collectors._otel_internals import map_unit, sanitize_attribute, sanitize_full_name


def test_the_sync_gauge_key_makes_a_reader_export_gauges_as_delta() -> None:
    reader = InMemoryMetricReader(preferred_temporality=GAUGE_TEMPORALITY)  # raises if unknown
    gauge = MeterProvider(metric_readers=[reader]).get_meter("t").create_gauge("g")
    gauge.set(1.0, {"v": "1"})
    first = reader.get_metrics_data()
    gauge.set(2.0, {"v": "2"})
    second = reader.get_metrics_data()

    def points(data: object) -> list[tuple[str, float]]:
        return [(str(p.attributes["v"]), p.value)  # type: ignore[index]
                for rm in data.resource_metrics  # type: ignore[attr-defined]
                for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points]

    assert points(first) == [("1", 1.0)]
    assert points(second) == [("2", 2.0)]  # v1 was not set again: not exported again
    # and without the key, the SDK's default re-exports the frozen stream
    plain = InMemoryMetricReader()
    frozen = MeterProvider(metric_readers=[plain]).get_meter("t").create_gauge("g")
    frozen.set(1.0, {"v": "1"})
    plain.get_metrics_data()
    frozen.set(2.0, {"v": "2"})
    assert sorted(points(plain.get_metrics_data())) == [("1", 1.0), ("2", 2.0)]


def test_the_prometheus_name_translation_is_the_exporters() -> None:
    assert sanitize_full_name("seedance.train.step.duration") == "seedance_train_step_duration"
    assert sanitize_full_name("9lives") == "_lives"  # no leading digit
    assert sanitize_attribute("service.name") == "service_name"
    assert map_unit("s") == "seconds" and map_unit("By") == "bytes"
    assert map_unit("{token}") == ""
