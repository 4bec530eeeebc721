"""The fleet view on a real state database (a SQLite file, and a real PostgreSQL): two members
of the fleet hold a job each, one has left; the change journal holds kept, rolled-back and
proposed changes, the finding store an open and a closed finding. ``fleet_view`` gathers it,
and ``seedancectl fleet status`` (Typer's CliRunner) shows it as a table and as JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dashboards import fleet_view
from policies import Evidence, Finding, FindingStore, sqlite_url
from seedancectl.cli import app
from tuner import Change, ChangeJournal, FleetMember, JobRegistry, Knob

KNOBS = [Knob(name="threads", default=2, low=1, high=8, integer=True)]


@dataclass
class Planted:
    url: str
    live: FleetMember
    gone: FleetMember
    kept: tuple[str, str]
    waiting: str


def change(job: str, state: str, values: dict[str, int], gain: float | None) -> Change:
    now = time.time()
    return Change(id=f"{job}-{state}-{values['threads']}", job=job, state=state,  # type: ignore[arg-type]
                  source="operator", reason="test", risk="low", scope="live", values=values,
                  baseline={"threads": 2}, created_at_s=now, expires_at_s=now + 3600,
                  comparison=None if gain is None else {"gain": gain})


def finding(job: str, detector: str, *, closed: bool) -> Finding:
    now = time.time_ns()
    return Finding(detector=detector, job=job, severity="warning",
                   evidence=Evidence(summary="planted by the test", model="none"),
                   id=f"{detector}-{job}", opened_at_ns=now, closed_at_ns=now if closed else None)


@pytest.fixture(params=["sqlite", "postgresql"])
def planted(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Planted]:
    url = (str(request.getfixturevalue("postgres_url")) if request.param == "postgresql"
           else sqlite_url(tmp_path / "state.db"))
    live = FleetMember(url, JobRegistry(), url="http://live.test:4318")
    gone = FleetMember(url, JobRegistry(), url="http://gone.test:4318")
    for member, job in ((live, "gpt"), (gone, "chat")):
        member.start()
        member._registry.attach(job, knobs=KNOBS, baseline={"threads": 2},
                                kind="serve" if job == "chat" else "train")
    live._registry.set_baseline("gpt", {"threads": 6})
    live.beat()
    gone.shutdown()  # left the fleet: its heartbeat reads as long stale
    journal = ChangeJournal(url)
    for planted_change in (change("gpt", "kept", {"threads": 4}, 0.10),
                           change("gpt", "rolled_back", {"threads": 8}, -0.20),
                           change("gpt", "kept", {"threads": 6}, 0.05),
                           change("gpt", "proposed", {"threads": 3}, None),
                           change("chat", "rejected", {"threads": 1}, None)):
        journal.add(planted_change, actor="test", reason="planted", version_before=None,
                    detail={})
    journal.close()
    with FindingStore(url) as findings:
        findings.save(finding("gpt", "input_bound", closed=False))
        findings.save(finding("gpt", "gradient_collapse", closed=True))
    try:
        yield Planted(url=url, live=live, gone=gone, kept=("gpt-kept-4", "gpt-kept-6"),
                      waiting="gpt-proposed-3")
    finally:
        live.shutdown()


def test_the_view_gathers_owner_kept_config_gain_findings_and_waiting(planted: Planted) -> None:
    view = fleet_view(planted.url, heartbeat_s=2.0)
    jobs = {j.fleet.job: j for j in view.jobs}
    assert sorted(jobs) == ["chat", "gpt"]
    gpt, chat = jobs["gpt"], jobs["chat"]
    assert gpt.fleet.owner_id == planted.live.sidecar_id and gpt.owner_alive
    assert chat.fleet.owner_id == planted.gone.sidecar_id and not chat.owner_alive
    assert gpt.fleet.baseline is not None and gpt.fleet.baseline.values == {"threads": 6}
    assert [c.id for c in gpt.kept] == list(planted.kept)
    assert gpt.kept_gain == pytest.approx(1.10 * 1.05 - 1)  # the rolled-back one not counted
    assert [f.detector for f in gpt.findings] == ["input_bound"]  # the closed one is not open
    assert [c.id for c in gpt.waiting] == [planted.waiting]
    assert chat.kept_gain is None and chat.waiting == () and chat.fleet.kind == "serve"
    assert {s.sidecar_id: s.alive for s in view.sidecars} == {
        planted.live.sidecar_id: True, planted.gone.sidecar_id: False}


def test_fleet_status_prints_the_view_as_a_table_and_as_json(planted: Planted) -> None:
    table = CliRunner().invoke(app, ["fleet", "status", "--state-db", planted.url],
                               env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    lines = {line.split("│")[1].strip(): line for line in table.stdout.splitlines()
             if line.count("│") > 2 and line.split("│")[1].strip() in ("gpt", "chat")}
    assert planted.live.sidecar_id in lines["gpt"] and "yes" in lines["gpt"]
    assert "threads=6" in lines["gpt"] and "+15.5% (2 kept)" in lines["gpt"]
    assert "input_bound (warning)" in lines["gpt"] and planted.waiting in lines["gpt"]
    assert planted.gone.sidecar_id in lines["chat"] and "down" in lines["chat"]
    assert "2 jobs on 2 sidecars (1 alive" in table.stdout

    as_json = CliRunner().invoke(app, ["fleet", "status", "--state-db", planted.url, "--json"])
    assert as_json.exit_code == 0, as_json.output
    body = json.loads(as_json.stdout)
    gpt = next(j for j in body["jobs"] if j["job"] == "gpt")
    assert gpt["owner"]["sidecar_id"] == planted.live.sidecar_id and gpt["owner"]["alive"]
    assert gpt["owner"]["url"] == "http://live.test:4318"
    assert gpt["kept_config"]["values"] == {"threads": 6}
    assert gpt["kept_changes"] == list(planted.kept)
    assert [w["id"] for w in gpt["waiting"]] == [planted.waiting]
    assert [f["detector"] for f in gpt["findings"]] == ["input_bound"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--state-db", "sqlite:////nonexistent/state.db"], "no state database here"),
    (["--state-db", "postgresql+psycopg://nobody@127.0.0.1:1/none"], "not a usable state"),
    (["--state-db", "not a url"], "is not a SQLAlchemy URL"),
    (["--config", "/nonexistent/sidecar.toml"], "no such file"),
])
def test_fleet_status_says_in_one_line_what_is_wrong(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["fleet", "status", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Traceback" not in result.output
