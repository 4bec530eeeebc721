"""Generated Grafana dashboards: schema checks, and every expression against a real Prometheus
scraping a real sidecar (replayed NVML trace) fed by a stand-in job over OTLP."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from collectors import CATALOGUE, prom_metric
from dashboards.grafana import dashboard_json, write_grafana
from tests.servers import free_port, query, start_prometheus, wait_for

BOARDS = dashboard_json()
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))|\[\[(\w+)\]\]")
LABEL_VALUES = re.compile(r"^label_values\((.+), (\w+)\)$")
WAIT_S = 60.0


def _targets(board: dict) -> Iterator[tuple[dict, dict]]:
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def _used_variables(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in VARIABLE.finditer(text)} - {""}


def test_five_dashboards_with_distinct_uids_and_titles() -> None:
    assert len(BOARDS) == 5
    titles = [board["title"] for board in BOARDS.values()]
    assert len(set(titles)) == 5 and all(titles)
    assert all(uid == board["uid"] and 0 < len(uid) <= 40 for uid, board in BOARDS.items())


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_panels_have_unique_ids_and_do_not_overlap(uid: str) -> None:
    panels = BOARDS[uid]["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], int] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and 0 <= pos["x"] and pos["x"] + pos["w"] <= 24
        for cell in itertools.product(range(pos["x"], pos["x"] + pos["w"]),
                                      range(pos["y"], pos["y"] + pos["h"])):
            assert cell not in taken, f"panel {panel['id']} overlaps panel {taken[cell]}"
            taken[cell] = panel["id"]


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_every_target_has_an_expression_and_the_datasource_variable(uid: str) -> None:
    board = BOARDS[uid]
    for panel in board["panels"]:
        if panel["type"] == "row":
            assert "targets" not in panel or not panel["targets"]
            continue
        assert panel["title"] and panel["datasource"] == DATASOURCE
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
    for _, target in _targets(board):
        assert target["expr"].strip() and target["datasource"] == DATASOURCE


@pytest.mark.parametrize("uid", sorted(BOARDS))
def test_variables_used_are_defined_and_defined_ones_are_used(uid: str) -> None:
    board = BOARDS[uid]
    variables = board["templating"]["list"]
    defined = [var["name"] for var in variables]
    assert len(defined) == len(set(defined))
    used: set[str] = set()
    for panel, target in _targets(board):
        used |= _used_variables(json.dumps([target, panel["datasource"], panel.get("title")]))
    for var in variables:
        used |= _used_variables(json.dumps(var.get("query", "")))
        used |= _used_variables(json.dumps(var.get("datasource", "")))
    builtins = {name for name in used if name.startswith("__")}
    assert used - builtins <= set(defined), f"undefined: {used - builtins - set(defined)}"
    assert set(defined) <= used, f"unused: {set(defined) - used}"
    for var in variables:
        if var["type"] == "query":
            assert LABEL_VALUES.match(var["query"]), var["query"]


def test_write_grafana_writes_dashboards_and_provisioning_that_point_at_them(
        tmp_path: Path) -> None:
    written = write_grafana(tmp_path / "out", prometheus_url="http://127.0.0.1:9999")
    assert all(path.is_file() for path in written)
    boards = {json.loads(p.read_text())["uid"]: p for p in written if p.suffix == ".json"}
    assert set(boards) == set(BOARDS)
    provider = yaml.safe_load((tmp_path / "out/provisioning/dashboards/seedance.yaml")
                              .read_text())
    (entry,) = provider["providers"]
    assert entry["type"] == "file"
    assert {p.parent for p in boards.values()} == {Path(entry["options"]["path"])}
    sources = yaml.safe_load((tmp_path / "out/provisioning/datasources/seedance.yaml")
                             .read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9999"
    assert source["uid"] and source["isDefault"] is True
    # Written twice, the same bytes: the output is deterministic.
    again = write_grafana(tmp_path / "again")
    assert [p.read_bytes() for p in again if p.suffix == ".json"] == \
        [p.read_bytes() for p in written if p.suffix == ".json"]


def test_tokens_loss_and_norms_carry_units() -> None:
    units = {(uid, p["title"]): p["fieldConfig"]["defaults"].get("unit")
             for uid, board in BOARDS.items() for p in board["panels"] if "fieldConfig" in p}
    assert units[("seedance-training", "Tokens per second")] == "suffix: tokens/s"
    assert units[("seedance-serving", "Output tokens per second")] == "suffix: tokens/s"
    assert units[("seedance-training", "Loss")] == "suffix: nats"
    assert units[("seedance-training", "Gradient norm")] == "suffix: L2"
    assert units[("seedance-training", "Gradient norm per module group")] == "suffix: L2"


def test_every_series_an_expression_names_is_one_the_sidecar_exposes() -> None:
    exposed = {sample for spec in CATALOGUE for sample in prom_metric(spec.name).samples}
    named = set()
    for board in BOARDS.values():
        for _, target in _targets(board):
            named |= set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", target["expr"]))
    assert named and named <= exposed, named - exposed


# ---- a real Prometheus scraping a real sidecar ------------------------------------------------

SIDECAR_JOB = "dash"
SIDECAR_SERVICE = f"{SIDECAR_JOB}-sidecar"  # the sidecar's own resource service.name
GRAFANA_BUILTINS = {"__rate_interval": "10s", "__range": "1m"}


@pytest.fixture
def sidecar_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "sidecar.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "seedancectl.sidecar", "--job", SIDECAR_JOB,
         "--listen", f"127.0.0.1:{port}", "--store", str(tmp_path / "metrics.db"),
         "--nvml", "replay:h100_gpu_burn"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + WAIT_S
    try:
        while True:
            assert proc.poll() is None, (tmp_path / "sidecar.log").read_text()
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "sidecar never became ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def _substitute(text: str, values: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        assert name in values, f"no value for ${name} in {text}"
        return values[name]
    return VARIABLE.sub(one, text)


def _resolve(board: dict, api: str, proc: subprocess.Popen[bytes], deadline: float,
             log: Path) -> dict[str, str]:
    """A real value for every variable, found by running its own query against Prometheus."""
    values = dict(GRAFANA_BUILTINS)
    for var in board["templating"]["list"]:
        if var["type"] == "datasource":
            values[var["name"]] = "unused"
            continue
        series, label = LABEL_VALUES.match(var["query"]).groups()  # type: ignore[union-attr]
        found = wait_for(api, f"group by ({label}) ({_substitute(series, values)})", proc,
                         deadline, log)
        values[var["name"]] = sorted(r["metric"][label] for r in found)[0]  # type: ignore[index]
    return values


@pytest.mark.integration
def test_every_expression_returns_data_from_a_real_prometheus_scraping_the_sidecar(
        sidecar_url: str, prometheus_binary: str, prometheus_dir: Path) -> None:
    sender = subprocess.Popen(
        [sys.executable, "-m", "tests.dashboards.otel_sender", f"{sidecar_url}/v1/metrics",
         SIDECAR_SERVICE, "0", str(WAIT_S + 30)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc, api = start_prometheus(prometheus_binary, prometheus_dir,
                                 sidecar_url.removeprefix("http://"))
    log = prometheus_dir / "prometheus.log"
    deadline = time.monotonic() + WAIT_S
    checked = 0
    try:
        for uid, board in sorted(BOARDS.items()):
            values = _resolve(board, api, proc, deadline, log)
            for panel, target in _targets(board):
                expr = _substitute(target["expr"], values)
                assert sender.poll() is None, sender.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
                result = wait_for(api, expr, proc, deadline, log)
                assert result, f"{uid} / {panel['title']}: {expr}"
                checked += 1
        hit_rate = next(t["expr"] for p, t in _targets(BOARDS["seedance-serving"])
                        if p["title"] == "Prefix-cache hit rate")
        values = _resolve(BOARDS["seedance-serving"], api, proc, deadline, log)
        for row in query(api, _substitute(hit_rate, values)):
            assert 0.0 < float(row["value"][1]) <= 1.0  # type: ignore[index]
    finally:
        sender.terminate()
        sender.wait(15)
        proc.terminate()
        proc.wait(15)
    assert checked == sum(1 for board in BOARDS.values() for _ in _targets(board))
