"""OTLP traces -> SpanRecords: the wire formats (protobuf, JSON) and one flat record per span.

The sidecar keeps spans to answer one question, "what happened to this change?", so a record
holds what a reader of one trace needs (ids, parent, name, times, status, attributes, the
emitting service) and drops the rest (events, links, dropped counts).

OTLP/JSON differs from protobuf's JSON mapping in one place that matters here: trace and span
ids are hex strings, not base64 (opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding); they
are converted before parsing, so both encodings give the same ids.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from collectors._otlp_decode import OtlpDecodeError, _any_to_py, kept_resource_attribute
from collectors.names import ATTR_SERVICE_NAME

_ID_KEYS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")
_STATUS = {trace_pb2.Status.STATUS_CODE_UNSET: "unset", trace_pb2.Status.STATUS_CODE_OK: "ok",
           trace_pb2.Status.STATUS_CODE_ERROR: "error"}


@dataclass(frozen=True, kw_only=True)
class SpanRecord:
    """One finished span. Ids are lowercase hex (32 / 16 digits); ``parent_span_id`` is "" for
    a root. ``attributes`` are the span's own (JSON values); ``resource`` the resource
    attributes (service.name, host.name, seedance.rank, ...) that
    ``kept_resource_attribute`` keeps."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    status: str = "unset"
    status_message: str = ""
    service: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)
    resource: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "attributes": dict(self.attributes),
                "resource": dict(self.resource)}


def decode_traces_protobuf(body: bytes) -> ExportTraceServiceRequest:
    """Parse a binary protobuf request; OtlpDecodeError on malformed or truncated input."""
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RecursionError) as e:
        raise OtlpDecodeError(f"malformed protobuf ExportTraceServiceRequest: {e}") from e
    return request


def decode_traces_json(body: bytes) -> ExportTraceServiceRequest:
    """Parse an OTLP/JSON request (hex ids, lowerCamelCase or proto field names, unknown fields
    ignored); OtlpDecodeError on bad input."""
    request = ExportTraceServiceRequest()
    try:
        parsed = json.loads(body)
        json_format.ParseDict(_hex_ids_to_base64(parsed), request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
        raise OtlpDecodeError(f"malformed OTLP/JSON ExportTraceServiceRequest: {e}") from e
    return request


def _hex_ids_to_base64(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (_b64(v) if k in _ID_KEYS and isinstance(v, str) else _hex_ids_to_base64(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids_to_base64(v) for v in node]
    return node


def _b64(hex_id: str) -> str:
    try:
        return base64.b64encode(bytes.fromhex(hex_id)).decode()
    except ValueError as e:
        raise ValueError(f"span or trace id {hex_id!r} is not hex") from e


def spans_from_request(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    """Every span of ``request`` as a SpanRecord; OtlpDecodeError on a span with a bad id."""
    out: list[SpanRecord] = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _any_to_py(kv.value) for kv in resource_spans.resource.attributes
                    if kept_resource_attribute(kv.key)}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if len(span.trace_id) != 16 or len(span.span_id) != 8 or len(
                        span.parent_span_id) not in (0, 8):
                    raise OtlpDecodeError(
                        f"span {span.name!r}: trace_id must be 16 bytes, span_id 8 and "
                        f"parent_span_id 0 or 8, got {len(span.trace_id)}, {len(span.span_id)}, "
                        f"{len(span.parent_span_id)}")
                out.append(SpanRecord(
                    trace_id=binascii.hexlify(span.trace_id).decode(),
                    span_id=binascii.hexlify(span.span_id).decode(),
                    parent_span_id=binascii.hexlify(span.parent_span_id).decode(),
                    name=span.name, start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    status=_STATUS.get(span.status.code, "unset"),
                    status_message=span.status.message,
                    service=str(resource.get(ATTR_SERVICE_NAME, "")),
                    attributes={kv.key: _any_to_py(kv.value) for kv in span.attributes},
                    resource=resource))
    return out


__all__ = ["SpanRecord", "decode_traces_json", "decode_traces_protobuf", "spans_from_request"]
