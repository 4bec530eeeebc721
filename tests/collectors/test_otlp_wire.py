"""The look at a request's first resource, taken before the request is decoded, says what the
protobuf parser says of that resource, and nothing else, for any request and any bytes."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from collectors._otlp_decode import decode_json
from collectors._otlp_wire import first_resource_strings

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "otlp_opentelemetry-proto_examples_metrics.json"

_KEYS = st.sampled_from(["service.name", "seedance.rank", "host.name", "é.ü", ""])
_VALUES = st.one_of(
    st.text(max_size=12).map(lambda s: AnyValue(string_value=s)),
    st.integers(-2**63, 2**63 - 1).map(lambda i: AnyValue(int_value=i)),
    st.booleans().map(lambda b: AnyValue(bool_value=b)),
    st.floats(allow_nan=False).map(lambda f: AnyValue(double_value=f)),
    st.binary(max_size=6).map(lambda b: AnyValue(bytes_value=b)),
    st.just(AnyValue()),
)
_RESOURCE = st.none() | st.lists(st.tuples(_KEYS, _VALUES | st.none()), max_size=6)


def _request(resources: list[list[tuple[str, AnyValue | None]] | None], points: int
             ) -> ExportMetricsServiceRequest:
    request = ExportMetricsServiceRequest()
    for attributes in resources:
        rm = request.resource_metrics.add()
        if attributes is not None:
            rm.resource.SetInParent()
            rm.resource.attributes.extend(
                KeyValue(key=k) if v is None else KeyValue(key=k, value=v)
                for k, v in attributes)
        gauge = rm.scope_metrics.add().metrics.add(name="m").gauge
        for i in range(points):
            gauge.data_points.add(time_unix_nano=1_700_000_000 + i, as_double=i,
                                  attributes=[KeyValue(key="service.name",
                                                       value=AnyValue(string_value="other"))])
    return request


def _parsed(request: ExportMetricsServiceRequest) -> dict[str, str] | None:
    """What the parser says: the first resource's attributes, the last of a key winning, those
    whose value is a string."""
    if not request.resource_metrics or not request.resource_metrics[0].HasField("resource"):
        return None
    out: dict[str, str] = {}
    for kv in request.resource_metrics[0].resource.attributes:
        if kv.value.WhichOneof("value") == "string_value":
            out[kv.key] = kv.value.string_value
        else:
            out.pop(kv.key, None)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(_RESOURCE, max_size=3), st.integers(0, 3))
def test_it_says_what_the_parser_says_of_the_first_resource(
        resources: list[list[tuple[str, AnyValue | None]] | None], points: int) -> None:
    request = _request(resources, points)
    body = request.SerializeToString()
    assert ExportMetricsServiceRequest.FromString(body) == request
    assert first_resource_strings(body) == _parsed(request)


def test_a_real_export_names_its_job() -> None:
    body = decode_json(EXAMPLE.read_bytes()).SerializeToString()
    assert first_resource_strings(body) == {"service.name": "my.service"}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_give_an_answer_never_an_exception(body: bytes) -> None:
    found = first_resource_strings(body)
    assert found is None or all(isinstance(v, str) for v in found.values())


def test_a_cut_body_never_names_a_wrong_value() -> None:
    """Each prefix of a real body either cannot be read or names only values the whole
    body has (a cut inside a value is not taken as a shorter value)."""
    body = decode_json(EXAMPLE.read_bytes()).SerializeToString()
    whole = first_resource_strings(body)
    assert whole
    for end in range(len(body)):
        found = first_resource_strings(body[:end])
        assert found is None or found.items() <= whole.items()
