"""The on-call page in a real browser against a real sidecar and a stand-in job.

The sidecar runs in this process under uvicorn on a free loopback port (so the test can read
its parts), the page is driven by Chromium through Playwright, and the job is a stand-in that
holds its lease over HTTP exactly as tuner.job does and exports its throughput over OTLP with
the stock OpenTelemetry SDK. Its throughput numbers are SIMULATED (a function of micro_batch)
and the finding on it is planted; nothing here measures a model. Screenshots go to test-artifacts/web/.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from collectors._points import CONFIG_VERSION_ATTR
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._state_db import sqlite_url
from seedancectl._config import SidecarConfig
from seedancectl._sidecar import Sidecar
from tests.servers import free_port
from tuner._measure import TOKENS_PER_SECOND

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"
JOB = "web-demo"
TOKEN = "s3cret-test-token"
WAIT_S = 30.0
DRAWN_PATH = re.compile(r"^M[\d.]+,[\d.]+(L[\d.]+,[\d.]+){2,}$")
"""An SVG path through at least three points."""
PLANTED = Finding(
    id="f-planted", detector="input_bound", job=JOB, severity="warning",
    opened_at_ns=time.time_ns(),
    evidence=Evidence(
        summary="SIMULATED for this test: the data loader holds back 31% of each step",
        model="input wait share w = t_wait / t_step",
        measurements=(Measurement(name="wait_share", value=0.31),
                      Measurement(name="step_time", value=0.42, unit="s")),
        thresholds=(Threshold(measurement="wait_share", comparison=">", value=0.2),)),
    suggested_changes=(SuggestedChange(knob="micro_batch", value=4,
                                       expected_effect="fewer loader waits"),))
"""A detector's verdict planted in the engine's finding store (no detector ran on the job)."""
KNOBS = [{"name": "micro_batch", "default": 2, "choices": [1, 2, 4], "scope": "live",
          "risk": "low"}]


@pytest.fixture
def chromium_binary() -> str:
    reason = ""
    if not os.access(CHROMIUM, os.X_OK):
        reason = (f"no Chromium at {CHROMIUM}; install it with scripts/install-test-deps.sh "
                  "(Debian package 'chromium')")
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "the Python package 'playwright' is not installed"
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return CHROMIUM


def until(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll ``check`` until it returns something truthy (bounded; the box is shared)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.2)


class StandInJob:
    """Holds the lease like tuner.job (attach, long-poll, ack at a 'step boundary') and
    exports a SIMULATED tokens/s gauge tagged with the config version in force."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=10,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        body = self.http.post(f"/v1/jobs/{JOB}/attach", json={
            "knobs": KNOBS, "baseline": {"micro_batch": 2}, "lease_ttl_s": 30}).json()
        self.session = body["session"]
        self.version = body["config"]["version"]
        self.values = dict(body["config"]["values"])
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="stand-in-job", daemon=True)
        self._thread.start()
        self.provider = MeterProvider(
            metric_readers=[PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=f"{url}/v1/metrics"),
                export_interval_millis=200)],
            resource=Resource.create({"service.name": JOB, "seedance.rank": 0,
                                      "seedance.simulated": "true"}))
        self.provider.get_meter("stand-in").create_observable_gauge(
            TOKENS_PER_SECOND, callbacks=[self._observe], unit="{token}/s")

    def _observe(self, _: CallbackOptions) -> list[Observation]:
        self.step += 1
        tokens_per_s = 800.0 + 100.0 * self.values["micro_batch"] + 20.0 * (self.step % 5)
        return [Observation(tokens_per_s, {CONFIG_VERSION_ATTR: str(self.version)})]

    def _hold(self) -> None:
        while not self._stop.is_set():
            try:
                lease = self.http.get(f"/v1/jobs/{JOB}/lease", params={
                    "session": self.session, "version": self.version, "wait_s": 1}).json()
                config = lease["config"]
                if config["version"] != self.version:
                    self.values, self.version = dict(config["values"]), config["version"]
                    self.http.post(f"/v1/jobs/{JOB}/ack", json={
                        "session": self.session, "version": self.version, "step": self.step,
                        "status": "applied"})
            except httpx.HTTPError:
                time.sleep(0.2)  # the sidecar is going away at the end of the test

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.provider.shutdown()
        self.http.close()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[Sidecar, str]]:
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = SidecarConfig(job="web-test", listen=f"127.0.0.1:{port}",
                           store=tmp_path / "metrics.db", state_db=sqlite_url(tmp_path / "s.db"),
                           nvml="off", token_file=token_file, tuning_interval_s=0.2)
    side = Sidecar(config, environ={})
    app = side.app()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="sidecar", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    until("the sidecar to be ready", ready)
    yield side, url
    server.should_exit = True
    thread.join(15)


def change_state(url: str, change_id: str) -> dict[str, Any]:
    reply = httpx.get(f"{url}/v1/changes/{change_id}", timeout=5)
    reply.raise_for_status()
    return reply.json()  # type: ignore[no-any-return]


