"""A real sidecar decodes an exporter's repeat exports from a template, says so on /metrics,
and keeps every point of them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from collectors._store import TimeSeriesStore
from tests.collectors.test_otlp_json_shapes import as_json
from tests.faults._sidecar import PROTOBUF, SidecarProcess, gauge_request


@pytest.mark.parametrize(("encoding", "templated"), [
    # the first export is seen, the second builds the template, the other three use it
    ((PROTOBUF, lambda body: body), 3),
    # the same, and the second is already columns over its shape (JsonShapes)
    (({"Content-Type": "application/json"}, as_json), 4)], ids=["protobuf", "json"])
def test_repeat_exports_are_decoded_from_a_template_and_kept_whole(
        tmp_path: Path, encoding: tuple[dict[str, str], Callable[[bytes], bytes]],
        templated: int) -> None:
    headers, encode = encoding
    t0 = time.time_ns() - 60 * 1_000_000_000
    with SidecarProcess(tmp_path) as sidecar:
        for n in range(5):  # one exporter, 64 series, a new timestamp each export
            r = sidecar.http.post("/v1/metrics", headers=headers, content=encode(
                gauge_request("repeat.gauge", range(64), job="repeat",
                              t0_ns=t0 + n * 1_000_000_000)))
            assert r.status_code == 200, r.text
        assert sidecar.wait_for("the accepted-requests counter", lambda: sidecar.metric(
            "seedance_ingest_accepted_requests_total", decoded_by="template")) == templated
        assert (sidecar.metric("seedance_ingest_accepted_requests_total", decoded_by="any")
                or 0) >= 5
        exposed = [line for line in sidecar.http.get("/metrics").text.splitlines()
                   if line.startswith("repeat_gauge{")]
        assert len(exposed) == 64
    # stopped: every point of the five exports is in the store, at its own time
    with TimeSeriesStore(tmp_path / "metrics.db", readonly=True) as store:
        frame = store.query("repeat.gauge", resolution="raw")
    assert len(frame) == 5 * 64
    assert frame.groupby("id")["time"].nunique().eq(5).all()
    assert sorted(frame["value"].unique()) == [float(i) for i in range(64)]
