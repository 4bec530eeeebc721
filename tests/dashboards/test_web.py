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
from dataclasses import dataclass
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
          "risk": "low"},
         {"name": "offload", "default": False, "choices": [False, True], "scope": "restart",
          "risk": "high"}]
VIEWPORT = {"width": 1366, "height": 900}
"""A laptop screen: what an on-call engineer sees without scrolling."""
ZONE = "America/New_York"
"""The browser's zone, so the test can tell that times carry theirs (EST or EDT)."""


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
            "knobs": KNOBS, "baseline": {"micro_batch": 2, "offload": False},
            "lease_ttl_s": 30}).json()
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


@dataclass
class Running:
    """The sidecar under test, its URL, and a way to take it away mid-test."""

    side: Sidecar
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Running]:
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
    running = Running(side, url, server, thread)
    yield running
    running.stop()


def change_state(url: str, change_id: str) -> dict[str, Any]:
    reply = httpx.get(f"{url}/v1/changes/{change_id}", timeout=5)
    reply.raise_for_status()
    return reply.json()  # type: ignore[no-any-return]


def propose(url: str, values: dict[str, Any], reason: str) -> dict[str, Any]:
    """An operator's change through the API; approval mode "suggest" makes it wait."""
    reply = httpx.post(f"{url}/v1/jobs/{JOB}/changes", timeout=5,
                       headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"by": "test", "reason": reason, "values": values})
    assert reply.status_code == 201, reply.text
    body: dict[str, Any] = reply.json()
    assert body["state"] == "proposed"
    return body


def open_page(pw: Any, chromium_binary: str, url: str) -> tuple[Any, Any, list[str]]:
    """Chromium at 1366x900 in New York time on the page; page errors are collected."""
    browser = pw.chromium.launch(executable_path=chromium_binary, args=CHROMIUM_ARGS)
    page = browser.new_context(viewport=VIEWPORT, locale="en-US",
                               timezone_id=ZONE).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/")
    assert page.url.endswith("/ui/")
    return browser, page, errors


def refreshed_on_its_own(page: Any) -> None:
    """Wait for the page's own 5 s refresh (not the button) to run once more."""
    before = page.locator("#refreshed").inner_text()
    until("an automatic refresh", lambda: page.locator("#refreshed").inner_text() != before,
          timeout_s=15)


def test_on_call_approves_a_pending_change_from_the_page(
        sidecar: Running, chromium_binary: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    side, url = sidecar.side, sidecar.url
    job = StandInJob(url)
    try:
        until("the job's throughput in the store", lambda: (
            side.store is not None and len(side.store.query(TOKENS_PER_SECOND)) >= 8))
        assert side.engine is not None
        side.engine.findings.save(PLANTED)
        change = propose(url, {"micro_batch": 4}, "input-bound: try a larger batch")
        card_sel = f'article[data-change-id="{change["id"]}"]'
        ARTIFACTS.mkdir(parents=True, exist_ok=True)

        with sync_playwright() as pw:
            browser, page, errors = open_page(pw, chromium_binary, url)
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))

            # The pending change with its evidence: the knob, before and after, the reason,
            # and the plot of the job's throughput drawn as an SVG path.
            card = page.locator(card_sel)
            expect(card).to_be_visible(timeout=WAIT_S * 1000)
            expect(card.locator("table.values")).to_contain_text("micro_batch")
            expect(card.locator("table.values tbody td").nth(0)).to_have_text("2")
            expect(card.locator("table.values tbody td").nth(1)).to_have_text("4")
            expect(card).to_contain_text("input-bound: try a larger batch")
            # Whether approving restarts the job, in words, from the change's scope.
            expect(card.locator(".applies")).to_have_text(re.compile(
                r"^Applied live: .*without a restart"))
            # Times carry their zone.
            expect(card.locator(".meta").first).to_contain_text(re.compile(
                r"proposed \d+/\d+/\d+, \d\d:\d\d:\d\d E[SD]T"))
            # The finding open on the job, with its numbers and the bound they crossed.
            measured = card.locator("table.measurements tbody tr", has_text="wait_share")
            expect(measured).to_contain_text("0.31")
            expect(measured).to_contain_text("> 0.2")
            expect(page.locator("#findings")).to_contain_text("input_bound")
            path = card.locator("svg.plot path.line").first
            expect(path).to_have_attribute("d", DRAWN_PATH, timeout=WAIT_S * 1000)
            expect(card.locator("svg.plot")).to_have_attribute(
                "aria-label", re.compile(re.escape(TOKENS_PER_SECOND)))

            # The first Approve button is on the first screen, unscrolled, at 1366x900.
            approve = page.get_by_role("button", name=f"Approve change {change['id']}")
            box = approve.bounding_box()
            assert page.evaluate("window.scrollY") == 0
            assert box is not None and box["y"] + box["height"] <= VIEWPORT["height"], box
            page.screenshot(path=str(ARTIFACTS / "first-screen.png"))

            # No token: refused in words, nothing changes.
            page.get_by_label("Your name").fill("alice")
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

            # The right token: approved (a low-risk change asks no confirmation), then applied
            # to the job and observed.
            page.get_by_label("API token").fill(TOKEN)
            assert "s3cret" not in page.url
            approve.click()
            expect(page.locator("#status")).to_contain_text(
                f"Change {change['id']} approved by alice", timeout=WAIT_S * 1000)
            assert dialogs == []
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
            # The page moves it out of the approval queue into the work in progress, where
            # its card plots the effect: the job's throughput with the candidate window it
            # is measuring now, and that window's mean.
            expect(page.locator(card_sel).locator("textarea")).to_have_count(
                0, timeout=WAIT_S * 1000)
            page.get_by_role("button", name="Refresh now").click()
            inflight = page.locator("#inflight article", has_text="micro_batch: 2 → 4")
            expect(inflight).to_contain_text("observing")
            expect(inflight).to_contain_text("approved by alice")
            expect(inflight.locator(".applies")).to_contain_text("Applied live")
            expect(inflight.locator("svg.plot path.line").first).to_have_attribute(
                "d", DRAWN_PATH, timeout=WAIT_S * 1000)
            expect(inflight.locator("svg.plot rect.window-candidate.window-running")).to_have_count(
                1, timeout=WAIT_S * 1000)
            expect(inflight.locator(".window-means")).to_contain_text(
                re.compile(r"candidate v\d+ \d+"), timeout=WAIT_S * 1000)
            expect(page.locator("#pending")).to_contain_text("Nothing waits for approval")
            page.screenshot(path=str(ARTIFACTS / "approved.png"), full_page=True)

            # Reject: a reason is required, then the change is rejected and in the history.
            second = propose(url, {"micro_batch": 1}, "smaller batch")
            page.get_by_role("button", name="Refresh now").click()
            card = page.locator(f'#pending article[data-change-id="{second["id"]}"]')
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
            # The history's card plots the job's throughput around it too.
            history = page.locator("#history article", has_text="micro_batch: 2 → 1")
            expect(history).to_contain_text("rejected")
            expect(history.locator("svg.plot path.line").first).to_have_attribute(
                "d", DRAWN_PATH, timeout=WAIT_S * 1000)
            # "Show events" stays open across the page's automatic refresh.
            history.get_by_role("button", name=f"Show events of change {second['id']}").click()
            events = page.locator(f"#events-{second['id']}")
            expect(events).to_contain_text("by alice: not during the launch")
            refreshed_on_its_own(page)
            refreshed_on_its_own(page)
            expect(events).to_be_visible()
            expect(events).to_contain_text("by alice: not during the launch")
            expect(history.get_by_role(
                "button", name=f"Hide events of change {second['id']}")).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "history.png"), full_page=True)
            assert session_token(page) == TOKEN
            assert errors == []
            browser.close()
    finally:
        job.close()


