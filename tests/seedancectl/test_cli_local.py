"""The `seedancectl` commands that work on local data (Typer's CliRunner), against a real
TimeSeriesStore file filled with points, a real state database holding findings saved through
policies.FindingStore, and real files. A user mistake is one line and exit code 2, never a
traceback; `--help` of every command works."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import typer
from typer.testing import CliRunner, Result

from collectors._store import TimeSeriesStore
from policies import (
    ARTICLE_GAMMA,
    ARTICLE_SCALE_OUT_GRID,
    ARTICLE_UTILISATION_GRID,
    Evidence,
    Finding,
    FindingStore,
    Measurement,
    SuggestedChange,
    Threshold,
    roi_matrix,
    sqlite_url,
)
from seedancectl._config import load_config
from seedancectl._timeparse import parse_iso_week
from seedancectl.cli import app
from tests.dashboards.week_fixture import RecordedWeek, build_week

NS = 1_000_000_000
T0_NS = int(datetime(2026, 1, 5, tzinfo=UTC).timestamp()) * NS
STEP_NS = 10 * NS
N = 720
"""Two hours of loss points, one every 10 s, per job."""
LOSS = "seedance.train.loss"
GPU = "hw.gpu.utilization"
STEPS = "seedance.train.step"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / NS, tz=UTC).isoformat()


def invoke(*args: str, columns: int | None = None) -> Result:
    env = None if columns is None else {"COLUMNS": str(columns)}
    return CliRunner().invoke(app, list(args), env=env)


def ok(*args: str, columns: int | None = None) -> Result:
    result = invoke(*args, columns=columns)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result


def ok_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json").stdout)


def one_line_error(result: Result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(autouse=True)
def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No developer's seedance-data/ or SEEDANCE_* settings leak into a test."""
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("SEEDANCE_")]:
        monkeypatch.delenv(key)


# ---- a real store ---------------------------------------------------------------------------


Written = dict[tuple[str, tuple[tuple[str, str], ...]], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True, kw_only=True)
class Filled:
    path: Path
    series: Written
    """(name, sorted attributes) -> (times ns, values) as written."""

    def of(self, name: str, **attrs: str) -> tuple[np.ndarray, np.ndarray]:
        return self.series[(name, tuple(sorted(attrs.items())))]


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Filled:
    path = tmp_path_factory.mktemp("store") / "metrics.db"
    rng = np.random.default_rng(7)
    loss_t = T0_NS + STEP_NS * np.arange(N, dtype=np.int64)
    gpu_t = T0_NS + 60 * NS * np.arange(5, dtype=np.int64)
    now_ns = int(pd.Timestamp.now(tz=UTC).value)
    # minutes ago 5, 15, ..., 115: "the last hour" holds six of them, far from its boundary
    step_t = np.sort(now_ns - (np.arange(12, dtype=np.int64) * 600 + 300) * NS)
    series: Written = {
        (LOSS, (("service.name", "a"),)): (loss_t, 3.0 - 0.001 * np.arange(N)),
        (LOSS, (("service.name", "b"),)): (loss_t, rng.uniform(2.0, 4.0, N)),
        (GPU, (("gpu", "0"),)): (gpu_t, rng.uniform(0.0, 1.0, 5)),
        (GPU, (("gpu", "1"),)): (gpu_t, rng.uniform(0.0, 1.0, 5)),
        (STEPS, (("service.name", "a"),)): (step_t, np.arange(12, dtype=np.float64)),
    }
    with TimeSeriesStore(path, raw_retention_s=None, rollup_1m_retention_s=None,
                         rollup_1h_retention_s=None) as store:
        for (name, attrs), (times, values) in series.items():
            store.write_series(name, dict(attrs), times, values)
    return Filled(path=path, series=series)


