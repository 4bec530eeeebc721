"""The report's first screen and its plain words, over the recorded week (a real demo run
replayed, see week_fixture) and over a store where a serving job and an idle one report."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from collectors._points import CONFIG_VERSION_ATTR, Point
from collectors._store import TimeSeriesStore
from dashboards.report import ReportPaths, build_report
from policies import sqlite_url
from tests.dashboards.week_fixture import RecordedWeek, build_week

NS = 1_000_000_000
JARGON = ("policies.", "payback_months", "equivalent_scale_out_nodes", "e-0", "gamma",
          "fraction of", "throughput_by_version")


@pytest.fixture(scope="module")
def week(tmp_path_factory: pytest.TempPathFactory) -> RecordedWeek:
    return build_week(tmp_path_factory.mktemp("week"))


@pytest.fixture(scope="module")
def built(week: RecordedWeek, tmp_path_factory: pytest.TempPathFactory) -> ReportPaths:
    return build_report(store_path=week.store_path, state_db_url=week.state_url,
                        since_ns=week.since_ns, until_ns=week.until_ns,
                        out_dir=tmp_path_factory.mktemp("report"), price_per_gpu_hour=3.0,
                        currency="EUR")


def _job(built: ReportPaths) -> dict[str, Any]:
    return json.loads(built.json.read_text())["jobs"][0]


def test_the_headline_comes_first_and_says_what_was_kept_rolled_back_and_spent(
        built: ReportPaths) -> None:
    html, md = built.html.read_text(), built.markdown.read_text()
    body = html[html.index("<body>"):]
    assert body.index('id="headline"') < body.index("<figure") < body.index('id="changes-')
    assert md.index("## What the week earned") < md.index("![Throughput]") < md.index(
        "### Changes")
    lines = _job(built)["headline"]
    assert lines[0].startswith("Kept micro_batch 8 → 4: throughput +")
    assert "EUR" in lines[0] and "interval" in lines[0]
    rolled = [line for line in lines if line.startswith("Rolled back")]
    assert len(rolled) == 3
    assert any("non-finite loss" in line for line in rolled)
    assert any("by dave" in line for line in rolled)
    assert any(line.startswith("Incidents: 2 opened") for line in lines)
    assert re.search(r"Ran [\d.]+ GPU-hours \([\d.,]+ EUR at 3\.00 EUR per GPU-hour\)",
                     lines[-1])
    for line in lines:
        assert line in html and f"- {line}" in md


def test_only_panels_with_data_for_a_training_job(built: ReportPaths) -> None:
    keys = [p["key"] for p in _job(built)["panels"]]
    assert keys[0] == "throughput"
    assert "grad_norm" in keys
    assert not {"kv_bits", "cache_hit_rate"} & set(keys)  # serving panels
    assert "comm_share" not in keys  # one rank: no all-reduce was timed
    assert all(p["points"] > 0 for p in _job(built)["panels"])
    assert "no data in this range" not in built.html.read_text()


def test_intervals_stay_above_minus_100_percent(built: ReportPaths) -> None:
    job = _job(built)
    lows = [c["ci_low"] for c in job["changes"] if c["ci_low"] is not None]
    assert lows and all(low > -1 for low in lows)
    text = built.html.read_text().replace("so it never passes -100%", "")
    shown = re.findall(r"(-\d+(?:\.\d+)?)%", text)
    assert shown and all(float(v) > -100 for v in shown)


def test_no_jargon_and_money_carries_its_currency(built: ReportPaths) -> None:
    for text in (built.html.read_text(), built.markdown.read_text()):
        for word in JARGON:
            assert word not in text, word
        assert "payback" not in text.lower() or "pay for themselves in" in text
        assert re.search(r"pay for themselves in [\d.]+ (min|h|days|months)", text)
        assert "EUR per GPU-hour" in text


def test_throughput_by_config_names_each_config_and_stays_short(built: ReportPaths) -> None:
    job = _job(built)
    rows = job["by_config"]
    versions = [r["version"] for r in job["throughput_by_version"]]
    assert len(rows) < len(versions) / 3  # 25 versions, a handful of configs
    assert rows[0]["config"] == "starting config" and rows[0]["vs_start"] == 0
    labels = {r["config"] for r in rows}
    assert "micro_batch 8 → 4" in labels
    assert "micro_batch 8 → 4, prefetch 2 → 6" in labels
    assert sorted(v for r in rows for v in r["versions"]) == sorted(versions)
    assert sum(r["points"] for r in rows) == sum(
        r["points"] for r in job["throughput_by_version"])


def _serving_store(path: Path) -> tuple[int, int]:
    """A serving job (tokens/s, KV bits, a stray gradient norm) and an idle one (zeros)."""
    start = 1_800_000_000 * NS
    points = []
    for i in range(120):
        t = start + i * NS
        serve = {"service.name": "shop-serve", CONFIG_VERSION_ATTR: "1", "seedance.rank": "0"}
        points += [Point("seedance.serve.tokens_per_second", 400.0 + i % 7, t, serve),
                   Point("seedance.serve.kv_cache.bits", 4.0, t,
                         {**serve, "seedance.kv.part": "keys"}),
                   Point("seedance.train.grad.norm", 1.0, t, serve),
                   Point("seedance.serve.tokens_per_second", 0.0, t,
                         {"service.name": "idle-serve", CONFIG_VERSION_ATTR: "1"})]
    with TimeSeriesStore(path) as store:
        store.write(points)
        store.flush()
    return start - NS, start + 121 * NS


def test_a_serving_job_gets_serving_panels_and_an_idle_job_does_not_open_the_page(
        tmp_path: Path) -> None:
    since, until = _serving_store(tmp_path / "metrics.db")
    paths = build_report(store_path=tmp_path / "metrics.db",
                         state_db_url=sqlite_url(tmp_path / "state.db"), since_ns=since,
                         until_ns=until, out_dir=tmp_path / "out", price_per_gpu_hour=2.0)
    body = json.loads(paths.json.read_text())
    assert [j["job"] for j in body["jobs"]] == ["shop-serve", "idle-serve"]
    serve, idle = body["jobs"]
    assert serve["kind"] == "serve"
    assert [p["key"] for p in serve["panels"]] == ["throughput", "kv_bits"]  # no grad norm
    assert idle["panels"] == []
    html = paths.html.read_text()
    assert 'id="job-shop-serve"' in html and 'id="job-idle-serve"' not in html
    assert "Nothing measured, changed or found: idle-serve." in html
    assert "No change was tried on the job." in serve["headline"]
    assert "USD" in serve["headline"][-1]
