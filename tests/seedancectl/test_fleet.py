"""A fleet: THREE real sidecar processes on one shared state database (a SQLite file, then a
real PostgreSQL with a real Prometheus that scrapes the three and that they read their series
from), and three jobs, each holding its lease through the real in-job lease client
(``tuner.job``'s, torch-free) and acking every config it is sent. The real CLI (``seedancectl
fleet status``, a subprocess) lists the jobs with their owners; an approval made on sidecar A's
fleet page (Chromium) for a job held by B lands on B, with the operator in B's audit trail; a
second sidecar claiming a live job is refused with a 409 naming the owner; once B is killed, A
says so instead of approving, and B's job is claimed by C after B's heartbeat goes stale.

Each sidecar has its own API token: the operator holds B's, and A passes it through untouched.
The jobs' throughput is never measured here (no metrics are sent): changes wait in
``observing``, which is as far as this test needs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dashboards.test_web import CHROMIUM_ARGS, chromium_binary  # noqa: F401 (fixture)
from tests.faults._sidecar import ROOT, SidecarProcess
from tests.servers import PROMETHEUS, free_port, start_prometheus, wait_for
from tuner import Knob
from tuner.job._lease_client import LeaseClient

pytestmark = pytest.mark.integration

HEARTBEAT_S = 1.0
"""The fleet's heartbeat: a sidecar silent for 3 s counts as down."""
LEASE_TTL_S = 6.0
"""A refused attach is tried again after half of it."""
KNOBS = [Knob(name="threads", default=2, low=1, high=8, integer=True)]
WAIT_S = 45.0


def until(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll ``check`` until it returns something truthy (bounded; the box is shared)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.1)


class Job:
    """A job holding its lease with the real lease client; it applies and acks every config."""

    def __init__(self, sidecar: SidecarProcess, name: str, token: str, kind: str) -> None:
        self.name, self.values, self.step = name, {"threads": 2}, 0
        self.client = LeaseClient(sidecar.url, job=name, kind=kind, world_size=1,
                                  lease_ttl_s=LEASE_TTL_S, applied_version=lambda: 0,
                                  token=token)
        self.client.start(KNOBS, self.values)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"job-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = 0
        while not self._stop.wait(0.05):
            self.step += 1
            update = self.client.poll()
            if update is None or update.seq == seen:
                continue
            seen, self.values = update.seq, dict(update.config.values)
            self.client.ack(update, {"version": update.config.version, "step": self.step,
                                     "status": "applied", "actions": [
                                         {**a, "status": "done"} for a in update.actions]})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.shutdown(5)