def test_metrics_list_json_and_table(filled: Filled) -> None:
    listed = {r["name"]: r for r in ok_json("metrics", "list", "--store", str(filled.path))}
    assert sorted(listed) == sorted({name for name, _ in filled.series})
    for name, row in listed.items():
        written = [tv for (n, _), tv in filled.series.items() if n == name]
        assert row["series"] == len(written)
        assert row["points"] == sum(len(t) for t, _ in written)
        assert pd.Timestamp(row["first"]).value == min(int(t.min()) for t, _ in written)
        assert pd.Timestamp(row["last"]).value == max(int(t.max()) for t, _ in written)

    table = ok("metrics", "list", "--store", str(filled.path), columns=200).stdout
    for name, row in listed.items():
        assert name in table and str(row["points"]) in table
    assert datetime.fromtimestamp(T0_NS / NS, tz=UTC).strftime("%Y-%m-%d %H:%M:%S") in table
    narrow = ok("metrics", "list", "--store", str(filled.path), columns=60).stdout
    assert "…" not in narrow  # a narrow terminal folds a long name, never cuts it


def _query(filled: Filled, name: str, *args: str) -> list[dict[str, Any]]:
    body = ok_json("metrics", "query", name, "--store", str(filled.path), *args)
    assert body["name"] == name
    return body["points"]  # type: ignore[no-any-return]


def test_metrics_query_where_since_until_raw(filled: Filled) -> None:
    lo_ns, hi_ns = T0_NS + 600 * NS, T0_NS + 1200 * NS
    both = _query(filled, LOSS, "--since", iso(lo_ns), "--until", iso(hi_ns),
                  "--resolution", "raw")
    only_a = _query(filled, LOSS, "--since", iso(lo_ns), "--until", iso(hi_ns),
                    "--resolution", "raw", "--where", "service.name=a")
    times, values = filled.of(LOSS, **{"service.name": "a"})
    inside = (times >= lo_ns) & (times <= hi_ns)
    assert {p["service.name"] for p in only_a} == {"a"}
    assert [pd.Timestamp(p["time"]).value for p in only_a] == times[inside].tolist()
    assert np.allclose([p["value"] for p in only_a], values[inside])
    assert len(both) == 2 * int(inside.sum())
    assert {p["service.name"] for p in both} == {"a", "b"}
    one_line_error(invoke("metrics", "query", LOSS, "--store", str(filled.path),
                          "--where", "service.name=nobody"),
                   "unknown service.name 'nobody'", LOSS, "known: a, b")
    assert _query(filled, LOSS, "--since", iso(T0_NS - 600 * NS), "--until",
                  iso(T0_NS - NS), "--where", "service.name=a") == []  # known, quiet then