def test_high_risk_asks_first_and_a_lost_sidecar_is_one_banner(
        sidecar: Running, chromium_binary: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    url = sidecar.url
    job = StandInJob(url)
    try:
        change = propose(url, {"offload": True}, "offload to save memory")
        assert change["risk"] == "high" and change["scope"] == "restart"
        with sync_playwright() as pw:
            browser, page, errors = open_page(pw, chromium_binary, url)
            card = page.locator(f'#pending article[data-change-id="{change["id"]}"]')
            expect(card).to_be_visible(timeout=WAIT_S * 1000)
            expect(card.locator(".applies")).to_have_text(re.compile(
                r"^Needs a restart: approving does not restart the job"))
            page.get_by_label("Your name").fill("bob")
            page.get_by_label("API token").fill(TOKEN)
            approve = card.get_by_role("button", name=f"Approve change {change['id']}")

            # Cancelled at the confirmation: nothing is sent.
            asked: list[str] = []
            page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
            approve.click()
            expect(card.locator(".card-status")).to_contain_text(
                "cancelled at the high-risk confirmation")
            assert len(asked) == 1 and "HIGH-RISK" in asked[0] and "offload" in asked[0]
            assert "Needs a restart" in asked[0]
            assert change_state(url, change["id"])["state"] == "proposed"
            # Confirmed: approved.
            page.once("dialog", lambda d: (asked.append(d.message), d.accept()))
            approve.click()
            expect(page.locator("#status")).to_contain_text(
                f"Change {change['id']} approved by bob", timeout=WAIT_S * 1000)
            assert len(asked) == 2
            assert change_state(url, change["id"])["approved_by"] == "bob"
            page.get_by_role("button", name="Refresh now").click()
            shown = page.locator(f'article[data-change-id="{change["id"]}"]')
            expect(shown).to_have_count(1)

            # The sidecar goes away: one banner, the last state stays, no error anywhere.
            # (The last state is what the page showed once the banner was up: the page may
            # refresh, and the job apply the change, while the sidecar stops.)
            sidecar.stop()
            banner = page.locator("#offline")
            expect(banner).to_be_visible(timeout=WAIT_S * 1000)
            expect(banner).to_contain_text("The sidecar is not answering")
            expect(banner).to_contain_text(re.compile(r"said at \d\d:\d\d:\d\d E[SD]T"))
            status_text = page.locator("#sidecar-status").inner_text()
            assert f"change {change['id']}" in status_text
            refreshed_on_its_own_or_not(page)
            expect(page.locator("[role=alert]:visible")).to_have_count(1)
            expect(page.locator(".error")).to_have_count(0)
            expect(shown).to_have_count(1)
            expect(page.locator("#sidecar-status")).to_have_text(status_text)
            page.screenshot(path=str(ARTIFACTS / "sidecar-gone.png"), full_page=True)
            assert errors == []
            browser.close()
    finally:
        job.close()


def refreshed_on_its_own_or_not(page: Any) -> None:
    """Two more refresh periods with the sidecar gone (nothing on the page may change)."""
    page.wait_for_timeout(2 * 5000 + 500)


def session_token(page: Any) -> str:
    return str(page.evaluate("() => sessionStorage.getItem('seedance.token')"))