class Fleet:
    def __init__(self, root: Path, state_db: str, *, prometheus: bool = False) -> None:
        """With ``prometheus``: a real Prometheus scrapes the three sidecars' ``/metrics``, and
        each reads its series back from it (``metrics_source``)."""
        self.state_db = state_db
        self.tokens = {name: f"token-of-{name}" for name in "abc"}
        dirs = {name: root / name for name in "abc"}
        ports = {name: free_port() for name in "abc"}
        self.prometheus: tuple[subprocess.Popen[bytes], str] | None = None
        extra: dict[str, Any] = {}
        if prometheus:
            (root / "prometheus").mkdir()
            self.prometheus_log = root / "prometheus" / "prometheus.log"
            self.prometheus = start_prometheus(PROMETHEUS, root / "prometheus", *(
                f"127.0.0.1:{port}" for port in ports.values()))
            api = self.prometheus[1]
            until("Prometheus to list its targets", lambda: _targets(api) == 3)
            # windows longer than two 1 s scrape intervals, as the sidecar demands
            extra = {"metrics_source": f"prometheus:{api}", "rollout": {"min_window_s": 3.0}}

        def start(name: str) -> SidecarProcess:
            dirs[name].mkdir()
            token = dirs[name] / "sidecar-token"
            token.write_text(self.tokens[name] + "\n")
            return SidecarProcess(dirs[name], port=ports[name], job=f"sidecar-{name}",
                                  state_db=state_db, token_file=token,
                                  fleet_heartbeat_s=HEARTBEAT_S, policy_interval_s=60,
                                  tuning_interval_s=0.2, **extra)

        # A first: it creates the tables (two first starts at once race on CREATE TABLE)
        self.sidecars = {"a": start("a")}
        with ThreadPoolExecutor(2) as pool:
            self.sidecars.update(zip("bc", pool.map(start, "bc"), strict=True))
        self.jobs: list[Job] = []

    def attach(self, sidecar: str, job: str, kind: str = "train") -> Job:
        found = Job(self.sidecars[sidecar], job, self.tokens[sidecar], kind)
        self.jobs.append(found)
        until(f"{job} to attach to sidecar {sidecar}", lambda: any(
            j["job"] == job and j["state"] == "attached"
            for j in self.sidecars[sidecar].http.get("/v1/jobs").json()))
        return found

    def post(self, sidecar: str, path: str, body: dict[str, Any], *,
             token: str) -> httpx.Response:
        return self.sidecars[sidecar].http.post(
            path, json=body, headers={"Authorization": f"Bearer {token}"})

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The real CLI, as an operator runs it."""
        return subprocess.run(
            [sys.executable, "-m", "seedancectl.cli", "fleet", "status", *args],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250"})

    def status(self) -> dict[str, Any]:
        done = self.cli("--config", str(self.sidecars["a"].config), "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def close(self) -> None:
        for job in self.jobs:
            job.close()
        for sidecar in self.sidecars.values():
            sidecar.stop()
        if self.prometheus is not None:
            self.prometheus[0].terminate()
            self.prometheus[0].wait(30)


def _targets(api: str) -> int:
    """How many active targets Prometheus lists (0 until it serves and has read its config)."""
    try:
        return len(httpx.get(f"{api}/api/v1/targets", timeout=2).json()["data"]["activeTargets"])
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


@pytest.fixture(params=["sqlite", "postgresql+prometheus"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    """Three sidecars on one state database: a SQLite file; or a real PostgreSQL's, with a real
    Prometheus that scrapes the three and that they read their series from."""
    fleetwide = request.param == "postgresql+prometheus"
    state_db = (str(request.getfixturevalue("postgres_url")) if fleetwide
                else f"sqlite:///{tmp_path / 'shared-state.db'}")
    made = Fleet(tmp_path, state_db, prometheus=fleetwide)
    try:
        yield made
    finally:
        made.close()


def test_three_sidecars_one_state_db_one_view_approvals_routed_to_the_owner(
        fleet: Fleet, chromium_binary: str) -> None:  # noqa: F811 (the fixture)
    from playwright.sync_api import expect, sync_playwright

    fleet.attach("a", "job-a")
    fleet.attach("b", "job-b")
    fleet.attach("c", "job-c", kind="serve")
    a, b, c = (fleet.sidecars[n] for n in "abc")

    # One view of the shared state DB, by the real CLI: every job with its owner, alive.
    status = fleet.status()
    owners = {s["sidecar_id"]: s["url"] for s in status["sidecars"]}
    assert sorted(owners.values()) == sorted(s.url for s in (a, b, c))
    jobs = {j["job"]: j for j in status["jobs"]}
    assert {j: owners[v["owner"]["sidecar_id"]] for j, v in jobs.items()} == {
        "job-a": a.url, "job-b": b.url, "job-c": c.url}
    assert all(j["owner"]["alive"] for j in jobs.values())
    assert jobs["job-c"]["kind"] == "serve"
    assert jobs["job-b"]["kept_config"]["values"] == {"threads": 2}
    table = fleet.cli("--config", str(a.config))
    assert table.returncode == 0, table.stderr
    for job, url in (("job-a", a.url), ("job-b", b.url), ("job-c", c.url)):
        assert job in table.stdout and url in table.stdout, table.stdout
    assert "3 jobs on 3 sidecars (3 alive" in table.stdout
    if fleet.prometheus is not None:  # one Prometheus scrapes the three, which read it back
        proc, api = fleet.prometheus
        up = wait_for(api, 'up{job="seedance-sidecar"} == 1', proc,
                      time.monotonic() + WAIT_S, fleet.prometheus_log)
        assert sorted(str(r["metric"]["instance"]) for r in up) == sorted(  # type: ignore[index]
            s.url.removeprefix("http://") for s in (a, b, c))
        for sidecar in (a, b, c):
            assert sidecar.http.get("/readyz").status_code == 200, sidecar.log()

    # A second sidecar claiming a live job is refused, in one line naming the owner.
    refused = fleet.post("c", "/v1/jobs/job-a/attach", {"knobs": [k.to_json() for k in KNOBS],
                                                        "baseline": {"threads": 2}},
                         token=fleet.tokens["c"])
    assert refused.status_code == 409, refused.text
    detail = refused.json()["detail"]
    assert jobs["job-a"]["owner"]["sidecar_id"] in detail and a.url in detail, detail
    assert [j["job"] for j in c.http.get("/v1/jobs").json()] == ["job-c"]

    # A change of job-b (held by B) waits for a person; the operator approves it on A's page.
    proposed = fleet.post("b", "/v1/jobs/job-b/changes", {
        "by": "oncall-bot", "reason": "try more threads", "values": {"threads": 4}},
        token=fleet.tokens["b"])
    assert proposed.status_code == 201, proposed.text
    change = proposed.json()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_binary, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{a.url}/ui/fleet.html")
        for job, sidecar in (("job-a", a), ("job-b", b), ("job-c", c)):
            row = page.locator(f'#jobs tr[data-job="{job}"]')
            expect(row).to_contain_text(sidecar.url, timeout=WAIT_S * 1000)
            expect(row).to_contain_text("alive")
        expect(page.locator('#jobs tr[data-job="job-b"]')).to_contain_text("threads=2")
        card = page.locator(f'article[data-change-id="{change["id"]}"]')
        expect(card).to_contain_text(b.url)
        page.get_by_label("API token").fill(fleet.tokens["b"])  # B's token, not A's
        page.get_by_label("Your name").fill("alice")
        card.get_by_role("button", name=f"Approve change {change['id']}").click()
        expect(page.locator("#status")).to_contain_text(
            f"Change {change['id']} approved by alice on sidecar "
            f"{jobs['job-b']['owner']['sidecar_id']}", timeout=WAIT_S * 1000)
        assert errors == []
        browser.close()
    job_b = next(j for j in fleet.jobs if j.name == "job-b")
    until("job-b to run the approved config", lambda: job_b.values == {"threads": 4})
    moved = until("B to apply and observe the change", lambda: (
        lambda ch: ch if ch["state"] == "observing" else None)(
        b.http.get(f"/v1/changes/{change['id']}").json()))
    approved = next(e for e in moved["events"] if e["kind"] == "approved")
    assert approved["actor"] == "alice" and moved["approved_by"] == "alice"
    assert [j.values for j in fleet.jobs if j.name != "job-b"] == [{"threads": 2}] * 2

    # B dies: an approval routed to it says so and decides nothing.
    second = fleet.post("b", "/v1/jobs/job-b/changes", {
        "by": "oncall-bot", "reason": "fewer threads", "values": {"threads": 1}},
        token=fleet.tokens["b"]).json()
    b.proc.kill()
    b.proc.wait(10)
    down = fleet.post("a", f"/v1/fleet/changes/{second['id']}/approve", {"by": "alice"},
                      token=fleet.tokens["b"])
    assert down.status_code == 502, down.text
    assert "does not answer" in down.json()["detail"] and b.url in down.json()["detail"]
    assert a.http.get(f"/v1/changes/{second['id']}").json()["state"] == "proposed"

    # Its job is claimed by C once B's heartbeat is stale (the job client retries the attach).
    fleet.attach("c", "job-b")
    final = fleet.status()
    after = {j["job"]: j for j in final["jobs"]}
    assert after["job-b"]["owner"]["url"] == c.url and after["job-b"]["owner"]["alive"]
    assert not next(s for s in final["sidecars"] if s["url"] == b.url)["alive"]