def test_metrics_query_one_minute_rollups(filled: Filled) -> None:
    lo_ns, hi_ns = T0_NS, T0_NS + 600 * NS - 1  # ten whole minutes
    rows = _query(filled, LOSS, "--since", iso(lo_ns), "--until", iso(hi_ns // NS * NS),
                  "--resolution", "1m", "--where", "service.name=b")
    times, values = filled.of(LOSS, **{"service.name": "b"})
    minute = (times - T0_NS) // (60 * NS)
    assert [pd.Timestamp(r["time"]).value for r in rows] == [T0_NS + m * 60 * NS
                                                              for m in range(10)]
    for m, row in enumerate(rows):
        expected = values[minute == m]
        assert row["count"] == len(expected) == 6
        assert row["value"] == pytest.approx(expected.mean())
        assert (row["min"], row["max"]) == pytest.approx((expected.min(), expected.max()))


def test_metrics_query_durations_are_relative_to_now(filled: Filled) -> None:
    times, _ = filled.of(STEPS, **{"service.name": "a"})
    last_hour = _query(filled, STEPS)  # the default --since is 1h
    assert len(last_hour) == 6
    assert [pd.Timestamp(p["time"]).value for p in last_hour] == times[-6:].tolist()
    assert len(_query(filled, STEPS, "--since", "2h")) == 12
    assert len(_query(filled, STEPS, "--since", "2h", "--until", "1h")) == 6


def test_metrics_query_table(filled: Filled) -> None:
    times, values = filled.of(LOSS, **{"service.name": "a"})
    table = ok("metrics", "query", LOSS, "--store", str(filled.path), "--since", iso(T0_NS),
               "--until", iso(int(times[-1])), "--where", "service.name=a", "--limit", "3",
               "--resolution", "raw").stdout
    assert f"{N} points" in table
    for value in values[-3:]:
        assert f"{value:.6g}" in table
    assert f"{values[-4]:.6g}" not in table
    assert "service.name=a" in table


def test_unknown_metric_names_the_near_matches(filled: Filled) -> None:
    one_line_error(invoke("metrics", "query", "seedance.train.los", "--store",
                          str(filled.path)),
                   "unknown metric 'seedance.train.los'", f"did you mean '{LOSS}'")
    one_line_error(invoke("metrics", "query", "zzz", "--store", str(filled.path), "--json"),
                   "unknown metric 'zzz'", GPU)
    result = ok("metrics", "query", LOSS, "--store", str(filled.path))  # known, not lately
    assert f"no points for {LOSS}" in result.stdout


@pytest.mark.parametrize(("args", "needles"), [
    (["--where", "service.name"], ["--where", "KEY=VALUE"]),
    (["--where", "=a"], ["--where"]),
    (["--where", "[bold]x"], ["[bold]x"]),  # user text is shown as typed, not as markup
    (["--since", "yesterday"], ["yesterday"]),
    (["--until", "tomorrow"], ["tomorrow"]),
    (["--since", "10 minutes"], ["10 minutes"]),
    (["--resolution", "5m"], ["--resolution", "5m"]),
])
def test_metrics_query_bad_input(filled: Filled, args: list[str], needles: list[str]) -> None:
    one_line_error(invoke("metrics", "query", LOSS, "--store", str(filled.path), *args),
                   *needles)


@pytest.mark.parametrize("command", [["metrics", "list"], ["metrics", "query", LOSS]])
def test_metrics_bad_store(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "missing.db"
    one_line_error(invoke(*command, "--store", str(missing)), str(missing), "no store")
    assert not missing.exists()
    one_line_error(invoke(*command), "seedance-data/metrics.db")  # the default, absent here
    folder = tmp_path / "data"
    folder.mkdir()
    one_line_error(invoke(*command, "--store", str(folder)), "a folder")
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    one_line_error(invoke(*command, "--store", str(text)), str(text))


# ---- config check ---------------------------------------------------------------------------


def test_config_check_prints_the_effective_settings(tmp_path: Path) -> None:
    path = tmp_path / "seedance.toml"
    path.write_text('[sidecar]\njob = "llm"\nlisten = "127.0.0.1:5000"\n'
                    'state_db = "sqlite:///state/s.db"\n'
                    '[sidecar.approval]\nmode = "auto"\n'
                    '[sidecar.approval.bounds.threads]\nlow = 1\nhigh = 4\n'
                    '[sidecar.jobs.llm]\ntune = true\n')
    out = ok("config", "check", str(path)).stdout
    head, _, body = out.partition("\n")
    assert head == f"ok {path}"
    printed = json.loads(body)
    assert printed == load_config(path, environ={}).model_dump(mode="json")
    assert (printed["job"], printed["listen"], printed["approval"]["mode"]) == (
        "llm", "127.0.0.1:5000", "auto")
    assert printed["jobs"]["llm"]["tune"] is True
    assert printed["nvml"] == "auto"  # a default the file does not set


@pytest.mark.parametrize(("text", "field"), [
    ('[sidecar]\nlisten = "nohost"', "listen"),
    ("[sidecar]\nprometheus_port = 70000", "prometheus_port"),
    ("[sidecar]\nunknown_knob = 1", "unknown_knob"),
    ('[sidecar.approval]\nmode = "sometimes"', "approval.mode"),
    ("[sidecar.approval.bounds.threads]\nlow = 4\nhigh = 1", "approval.bounds.threads"),
    ('[sidecar]\nwebhook_url = "ftp://x"', "webhook_url"),
])
def test_config_check_names_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    one_line_error(invoke("config", "check", str(path)), str(path), field)


def test_config_check_unreadable_files(tmp_path: Path) -> None:
    one_line_error(invoke("config", "check", str(tmp_path / "nope.toml")), "no such file")
    broken = tmp_path / "broken.toml"
    broken.write_text("[sidecar\n")
    one_line_error(invoke("config", "check", str(broken)), str(broken), "not valid TOML")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[sidecar]\n")
    one_line_error(invoke("config", "check", str(binary)), str(binary), "cannot read")
    one_line_error(invoke("config", "check", str(tmp_path)), str(tmp_path), "cannot read")


# ---- findings and explain -------------------------------------------------------------------


def _finding(id_: str, job: str, severity: Any, opened_ns: int,
             closed_ns: int | None = None) -> Finding:
    return Finding(
        id=id_, detector="bandwidth_saturation", job=job, severity=severity,
        resource={"gpu": "0"}, opened_at_ns=opened_ns, closed_at_ns=closed_ns,
        evidence=Evidence(
            summary=f"GPU 0 of job {job} moves 41.5 GB/s over PCIe",
            model="bandwidth saturation f = 1 - exp(-k x/B), k = 0.8",
            measurements=(Measurement(name="pcie_gbps", value=41.5, unit="GBy/s"),
                          Measurement(name="saturation", value=0.94)),
            thresholds=(Threshold(measurement="saturation", comparison=">", value=0.9),)),
        suggested_changes=(SuggestedChange(knob="prefetch", value=4,
                                           expected_effect="overlap copies with compute"),))


@dataclass(frozen=True, kw_only=True)
class StateDb:
    url: str
    path: Path
    findings: dict[str, Finding]


@pytest.fixture(scope="module")
def state_db(tmp_path_factory: pytest.TempPathFactory) -> StateDb:
    path = tmp_path_factory.mktemp("state") / "state.db"
    found = [_finding("f-a-closed", "a", "info", T0_NS - 3600 * NS, T0_NS),
             _finding("f-a-open", "a", "warning", T0_NS),
             _finding("f-b-open", "b", "critical", T0_NS + 60 * NS)]
    with FindingStore(sqlite_url(path)) as store:
        for finding in found:
            store.save(finding)
    return StateDb(url=sqlite_url(path), path=path, findings={f.id: f for f in found})


def _ids(*args: str) -> list[str]:
    return [f["id"] for f in ok_json("findings", *args)]


def test_findings_open_all_and_by_job(state_db: StateDb) -> None:
    db = ("--state-db", state_db.url)
    assert _ids(*db) == ["f-a-open", "f-b-open"]
    assert _ids(*db, "--job", "a") == ["f-a-open"]
    assert _ids(*db, "--all") == ["f-a-closed", "f-a-open", "f-b-open"]
    assert _ids(*db, "--all", "--job", "a") == ["f-a-closed", "f-a-open"]
    assert ok_json("findings", *db, "--all") == [f.to_dict() for f in
                                                state_db.findings.values()]

    table = ok("findings", *db).stdout
    assert "f-a-open" in table and "f-b-open" in table and "f-a-closed" not in table
    assert "critical" in table and "gpu=0" in table
    assert "f-a-closed" in ok("findings", *db, "--all").stdout
    for args in (["--job", "nobody"], ["--job", "nobody", "--all", "--json"]):
        one_line_error(invoke("findings", *db, *args), "unknown job 'nobody'", "known: a, b")
    one_line_error(invoke("findings", *db, "--job", "bb"), "did you mean 'b'")


def test_findings_state_db_from_the_config_file(state_db: StateDb, tmp_path: Path) -> None:
    config = tmp_path / "seedance.toml"
    config.write_text(f'[sidecar]\nstate_db = "{state_db.url}"\n')
    assert _ids("--config", str(config), "--all") == ["f-a-closed", "f-a-open", "f-b-open"]


@pytest.mark.parametrize("command", [["findings"], ["explain", "f-a-open"]])
def test_no_or_bad_state_db(tmp_path: Path, command: list[str]) -> None:
    one_line_error(invoke(*command), "seedance-data/state.db", "no state database")
    assert not (tmp_path / "seedance-data").exists()
    missing = tmp_path / "gone.db"
    one_line_error(invoke(*command, "--state-db", sqlite_url(missing)), str(missing))
    assert not missing.exists()
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    one_line_error(invoke(*command, "--state-db", sqlite_url(text)), "not a usable")
    one_line_error(invoke(*command, "--state-db", "garbage"), "garbage", "not a SQLAlchemy URL")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sidecar]\nstate_db = 3\n")
    one_line_error(invoke(*command, "--config", str(bad)), str(bad), "state_db")


def test_explain_prints_the_evidence_paragraph(state_db: StateDb) -> None:
    finding = state_db.findings["f-b-open"]
    text = ok("explain", "f-b-open", "--state-db", state_db.url).stdout.strip()
    assert text == finding.render()
    assert text.startswith("[critical] bandwidth_saturation on job b (gpu 0)")
    for words in ("41.5 GBy/s", "saturation = 0.94", "above the threshold 0.9",
                  "k = 0.8", "set prefetch = 4"):
        assert words in text
    assert ok_json("explain", "f-b-open", "--state-db", state_db.url) == finding.to_dict()


def test_explain_unknown_id(state_db: StateDb) -> None:
    one_line_error(invoke("explain", "f-nope", "--state-db", state_db.url), "'f-nope'",
                   "findings --all")


# ---- roi --------------------------------------------------------------------------------


def test_roi_json_equals_the_policy_matrix() -> None:
    args = {"util": "0.5,0.75", "scale": "1,1.5,2", "nodes": "16", "target": "0.85",
            "node-cost": "10000", "fix-cost": "50000", "horizon": "6", "gamma": "0.7"}
    flags = [x for k, v in args.items() for x in (f"--{k}", v)]
    printed = ok_json("roi", *flags)
    matrix = roi_matrix(utilisation_grid=(0.5, 0.75), scale_out_grid=(1.0, 1.5, 2.0),
                        n_nodes=16.0, target_utilisation=0.85, node_cost_per_month=10_000.0,
                        fix_cost=50_000.0, horizon_months=6.0, gamma=0.7)
    assert printed["utilisation"] == [0.5, 0.75]
    assert printed["scale_out"] == [1.0, 1.5, 2.0]
    assert np.allclose(printed["roi"], matrix.to_numpy())
    assert printed["png"] is None
    default = ok_json("roi")  # the seed's grids and gamma; 8 nodes, repaired to 90%
    assert np.allclose(default["utilisation"], ARTICLE_UTILISATION_GRID)
    assert np.allclose(default["scale_out"], ARTICLE_SCALE_OUT_GRID)
    assert np.allclose(default["roi"], roi_matrix(
        n_nodes=8.0, target_utilisation=0.9, node_cost_per_month=20_000.0, fix_cost=100_000.0,
        horizon_months=12.0, gamma=ARTICLE_GAMMA).to_numpy())


def test_roi_table_and_png(tmp_path: Path) -> None:
    png = tmp_path / "roi.png"
    out = ok("roi", "--util", "0.4,0.9", "--scale", "1,2", "--png", str(png)).stdout
    matrix = roi_matrix(utilisation_grid=(0.4, 0.9), scale_out_grid=(1.0, 2.0), n_nodes=8.0,
                        target_utilisation=0.9, node_cost_per_month=20_000.0,
                        fix_cost=100_000.0, horizon_months=12.0)
    for value in matrix.to_numpy().ravel():
        assert f"{value:+.0%}" in out
    assert "40%" in out and "2.00x" in out and f"heatmap: {png}" in out
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 300 and height > 200
    again = tmp_path / "again.png"
    assert ok_json("roi", "--png", str(again))["png"] == str(again)
    assert again.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(("args", "needles"), [
    (["--util", "abc"], ["--util", "abc"]),
    (["--util", ","], ["--util", "at least one"]),
    (["--util", "1.5"], ["utilisation"]),
    (["--util", "0"], ["utilisation"]),
    (["--scale", "0.5"], ["scale_out"]),
    (["--gamma", "-1"], ["gamma"]),
    (["--horizon", "0"], ["horizon"]),
])
def test_roi_bad_input(args: list[str], needles: list[str]) -> None:
    one_line_error(invoke("roi", *args), *needles)


def test_roi_png_where_it_cannot_go(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "roi.png"
    one_line_error(invoke("roi", "--png", str(target)), str(tmp_path / "missing"))
    assert not target.parent.exists()
    one_line_error(invoke("roi", "--png", str(tmp_path)), "a folder")


# ---- dashboards grafana -----------------------------------------------------------------


def test_dashboards_grafana_writes_the_files(tmp_path: Path) -> None:
    out = tmp_path / "grafana"
    listed = [Path(p) for p in ok_json("dashboards", "grafana", "--out", str(out),
                                       "--prometheus-url", "http://127.0.0.1:9999")]
    assert listed and all(p.is_file() and p.is_relative_to(out.resolve()) for p in listed)
    boards = [p for p in listed if p.suffix == ".json"]
    assert boards and all(json.loads(p.read_text())["panels"] for p in boards)
    datasource = out / "provisioning" / "datasources" / "seedance.yaml"
    assert datasource in listed and "http://127.0.0.1:9999" in datasource.read_text()
    printed = ok("dashboards", "grafana", "--out", str(out)).stdout.split()
    assert sorted(printed) == sorted(str(p) for p in listed)


def test_dashboards_grafana_out_is_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "grafana"
    afile.write_text("")
    one_line_error(invoke("dashboards", "grafana", "--out", str(afile)), "not a folder")
    one_line_error(invoke("dashboards", "grafana", "--out", str(afile / "sub")), "cannot write")


# ---- report -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def week(tmp_path_factory: pytest.TempPathFactory) -> RecordedWeek:
    return build_week(tmp_path_factory.mktemp("week"))


def test_report_of_a_recorded_week(week: RecordedWeek, tmp_path: Path) -> None:
    out = tmp_path / "report"
    printed = ok_json("report", "--week", week.week, "--store", str(week.store_path),
                      "--state-db", week.state_url, "--out", str(out),
                      "--price-per-gpu-hour", "3")
    html, md, body = (Path(printed[k]) for k in ("html", "markdown", "json"))
    assert (html.parent, md.parent, body.parent) == (out, out, out)
    assert "<html" in html.read_text().lower() and md.read_text().strip()
    report = json.loads(body.read_text())
    assert (report["since_ns"], report["until_ns"]) == parse_iso_week(week.week)
    assert report["price_per_gpu_hour"] == 3.0
    assert [j["job"] for j in report["jobs"]] == [week.job]
    assert printed["plots"] and all(Path(p).read_bytes().startswith(PNG_MAGIC)
                                    for p in printed["plots"])


@pytest.mark.parametrize(("args", "needles"), [
    (["--week", "2026-47"], ["2026-47", "ISO week"]),
    (["--week", "2026-W54"], ["2026-W54"]),
    (["--week", "2026-W47", "--since", "7d"], ["either --week"]),
    ([], ["either --week"]),
    (["--week", "2026-W47", "--until", "1d"], ["--until"]),
    (["--since", "last week"], ["last week"]),
    (["--since", "7d", "--until", "someday"], ["someday"]),
])
def test_report_bad_range(tmp_path: Path, args: list[str], needles: list[str]) -> None:
    one_line_error(invoke("report", "--out", str(tmp_path / "r"), *args), *needles)
    assert not (tmp_path / "r").exists()


def test_report_bad_paths(week: RecordedWeek, tmp_path: Path) -> None:
    base = ["report", "--week", week.week, "--state-db", week.state_url]
    afile = tmp_path / "afile"
    afile.write_text("")
    one_line_error(invoke(*base, "--store", str(week.store_path), "--out", str(afile)),
                   "not a folder")
    one_line_error(invoke(*base, "--store", str(week.store_path), "--out",
                          str(afile / "sub")), "cannot create")
    one_line_error(invoke(*base, "--store", str(tmp_path / "none.db"), "--out",
                          str(tmp_path / "r")), "no store")
    alone = tmp_path / "alone" / "metrics.db"  # no state.db next to it, none in the config
    one_line_error(invoke("report", "--week", week.week, "--store", str(alone), "--prometheus",
                          "http://127.0.0.1:9", "--out", str(tmp_path / "r")),
                   "no state database", str(alone.parent / "state.db"))


def test_report_reads_the_state_db_next_to_its_store(week: RecordedWeek,
                                                     tmp_path: Path) -> None:
    assert week.state_url == f"sqlite:///{week.store_path.parent / 'state.db'}"
    printed = ok_json("report", "--week", week.week, "--store", str(week.store_path),
                      "--out", str(tmp_path / "r"))
    report = json.loads(Path(printed["json"]).read_text())
    assert [j["job"] for j in report["jobs"]] == [week.job]


# ---- demo and sidecar: bad input only (neither starts anything) ---------------------------


@pytest.mark.parametrize("minutes", ["0", "1000", "-1"])
def test_demo_minutes_out_of_range(tmp_path: Path, minutes: str) -> None:
    out = tmp_path / "demo"
    one_line_error(invoke("demo", "--minutes", minutes, "--out", str(out)), "--minutes")
    assert not out.exists()


def _sidecar_refused(tmp_path: Path, *args: str) -> str:
    """The command returns (a started server would block) and wrote no file into its data
    folder (the store's, which the state database shares)."""
    store = tmp_path / "data" / "metrics.db"
    line = one_line_error(invoke("sidecar", "--store", str(store), *args))
    assert not store.parent.exists() or not any(store.parent.iterdir())
    assert "listening" not in line
    return line


def test_sidecar_bad_input(tmp_path: Path) -> None:
    assert "listen" in _sidecar_refused(tmp_path, "--listen", "bad")
    assert "listen" in _sidecar_refused(tmp_path, "--listen", "127.0.0.1:99999")
    line = _sidecar_refused(tmp_path, "--listen", "127.0.0.1:1", "--nvml",
                            "replay:nonexistent")
    assert "nonexistent" in line and "h100_gpu_burn" in line
    assert "nvml" in _sidecar_refused(tmp_path, "--nvml", "sometimes")
    assert "state_db" in _sidecar_refused(tmp_path, "--state-db", "nonsense")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sidecar]\npolicy_interval_s = -1\n")
    line = _sidecar_refused(tmp_path, "--config", str(bad))
    assert str(bad) in line and "policy_interval_s" in line
    assert "no such file" in _sidecar_refused(tmp_path, "--config", str(tmp_path / "no.toml"))


# ---- --help of everything ---------------------------------------------------------------


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command and group under ``group`` (typer's own click: duck-typed)."""
    for name, command in group.commands.items():
        yield (*path, name), command
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


COMMANDS = list(_commands(typer.main.get_group(app)))


def test_every_command_is_listed() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"metrics list", "metrics query", "config check", "findings", "explain", "roi",
            "dashboards grafana", "report", "demo", "sidecar"} <= names


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help(path: tuple[str, ...], command: Any) -> None:
    result = ok(*path, "--help", columns=200)
    assert "Usage:" in result.stdout
    for param in command.params:
        if param.param_type_name == "option":
            assert max(param.opts, key=len) in result.stdout, (param.opts, result.stdout)
        if getattr(param, "help", None):  # its own words, not just its name
            assert param.help.split(".")[0][:40] in result.stdout, (param.help, result.stdout)
    if hasattr(command, "commands"):
        for sub in command.commands:
            assert sub in result.stdout
