"""Generated Grafana dashboards: schema checks, and every expression and annotation against a
real Prometheus scraping a real sidecar (replayed NVML trace) that tunes a real torch job, with a
stand-in sender for the job-side series one CPU process cannot make."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from collectors import CATALOGUE, prom_metric
from dashboards.grafana import dashboard_json, write_grafana
from tests.seedancectl._live import TOKEN, Live, live_sidecar
from tests.servers import query, start_prometheus, wait_for

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

TUNED = "tuned"
"""The REAL torch job the sidecar tunes: its tuning, findings and GPU series are the real ones."""
JOB_SCRIPT = Path(__file__).parents[1] / "seedancectl" / "prom_fleet_job.py"
GRAFANA_BUILTINS = {"__rate_interval": "10s", "__range": "5m", "__interval": "5m"}
RUN_S = 180.0
SIDECAR_MADE = ("seedance-gpus", "seedance-tuning", "seedance-findings")
"""Dashboards of series the sidecar emits about a job: ``$job`` must select the tuned job's."""


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    """A real sidecar that tunes TUNED (auto mode, one pair per trial), replaying an NVML trace."""
    with live_sidecar(
            tmp_path, job="dash", nvml="replay:h100_gpu_burn", export_interval_s=0.5,
            policy_interval_s=1, policy_window_s=20, tuning_interval_s=0.5,
            jobs={TUNED: {"mode": "auto", "tune": True}},
            rollout={"warmup_steps": 2, "min_window_s": 2.0, "max_window_s": 6.0,
                     "min_pairs": 1, "max_pairs": 1}) as sidecar:
        yield sidecar


def _substitute(text: str, values: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        assert name in values, f"no value for ${name} in {text}"
        return values[name]
    return VARIABLE.sub(one, text)


def _values(label: str, result: list[dict[str, object]]) -> list[str]:
    """The values of ``label`` in a query's result, as Grafana's ``label_values`` lists them
    (series without the label list nothing)."""
    return sorted({str(r["metric"][label]) for r in result  # type: ignore[index]
                   if label in r["metric"]})  # type: ignore[operator]


def _resolve(board: dict, api: str, proc: subprocess.Popen[bytes], deadline: float,
             log: Path) -> dict[str, str]:
    """A real value for every variable, found by running its own query against Prometheus:
    ``$job`` is TUNED on the dashboards of the sidecar's own series (which must list it), and
    every job listed elsewhere (Grafana's "All"); another variable, its first value."""
    values = dict(GRAFANA_BUILTINS)
    for var in board["templating"]["list"]:
        if var["type"] == "datasource":
            values[var["name"]] = "unused"
            continue
        series, label = LABEL_VALUES.match(var["query"]).groups()  # type: ignore[union-attr]
        found = _values(label, wait_for(api, f"group by ({label}) ({_substitute(series, values)})",
                                        proc, deadline, log))
        if var["name"] != "job":
            values[var["name"]] = found[0]
        elif board["uid"] in SIDECAR_MADE:
            while TUNED not in found and time.monotonic() < deadline:
                time.sleep(0.5)
                found = _values(label, query(api, f"group by ({label}) ({series})"))
            assert TUNED in found, f"{board['uid']}: $job lists {found}"
            values["job"] = TUNED
        else:
            values["job"] = "|".join(found)
    return values


def _judged(live: Live, deadline: float, log: Path) -> set[str]:
    """Wait for the search's first judged trial, then make sure one change was rolled back
    (the operator undoes a kept one), so every tuning series has a real count; the states
    the job's changes were judged into (whose annotations must show)."""
    controller = live.sidecar.controller
    assert controller is not None
    while not (judged := [c for c in controller.changes(job=TUNED)
                          if c.state in ("kept", "rolled_back")]):
        assert time.monotonic() < deadline, f"no judged change: {log.read_text()[-2000:]}"
        time.sleep(0.5)
    if all(c.state == "kept" for c in judged):
        reply = live.post(f"/v1/jobs/{TUNED}/rollback", {"by": "test", "reason": "annotation"})
        assert reply.status_code == 200, reply.text
    return {"kept" if c.state == "kept" else "rolled_back" for c in judged} | {"rolled_back"}


@pytest.mark.integration
def test_every_expression_returns_data_from_a_real_prometheus_scraping_the_sidecar(
        live: Live, tmp_path: Path, prometheus_binary: str, prometheus_dir: Path) -> None:
    """Job-side series a one-process CPU job cannot make (DDP, serving, NVLink) come from the
    SIMULATED sender; the sidecar's own (tuning, findings, GPUs) are real and name TUNED."""
    gpu = "0"
    sender = subprocess.Popen(
        [sys.executable, "-m", "tests.dashboards.otel_sender", f"{live.url}/v1/metrics",
         gpu, TUNED, str(RUN_S)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    job_log = tmp_path / "job.log"
    with job_log.open("wb") as out:
        job = subprocess.Popen([sys.executable, str(JOB_SCRIPT), live.url, TUNED],
                               stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "SEEDANCE_TOKEN": TOKEN})
    proc, api = start_prometheus(prometheus_binary, prometheus_dir,
                                 live.url.removeprefix("http://"))
    log = prometheus_dir / "prometheus.log"
    deadline = time.monotonic() + RUN_S
    checked = 0
    try:
        judged = _judged(live, deadline, job_log)
        notes = {"kept": "Changes kept", "rolled_back": "Rollbacks"}
        for uid, board in sorted(BOARDS.items()):
            values = _resolve(board, api, proc, deadline, log)
            for panel, target in _targets(board):
                expr = _substitute(target["expr"], values)
                assert sender.poll() is None, sender.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
                result = wait_for(api, expr, proc, deadline, log)
                assert result, f"{uid} / {panel['title']}: {expr}"
                checked += 1
            marks = {n["name"]: n["expr"] for n in board["annotations"]["list"]}
            assert set(marks) == set(notes.values()), uid
            for state in judged:
                expr = _substitute(marks[notes[state]], {**values, "job": TUNED})
                assert wait_for(api, expr, proc, deadline, log), f"{uid} / {notes[state]}"
        hit_rate = next(t["expr"] for p, t in _targets(BOARDS["seedance-serving"])
                        if p["title"] == "Prefix-cache hit rate")
        values = _resolve(BOARDS["seedance-serving"], api, proc, deadline, log)
        for row in query(api, _substitute(hit_rate, values)):
            assert 0.0 < float(row["value"][1]) <= 1.0  # type: ignore[index]
    finally:
        for child in (sender, job, proc):
            child.terminate()
            child.wait(15)
    assert checked == sum(1 for board in BOARDS.values() for _ in _targets(board))
