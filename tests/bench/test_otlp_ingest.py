"""The ingest bench's exports: each send must carry new timestamps (else the store would see
the same points again) and decode, in both encodings, to every series once."""

from __future__ import annotations

import pytest

from bench.otlp_ingest import T0, export_body, stamped
from collectors._otlp_decode import decode_json, decode_protobuf, points_from_request


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_a_stamped_export_carries_every_series_once_at_the_new_time(encoding: str) -> None:
    body = export_body(3, metrics=5, series=40, encoding=encoding)
    decode = decode_json if encoding == "json" else decode_protobuf
    t = T0 + 7_000_000_000
    points = points_from_request(decode(stamped(body, encoding, t))).points
    assert len(points) == 40
    assert {p.time_ns for p in points} == {t}
    assert len({(p.name, tuple(sorted(p.attributes.items()))) for p in points}) == 40
    assert {p.attributes["seedance.rank"] for p in points} == {"3"}
