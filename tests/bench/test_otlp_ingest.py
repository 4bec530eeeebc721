"""The ingest bench's exports: each send must carry new timestamps (else the store would see
the same points again) and decode, in both encodings, to every series once."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI

from bench.otlp_ingest import T0, _load, export_body, stamped
from collectors._otlp_decode import (
    DecodedMetrics,
    decode_json,
    decode_protobuf,
    points_from_request,
)
from collectors._otlp_receiver import otlp_router
from tests.collectors.test_otlp_receiver import serve


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


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_an_exporters_variants_carry_the_same_series_with_other_values(encoding: str) -> None:
    decode = decode_json if encoding == "json" else decode_protobuf
    first, second = ({(p.name, tuple(sorted(p.attributes.items()))): p.value
                      for p in points_from_request(decode(export_body(
                          2, metrics=5, series=40, encoding=encoding, variant=v))).points}
                     for v in range(2))
    assert first.keys() == second.keys()
    assert all(first[k] != second[k] for k in first)


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_the_load_speaks_otlp_http_to_a_real_receiver(encoding: str) -> None:
    """The hand-written HTTP/1.1 exporters against the real receiver under uvicorn: every
    answered export is counted with its status, what was accepted was decoded whole, and a
    refusal's Retry-After (1 s here) is waited out, as OTLP exporters do."""
    received: list[DecodedMetrics] = []
    refuse = {"next": False}

    def sink(decoded: DecodedMetrics) -> None:
        refuse["next"] = not refuse["next"]
        if refuse["next"]:  # every other export: the receiver answers 503 and goes on
            raise RuntimeError("store is down")
        received.append(decoded)

    app = FastAPI()
    app.include_router(otlp_router(sink))
    bodies = [[export_body(rank, metrics=4, series=20, encoding=encoding, variant=v)
               for v in range(2)] for rank in range(3)]
    with serve(app) as url:
        out = asyncio.run(_load(url + "/v1/metrics", bodies, encoding, 20, 0.0, 2.0))
    answered = sum(out["status"].values())
    assert set(out["status"]) == {"200", "503"} and answered == len(out["latency_s"])
    assert 3 <= out["status"]["503"] <= 3 * 3  # each exporter: at most one a second, and a last
    assert out["points"] == 20 * out["status"]["200"]
    assert len(received) >= out["status"]["200"]  # (exports in flight at the end count too)
    assert all(len(d) == 20 for d in received)
