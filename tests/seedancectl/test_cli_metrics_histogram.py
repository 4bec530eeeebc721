"""`seedancectl metrics query NAME` on an OTel histogram (#15): the stock SDK records it, its
OTLP request goes through the receiver's decoder into a real store file, and the command shows
its count, sum and buckets under the one name the user knows (the store holds NAME.count,
NAME.sum and NAME.bucket)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from typer.testing import CliRunner

from collectors import TimeSeriesStore, points_from_request
from seedancectl.cli import app

NAME = "test.latency"
VALUES = (3.0, 7.0, 7.0, 300.0)
BOUNDS = (5.0, 10.0, 250.0)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("SEEDANCE_")]:
        monkeypatch.delenv(key)
    reader = InMemoryMetricReader()
    provider = MeterProvider(resource=Resource.create({"service.name": "gpt"}),
                             metric_readers=[reader])
    histogram = provider.get_meter("t").create_histogram(
        NAME, unit="s", explicit_bucket_boundaries_advisory=list(BOUNDS))
    for value in VALUES:
        histogram.record(value, {"phase": "decode"})
    data = reader.get_metrics_data()
    assert data is not None
    path = tmp_path / "data" / "metrics.db"
    path.parent.mkdir()
    with TimeSeriesStore(path) as ts:
        ts.write(points_from_request(encode_metrics(data)).points)
    provider.shutdown()
    return path


def test_histogram_count_sum_and_buckets(store: Path) -> None:
    result = CliRunner().invoke(app, ["metrics", "query", NAME, "--store", str(store),
                                      "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["kind"] == "histogram"
    (point,) = body["points"]
    assert (point["count"], point["sum"]) == (len(VALUES), sum(VALUES))
    assert point["buckets"] == {"5.0": 1, "10.0": 3, "250.0": 3, "+Inf": 4}
    assert (point["service.name"], point["phase"]) == ("gpt", "decode")


def test_histogram_table_and_config(store: Path, tmp_path: Path) -> None:
    config = tmp_path / "seedance.toml"
    config.write_text(f'[sidecar]\nstore = "{store}"\n')
    result = CliRunner().invoke(app, ["metrics", "query", NAME, "-c", str(config),
                                      "--where", "service.name=gpt"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    for text in ("le 5.0: 1", "le +Inf: 4", "317", "1 points"):
        assert text in result.output, result.output
    assert "…" not in result.output
    typo = CliRunner().invoke(app, ["metrics", "query", "test.latncy", "-c", str(config)])
    assert typo.exit_code == 2 and f"did you mean '{NAME}'" in typo.output, typo.output
