"""The weekly report over a recorded week (a real demo run replayed, times shifted; see
week_fixture): every section present, numbers recomputed from the store and the journal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from collectors import LatestValueCollector, MetricInfo, Point, PrometheusSource, Temporality
from collectors._otlp_decode import DecodedMetrics
from collectors._points import CONFIG_VERSION_ATTR, MetricKind
from collectors._prometheus import serve_metrics
from collectors._store import TimeSeriesStore
from dashboards.report import ReportPaths, build_report
from policies import FindingStore
from tests.dashboards.week_fixture import RecordedWeek, build_week
from tests.servers import free_port, start_prometheus, wait_for
from tuner import Change, ChangeJournal

NS = 1_000_000_000
PRICE = 3.0
SECTIONS = ("summary", "findings", "changes", "rollbacks", "decisions", "throughput", "savings",
            "plots")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="session")
def week(tmp_path_factory: pytest.TempPathFactory) -> RecordedWeek:
    return build_week(tmp_path_factory.mktemp("week"))


@pytest.fixture(scope="session")
def built(week: RecordedWeek, tmp_path_factory: pytest.TempPathFactory) -> ReportPaths:
    return build_report(store_path=week.store_path, state_db_url=week.state_url,
                        since_ns=week.since_ns, until_ns=week.until_ns,
                        out_dir=tmp_path_factory.mktemp("report"), price_per_gpu_hour=PRICE)


@pytest.fixture(scope="session")
def report(built: ReportPaths) -> dict[str, Any]:
    body = json.loads(built.json.read_text())
    assert [j["job"] for j in body["jobs"]] == ["demo-train"]
    return body["jobs"][0]


def _journal(week: RecordedWeek) -> tuple[list[Change], list[dict[str, Any]]]:
    journal = ChangeJournal(week.state_url, create=False)
    try:
        return journal.changes(), journal.events()
    finally:
        journal.close()


def test_every_section_in_html_and_markdown(built: ReportPaths, week: RecordedWeek) -> None:
    html, md = built.html.read_text(), built.markdown.read_text()
    for section in SECTIONS:
        assert f'id="{section}-{week.job}"' in html, section
    for heading in ("### Changes by state", "### Findings", "### Changes", "### Rollbacks",
                    "### Time to a human decision", "### Throughput by config",
                    "### GPU-hours and money saved", "### Time series"):
        assert heading in md, heading
    assert all(p.stat().st_size > 1000 for p in built.plots)
    for plot in built.plots:
        assert f"]({plot.relative_to(built.markdown.parent).as_posix()})" in md
    assert html.count('src="data:image/png;base64,') == len(built.plots)
    assert "times shifted" in html and "times shifted" in md  # the fixture is replayed
    assert "H x (1 + g)" in html and "scaling efficiency 0.78" in md  # formulas explained


def test_state_counts_match_the_journal(report: dict[str, Any], week: RecordedWeek,
                                        built: ReportPaths) -> None:
    _, events = _journal(week)
    for state, shown in report["state_counts"].items():
        entered = {e["change_id"] for e in events if e["to_state"] == state
                   and week.since_ns <= e["at_ns"] <= week.until_ns}
        assert shown == len(entered), state
        assert f'data-state="{state}">{shown}<' in built.html.read_text()
    # the fixture exercises every state the report names
    for state in ("proposed", "approved", "rejected", "kept", "rolled_back"):
        assert report["state_counts"][state] >= 1, state


def test_changes_carry_the_controllers_effect_and_rollback_causes(
        report: dict[str, Any], week: RecordedWeek) -> None:
    changes, events = _journal(week)
    by_id = {c.id: c for c in changes}
    assert {c["id"] for c in report["changes"]} == set(by_id)
    for row in report["changes"]:
        change = by_id[row["id"]]
        assert row["state"] == change.state
        if change.comparison and np.isfinite(change.comparison["gain"]):
            for key in ("gain", "ci_low", "ci_high", "confidence"):
                assert row[key] == pytest.approx(change.comparison[key])
        rolled = [e for e in events if e["change_id"] == row["id"]
                  and e["to_state"] == "rolled_back"]
        assert row["rollback_cause"] == (rolled[0]["reason"] if rolled else None)
    causes = " ".join(c["rollback_cause"] or "" for c in report["changes"])
    assert "measured regression" in causes and "non-finite loss" in causes


def test_time_to_human_decision_is_from_the_journal(report: dict[str, Any],
                                                   week: RecordedWeek) -> None:
    changes, events = _journal(week)
    for row in report["changes"]:
        decisions = [e for e in events if e["change_id"] == row["id"]
                     and e["to_state"] in ("approved", "rejected")]
        person = decisions and decisions[0]["actor"] not in ("auto", "mode:off")
        if not person:
            assert row["decision_s"] is None
            continue
        created = next(c.created_at_s for c in changes if c.id == row["id"])
        assert row["decision_s"] == pytest.approx((decisions[0]["at_ns"] - created * NS) / NS,
                                                  abs=1e-3)
    assert any(r["decision_s"] is None and r["decided_by"] == "auto" for r in report["changes"])


def test_findings_durations(report: dict[str, Any], week: RecordedWeek) -> None:
    with FindingStore(week.state_url) as store:
        stored = {f.id: f for f in store.history(job=week.job)}
    assert {f["id"] for f in report["findings"]} == set(stored)
    for row in report["findings"]:
        f = stored[row["id"]]
        end = f.closed_at_ns if f.closed_at_ns is not None else week.until_ns
        assert row["open_s"] == pytest.approx((end - f.opened_at_ns) / NS)
    assert sum(f["closed_in_range"] for f in report["findings"]) == sum(
        f.closed_at_ns is not None and week.since_ns <= f.closed_at_ns <= week.until_ns
        for f in stored.values())


def _raw_throughput(week: RecordedWeek) -> pd.DataFrame:
    with TimeSeriesStore(week.store_path, readonly=True) as store:
        return store.query("seedance.train.tokens_per_second",
                           where={"service.name": week.job}, since_ns=week.since_ns,
                           until_ns=week.until_ns, resolution="raw")


def test_mean_throughput_per_config_version_from_raw_points(report: dict[str, Any],
                                                            week: RecordedWeek) -> None:
    raw = _raw_throughput(week)
    expected = raw.groupby(raw[CONFIG_VERSION_ATTR].astype(int))["value"].agg(["mean", "size"])
    shown = {r["version"]: r for r in report["throughput_by_version"]}
    assert set(shown) == set(expected.index)
    for version, row in expected.iterrows():
        assert shown[version]["points"] == row["size"]
        assert shown[version]["mean"] == pytest.approx(row["mean"], rel=1e-9)


def test_gpu_hours_saved_formula_from_raw_points(report: dict[str, Any],
                                                 week: RecordedWeek) -> None:
    raw = _raw_throughput(week)
    minutes = pd.DatetimeIndex(raw["time"]).asi8 // (60 * NS)
    gpus = raw["seedance.rank"].nunique()
    assert report["savings"], "the fixture keeps changes"
    by_id = {c["id"]: c for c in report["changes"]}
    for saving in report["savings"]:
        change = by_id[saving["change_id"]]
        end = min(week.until_ns, change["rolled_back_at_ns"] or week.until_ns)
        kept_minute = change["kept_at_ns"] // (60 * NS)
        active = np.unique(minutes[(minutes >= kept_minute) & (minutes < end / (60 * NS))])
        hours = active.size / 60 * gpus
        assert saving["gpu_hours_after"] == pytest.approx(hours)
        for suffix, key in (("", "gain"), ("_low", "ci_low"), ("_high", "ci_high")):
            assert saving[f"gpu_hours_saved{suffix}"] == pytest.approx(hours * change[key])
            assert saving[f"cost_saved{suffix}"] == pytest.approx(hours * change[key] * PRICE)
        assert saving["gpu_hours_saved_low"] > 0  # kept: the interval excludes zero
    assert report["payback"] is not None and report["payback"]["months"] > 0


def test_markers_at_apply_keep_and_rollback_times(report: dict[str, Any]) -> None:
    kinds = {(m["kind"], m["change_id"]) for m in report["markers"]}
    for c in report["changes"]:
        for kind, key in (("apply", "applied_at_ns"), ("kept", "kept_at_ns"),
                          ("rolled_back", "rolled_back_at_ns")):
            assert ((kind, c["id"]) in kinds) == (c[key] is not None)


def test_html_renders_in_headless_chromium_with_every_image(built: ReportPaths) -> None:
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        if os.environ.get("CI"):
            pytest.fail("no /usr/bin/chromium")
        pytest.skip("no /usr/bin/chromium")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium), args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            page.goto(built.html.as_uri())
            widths = page.eval_on_selector_all("img", "els => els.map(e => e.naturalWidth)")
            heading = page.inner_text("h1")
            box = page.locator("#headline").bounding_box()
            kept = page.locator("#headline li", has_text="Kept").first.bounding_box()
            first_plot = page.locator("figure").first.get_attribute("id")
            page.screenshot(path=str(ARTIFACTS / "report-first-screen.png"))
            page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        finally:
            browser.close()
    assert len(widths) == len(built.plots) and all(w > 0 for w in widths), widths
    assert heading == "Weekly tuning report"
    # the first screen (1366x900) says what the week earned: the headline and its kept line
    assert box is not None and kept is not None
    assert box["y"] < 200 and kept["y"] + kept["height"] <= 900, (box, kept)
    assert first_plot == "plot-demo-train-throughput"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "seedancectl.cli", "report", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_the_report_and_bad_weeks_are_one_line(week: RecordedWeek,
                                                          tmp_path: Path) -> None:
    common = ["--store", str(week.store_path), "--state-db", week.state_url,
              "--out", str(tmp_path / "out")]
    done = _cli("--week", week.week, "--price-per-gpu-hour", "2", "--json", *common)
    assert done.returncode == 0, done.stderr
    paths = json.loads(done.stdout)
    body = json.loads(Path(paths["json"]).read_text())
    assert body["since_ns"] == week.since_ns and body["until_ns"] == week.until_ns
    assert body["price_per_gpu_hour"] == 2.0
    config = tmp_path / "sidecar.toml"
    config.write_text('[sidecar]\nprice_per_gpu_hour = 4.0\ncurrency = "EUR"\n')
    done = _cli("--week", week.week, "--config", str(config), "--json", *common)
    assert done.returncode == 0, done.stderr
    body = json.loads(Path(json.loads(done.stdout)["json"]).read_text())
    assert (body["price_per_gpu_hour"], body["currency"]) == (4.0, "EUR")
    assert "4.00 EUR per GPU-hour" in Path(json.loads(done.stdout)["html"]).read_text()
    for bad in (["--week", "2026-W60"], ["--week", "last week"],
                ["--week", week.week, "--since", "1d"], []):
        done = _cli(*bad, *common)
        assert done.returncode == 2, (bad, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.integration
def test_prometheus_source_reads_what_a_real_prometheus_scraped(
        prometheus_binary: str, prometheus_dir: Path) -> None:
    collector = LatestValueCollector()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(collector)
    info = MetricInfo(name="seedance.train.tokens_per_second", kind=MetricKind.GAUGE,
                      otlp_type="gauge", unit="{token}/s", description="", monotonic=False,
                      temporality=Temporality.UNSPECIFIED)
    attrs = {"service.name": "job-a", CONFIG_VERSION_ATTR: "7", "seedance.rank": "0"}
    collector.update(DecodedMetrics(points=[Point(info.name, 1234.5, time.time_ns(), attrs)],
                                    metrics={info.name: info}))
    port = free_port()
    server = serve_metrics(registry, port)
    proc, api = start_prometheus(prometheus_binary, prometheus_dir, f"127.0.0.1:{port}")
    try:
        since_ns = time.time_ns()
        wait_for(api, 'seedance_train_tokens_per_second{service_name="job-a"}', proc,
                 time.monotonic() + 30, prometheus_dir / "prometheus.log")
        time.sleep(2.5)
        with PrometheusSource(api, timeout_s=10) as source:
            until_ns = time.time_ns()
            raw = source.query(info.name, where={"service.name": "job-a"},
                               since_ns=since_ns - NS, until_ns=until_ns, resolution="raw")
            assert len(raw) >= 2 and (raw["value"] == 1234.5).all()
            assert set(raw["service.name"]) == {"job-a"}
            assert set(raw[CONFIG_VERSION_ATTR]) == {"7"}
            assert "instance" not in raw.columns and "job" not in raw.columns
            other = source.query(info.name, where={"service.name": "job-b"}, since_ns=since_ns,
                                 until_ns=until_ns, resolution="raw")
            assert other.empty
            rolled = source.query(info.name, where={"service.name": "job-a"},
                                  since_ns=since_ns - NS, until_ns=until_ns, resolution="1m")
            assert {"min", "max", "count", "last"} <= set(rolled.columns)
            assert (rolled["value"] == 1234.5).all()
    finally:
        proc.terminate()
        proc.wait(10)
        server.stop()