def test_on_call_approves_a_pending_change_from_the_page(
        sidecar: tuple[Sidecar, str], chromium_binary: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    side, url = sidecar
    job = StandInJob(url)
    try:
        until("the job's throughput in the store", lambda: (
            side.store is not None and len(side.store.query(TOKENS_PER_SECOND)) >= 8))
        assert side.engine is not None
        side.engine.findings.save(PLANTED)
        proposed = httpx.post(f"{url}/v1/jobs/{JOB}/changes", timeout=5,
                              headers={"Authorization": f"Bearer {TOKEN}"},
                              json={"by": "test", "reason": "input-bound: try a larger batch",
                                    "values": {"micro_batch": 4}})
        assert proposed.status_code == 201, proposed.text
        change = proposed.json()
        assert change["state"] == "proposed"  # approval mode "suggest": waits for a person
        card_sel = f'article[data-change-id="{change["id"]}"]'
        ARTIFACTS.mkdir(parents=True, exist_ok=True)

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_binary, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1100, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}/")
            assert page.url.endswith("/ui/")

            # The pending change with its evidence: the knob, before and after, the reason,
            # and the plot of the job's throughput drawn as an SVG path.
            card = page.locator(card_sel)
            expect(card).to_be_visible(timeout=WAIT_S * 1000)
            expect(card.locator("table.values")).to_contain_text("micro_batch")
            expect(card.locator("table.values tbody td").nth(0)).to_have_text("2")
            expect(card.locator("table.values tbody td").nth(1)).to_have_text("4")
            expect(card).to_contain_text("input-bound: try a larger batch")
            # The finding open on the job, with its numbers and the bound they crossed.
            measured = card.locator("table.measurements tbody tr", has_text="wait_share")
            expect(measured).to_contain_text("0.31")
            expect(measured).to_contain_text("> 0.2")
            expect(page.locator("#findings")).to_contain_text("input_bound")
            path = card.locator("svg.plot path.line").first
            expect(path).to_have_attribute("d", DRAWN_PATH, timeout=WAIT_S * 1000)
            expect(card.locator("svg.plot")).to_have_attribute(
                "aria-label", re.compile(re.escape(TOKENS_PER_SECOND)))

            # No token: refused in words, nothing changes.
            page.get_by_label("Your name").fill("alice")
            approve = page.get_by_role("button", name=f"Approve change {change['id']}")
            approve.focus()
            page.keyboard.press("Enter")
            expect(card.locator(".card-status")).to_contain_text("Token missing")
            # A wrong token: refused in words, nothing changes.
            page.get_by_label("API token").fill("not-the-token")
            approve.click()
            expect(card.locator(".card-status")).to_contain_text("Token wrong")
            expect(page.locator("#status")).to_contain_text("Token wrong")
            page.screenshot(path=str(ARTIFACTS / "wrong-token.png"), full_page=True)
            after = change_state(url, change["id"])
            assert after["state"] == "proposed" and after["approved_by"] is None
            assert [e["kind"] for e in after["events"]] == ["proposed"]

            # The right token: approved, then applied to the job and observed.
            page.get_by_label("API token").fill(TOKEN)
            assert "s3cret" not in page.url
            approve.click()
            expect(page.locator("#status")).to_contain_text(
                f"Change {change['id']} approved by alice", timeout=WAIT_S * 1000)
            # The stand-in sends no step times, so no window completes: it stays observing.
            moved = until("the change to be applied and acked", lambda: (
                lambda c: c if c["state"] == "observing" else None)(
                change_state(url, change["id"])))
            kinds = [e["kind"] for e in moved["events"]]
            assert kinds[:3] == ["proposed", "approved", "applying"], kinds
            approved = next(e for e in moved["events"] if e["kind"] == "approved")
            assert approved["actor"] == "alice"
            assert moved["approved_by"] == "alice"
            assert job.values["micro_batch"] == 4 and job.version >= moved["plan"]["version"]
            # The page moves it out of the approval queue into the work in progress.
            expect(page.locator(card_sel)).to_have_count(0, timeout=WAIT_S * 1000)
            page.get_by_role("button", name="Refresh now").click()
            row = page.locator("#inflight tr", has_text="micro_batch: 2 → 4")
            expect(row).to_contain_text("observing")
            expect(row).to_contain_text("alice")
            expect(page.locator("#pending")).to_contain_text("Nothing waits for approval")
            page.screenshot(path=str(ARTIFACTS / "approved.png"), full_page=True)

            # Reject: a reason is required, then the change is rejected and in the history.
            second = httpx.post(f"{url}/v1/jobs/{JOB}/changes", timeout=5,
                                headers={"Authorization": f"Bearer {TOKEN}"},
                                json={"by": "test", "reason": "smaller batch",
                                      "values": {"micro_batch": 1}}).json()
            page.get_by_role("button", name="Refresh now").click()
            card = page.locator(f'article[data-change-id="{second["id"]}"]')
            reject = card.get_by_role("button", name=f"Reject change {second['id']}")
            reject.click()
            expect(card.locator(".card-status")).to_contain_text("Give a reason")
            assert change_state(url, second["id"])["state"] == "proposed"
            card.get_by_label("Comment (required to reject)").fill("not during the launch")
            reject.click()
            expect(page.locator("#status")).to_contain_text(
                f"Change {second['id']} rejected by alice")
            rejected = change_state(url, second["id"])
            assert rejected["state"] == "rejected"
            assert rejected["events"][-1]["actor"] == "alice"
            assert rejected["events"][-1]["reason"] == "not during the launch"
            history = page.locator("#history tr", has_text="micro_batch: 2 → 1")
            expect(history).to_contain_text("rejected")
            history.get_by_role("button", name=f"Show events of change {second['id']}").click()
            expect(page.locator(f"#events-{second['id']}")).to_contain_text(
                "by alice: not during the launch")
            page.screenshot(path=str(ARTIFACTS / "history.png"), full_page=True)
            assert session_token(page) == TOKEN
            assert errors == []
            browser.close()
    finally:
        job.close()


def session_token(page: Any) -> str:
    return str(page.evaluate("() => sessionStorage.getItem('seedance.token')"))

