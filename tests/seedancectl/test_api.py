"""The operator API against a real sidecar (uvicorn on loopback, real JobRegistry, controller,
state database) and a SIMULATED job that holds a real lease over HTTP."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from seedancectl._api_client import SidecarClient
from tests.seedancectl._live import KNOBS, TOKEN, Live, SimulatedJob, Webhook, live_sidecar

pytestmark = pytest.mark.integration


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    with live_sidecar(tmp_path, jobs={"gpt": {"tune": False}, "tuned": {"tune": True}}) as live:
        yield live


def propose(live: Live, values: dict[str, Any], job: str = "gpt") -> dict[str, Any]:
    reply = live.post(f"/v1/jobs/{job}/changes", {"values": values, "by": "alice",
                                                  "reason": "test"})
    assert reply.status_code == 201, reply.text
    return reply.json()  # type: ignore[no-any-return]


# Every mutating endpoint, with a body that would succeed given the right token.
MUTATING = [
    ("approve", lambda cid: (f"/v1/changes/{cid}/approve", {"by": "mallory"})),
    ("reject", lambda cid: (f"/v1/changes/{cid}/reject", {"by": "mallory", "reason": "x"})),
    ("rollback", lambda cid: ("/v1/jobs/gpt/rollback", {"by": "mallory", "reason": "x"})),
    ("tuning", lambda cid: ("/v1/jobs/tuned/tuning", {"by": "mallory", "action": "pause"})),
    ("propose", lambda cid: ("/v1/jobs/gpt/changes", {
        "by": "mallory", "reason": "x", "values": {"precision.ffn": "bf16"}})),
]


@pytest.mark.parametrize(("name", "call"), MUTATING, ids=[m[0] for m in MUTATING])
def test_every_mutating_endpoint_needs_the_token(live: Live, name: str, call: Any) -> None:
    job = SimulatedJob(live)
    waiting = propose(live, {"precision.ffn": "bf16"})
    if name == "rollback":  # something to roll back: an approved change in flight
        live.post(f"/v1/changes/{waiting['id']}/approve", {"by": "alice"})
        live.wait_state(waiting["id"], "applying")
        job.ack_latest()
        live.wait_state(waiting["id"], "observing")
    path, body = call(waiting["id"])
    before_events = live.get("/v1/audit")
    before_changes = live.get("/v1/changes")
    before_status = live.get("/v1/status")

    missing = live.post(path, body, token=None)
    assert missing.status_code == 401, missing.text
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = live.post(path, body, token=TOKEN[:-1] + "X")
    assert wrong.status_code == 403, wrong.text
    basic = live.http.post(path, json=body, headers={"Authorization": f"Basic {TOKEN}"})
    assert basic.status_code == 401  # the right secret in the wrong scheme

    assert live.get("/v1/audit") == before_events
    assert live.get("/v1/changes") == before_changes
    assert live.get("/v1/status")["jobs"] == before_status["jobs"]
    assert not any(e["actor"] == "mallory" for e in live.get("/v1/audit"))

    right = live.post(path, body)
    assert right.status_code in (200, 201), right.text
    assert any(e["actor"] == "mallory" for e in live.get("/v1/audit"))


def test_unauthorised_approval_changes_nothing(live: Live) -> None:
    job = SimulatedJob(live)
    waiting = propose(live, {"precision.ffn": "bf16"})
    desired = job.lease()["config"]["version"]
    assert live.post(f"/v1/changes/{waiting['id']}/approve", {"by": "mallory"},
                     token="nope").status_code == 403
    change = live.get(f"/v1/changes/{waiting['id']}")
    assert change["state"] == "proposed"
    assert change["approved_by"] is None
    assert [e["kind"] for e in change["events"]] == ["proposed"]
    assert job.lease()["config"]["version"] == desired  # nothing was sent to the job


def test_high_risk_change_waits_then_is_approved_applied_and_rolled_back(live: Live) -> None:
    job = SimulatedJob(live)
    baseline = job.lease()["baseline"]
    change = propose(live, {"precision.ffn": "bf16"})
    assert (change["state"], change["risk"], change["scope"]) == ("proposed", "high", "live")
    assert change["values"] == {"precision.ffn": "bf16"}
    assert live.get("/v1/status")["waiting"] == [change["id"]]

    approved = live.post(f"/v1/changes/{change['id']}/approve", {"by": "alice",
                                                                 "comment": "go"})
    assert approved.status_code == 200, approved.text
    assert approved.json()["approved_by"] == "alice"
    live.wait_state(change["id"], "applying")
    lease = job.ack_latest()
    assert lease["change_id"] == change["id"]
    assert lease["config"]["values"]["precision.ffn"] == "bf16"
    assert {"kind": "snapshot", "change_id": change["id"]} in lease["actions"]  # bf16 < fp32
    live.wait_state(change["id"], "observing")

    rolled = live.post("/v1/jobs/gpt/rollback", {"by": "bob", "reason": "on-call says no"})
    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["state"] == "rolled_back"
    after = job.lease()
    assert after["config"]["values"] == baseline["values"]
    assert after["config"]["version"] > lease["config"]["version"]

    events = live.get("/v1/audit", change=change["id"])
    moves = [(e["kind"], e["actor"]) for e in events if e["to_state"]]
    assert moves[:2] == [("proposed", "alice"), ("approved", "alice")]
    assert ("rolled_back", "bob") in moves
    assert live.post("/v1/jobs/gpt/rollback", {"by": "bob", "reason": "again"}).status_code == 409


def test_reject_and_state_machine_errors(live: Live) -> None:
    SimulatedJob(live)
    change = propose(live, {"precision.ffn": "bf16"})
    rejected = live.post(f"/v1/changes/{change['id']}/reject", {"by": "bob", "reason": "no"})
    assert rejected.json()["state"] == "rejected"
    again = live.post(f"/v1/changes/{change['id']}/approve", {"by": "alice"})
    assert again.status_code == 409 and "rejected -> approved" in again.json()["detail"]
    assert live.post("/v1/changes/nope/approve", {"by": "a"}).status_code == 404
    assert live.post(f"/v1/changes/{change['id']}/reject", {"by": "b"}).status_code == 422
    bad = live.post("/v1/jobs/gpt/changes", {"by": "a", "reason": "r",
                                             "values": {"precision.ffn": "fp64"}})
    assert bad.status_code == 422 and "precision.ffn" in bad.json()["detail"]
    assert live.post("/v1/jobs/ghost/changes", {"by": "a", "reason": "r",
                                                "values": {"threads": 2}}).status_code == 404


def test_restart_scope_scheduler_change_waits_for_a_person(live: Live) -> None:
    SimulatedJob(live)
    change = propose(live, {"scheduler.policy": "dynamic-topo", "scheduler.numa_aware": True})
    assert (change["state"], change["scope"], change["risk"]) == ("proposed", "restart", "high")


def test_auto_mode_approves_only_live_low_risk_changes_within_bounds(tmp_path: Path) -> None:
    with live_sidecar(tmp_path, approval={"mode": "auto", "bounds": {
            "threads": {"low": 1, "high": 4}}}) as live:
        SimulatedJob(live)
        inside = propose(live, {"threads": 4})
        assert (inside["state"], inside["approved_by"]) == ("approved", "auto")
        assert propose(live, {"threads": 6})["state"] == "proposed"  # outside the bounds
        assert propose(live, {"precision.ffn": "bf16"})["state"] == "proposed"  # high risk
        assert propose(live, {"scheduler.rdma": True})["state"] == "proposed"  # restart


def test_pause_and_resume_tuning_are_journaled(live: Live) -> None:
    assert live.get("/v1/status")["jobs"][1]["tuning"] == "running"
    paused = live.post("/v1/jobs/tuned/tuning", {"by": "carol", "action": "pause"})
    assert paused.json() == {"job": "tuned", "tuning": "paused"}
    status = {j["job"]: j for j in live.get("/v1/status")["jobs"]}
    assert status["tuned"]["tuning"] == "paused"
    resumed = live.post("/v1/jobs/tuned/tuning", {"by": "carol", "action": "resume"})
    assert resumed.json()["tuning"] == "running"
    events = [e for e in live.get("/v1/audit", job="tuned") if e["kind"] == "tuning"]
    assert [(e["actor"], e["detail"]["action"]) for e in events] == [
        ("carol", "pause"), ("carol", "resume")]
    off = live.post("/v1/jobs/gpt/tuning", {"by": "carol", "action": "pause"})
    assert off.status_code == 409 and "not enabled" in off.json()["detail"]


def test_paused_search_proposes_nothing_and_resumed_search_does(tmp_path: Path) -> None:
    with live_sidecar(tmp_path, jobs={"gpt": {"tune": True, "knobs": ["threads"]}}) as live:
        live.post("/v1/jobs/gpt/tuning", {"by": "carol", "action": "pause"})
        SimulatedJob(live)
        deadline = time.monotonic() + 20
        searches = live.sidecar.searches
        assert searches is not None
        while searches.tuning_state("gpt") != "paused" or not searches.searching("gpt"):
            assert time.monotonic() < deadline, "the search was never set up"
            time.sleep(0.05)
        time.sleep(40 * live.sidecar.config.tuning_interval_s)  # rounds of the loop, paused
        assert live.get("/v1/changes") == []
        live.post("/v1/jobs/gpt/tuning", {"by": "carol", "action": "resume"})
        while not live.get("/v1/changes"):
            assert time.monotonic() < deadline + 20, "the resumed search proposed nothing"
            time.sleep(0.05)
        found = live.get("/v1/changes")
        assert found[0]["source"] == "trial" and list(found[0]["values"]) == ["threads"]
        assert found[0]["meta"]["study"] == "seedance:gpt"


def test_webhook_gets_evidence_change_and_commands(tmp_path: Path) -> None:
    hook = Webhook()
    try:
        with live_sidecar(tmp_path, webhook_url=hook.url) as live:
            SimulatedJob(live)
            change = propose(live, {"precision.ffn": "bf16"})
            message = hook.wait(lambda m: change["id"] in m["text"])
            assert {"text", "blocks"} <= set(message)
            text = message["text"]
            assert "`precision.ffn`: 'fp32' -> 'bf16'" in text
            assert f"seedancectl approve {change['id']} --by NAME --sidecar {live.url}" in text
            assert f"seedancectl reject {change['id']} --by NAME --reason WHY" in text
            assert "operator: test" in text
            assert all(b["type"] in ("header", "section") for b in message["blocks"])
            live.wait_state(change["id"], "proposed")
            deadline_events = live.get("/v1/audit", change=change["id"])
            assert live.get("/v1/status")["webhook"]["sent"] >= 1 or deadline_events
    finally:
        hook.close()


def test_webhook_that_hangs_blocks_nothing_and_its_failure_is_counted(tmp_path: Path) -> None:
    with socket.socket() as silent:  # listens, never answers: every post runs into timeout_s
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/hook"
        with live_sidecar(tmp_path, webhook_url=url, webhook_timeout_s=1) as live:
            SimulatedJob(live)
            change = propose(live, {"precision.ffn": "bf16"})
            assert live.post(f"/v1/changes/{change['id']}/approve",
                             {"by": "alice"}).status_code == 200
            live.wait_state(change["id"], "applying")
            deadline = time.monotonic() + 20
            while live.get("/v1/status")["webhook"]["failed"] < 1:
                assert time.monotonic() < deadline, "the failed post was never counted"
                time.sleep(0.05)
            notes = [e for e in live.get("/v1/audit", change=change["id"])
                     if e["kind"] == "notified"]
            assert [n["detail"] for n in notes] == [{"delivered": False}]
            assert "ReadTimeout" in notes[0]["reason"]


def test_a_proposal_nobody_approves_expires(tmp_path: Path) -> None:
    with live_sidecar(tmp_path, approval={"proposal_ttl_s": 0.2}) as live:
        SimulatedJob(live)
        change = propose(live, {"precision.ffn": "bf16"})
        expired = live.wait_state(change["id"], "expired")
        assert expired["events"][-1]["actor"] == "controller"
        late = live.post(f"/v1/changes/{change['id']}/approve", {"by": "alice"})
        assert late.status_code == 409


def test_reads(live: Live) -> None:
    SimulatedJob(live)
    knobs = live.get("/v1/jobs/gpt/knobs")
    assert {k["name"] for k in knobs["knobs"]} >= {"threads", "scheduler.policy"}
    assert knobs["mode"] == "suggest" and knobs["tuning"] == "off"
    assert live.get("/v1/findings") == [] and live.get("/v1/findings", all=True) == []
    assert live.http.get("/v1/findings/nope").status_code == 404
    assert live.http.get("/v1/jobs/ghost/knobs").status_code == 404
    change = propose(live, {"threads": 3})
    assert [c["id"] for c in live.get("/v1/changes", job="gpt", state="proposed")] == [
        change["id"]]
    assert live.get("/v1/changes", state="kept") == []


def test_changes_come_in_pages_that_the_client_follows_to_the_end(live: Live) -> None:
    SimulatedJob(live)
    made = [propose(live, {"threads": n})["id"] for n in (1, 3, 4, 5, 6)]
    reply = live.http.get("/v1/changes", params={"job": "gpt", "limit": 2})
    paged = [c["id"] for c in reply.json()]
    while "next" in reply.links:
        assert len(reply.json()) == 2
        reply = live.http.get(reply.links["next"]["url"])
        assert reply.status_code == 200, reply.text
        paged += [c["id"] for c in reply.json()]
    assert paged == made and len(reply.json()) == 1  # oldest first, each once, 2 + 2 + 1
    assert "next" not in live.http.get("/v1/changes", params={"limit": 5}).links
    with SidecarClient(live.url) as client:  # the CLI's client reads every page
        assert [c["id"] for c in client.changes(job="gpt", page=2)] == made
        assert [c["id"] for c in client.changes(states=["proposed"])] == made
    bad = live.http.get("/v1/changes", params={"after": "yesterday"})
    assert bad.status_code == 400 and "is not a cursor" in bad.json()["detail"]
    assert live.http.get("/v1/changes", params={"limit": 0}).status_code == 422
def test_generated_token_is_written_once_with_private_mode(tmp_path: Path) -> None:
    from seedancectl._api import resolve_token
    from seedancectl._config import SidecarConfig

    config = SidecarConfig(store=tmp_path / "data" / "metrics.db")
    token, path = resolve_token(config, {})
    assert path == tmp_path / "data" / "token" and len(token) >= 32
    assert path.stat().st_mode & 0o077 == 0
    assert resolve_token(config, {}) == (token, path)
    assert resolve_token(config, {"SEEDANCE_TOKEN": "from-env"}) == ("from-env", None)
    given = tmp_path / "given"
    given.write_text("from-file\n")
    assert resolve_token(config.model_copy(update={"token_file": given}),
                         {"SEEDANCE_TOKEN": "from-env"}) == ("from-file", given)


def test_a_job_token_the_operator_issued_holds_that_jobs_lease_only(tmp_path: Path) -> None:
    issued = tmp_path / "gpt.token"
    issued.write_text("issued-to-gpt-only\n")
    with live_sidecar(tmp_path, jobs={"gpt": {"token_file": issued}}) as live:
        body = {"knobs": KNOBS, "baseline": {}, "lease_ttl_s": 60}

        def attach(job: str, token: str | None) -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return live.http.post(f"/v1/jobs/{job}/attach", json=body,
                                  headers=headers).status_code

        assert attach("gpt", None) == 401
        assert attach("gpt", "a-guess") == 403
        assert attach("other", "issued-to-gpt-only") == 403
        assert attach("gpt", "issued-to-gpt-only") == 200
        assert attach("other", TOKEN) == 200  # the sidecar's own token holds any job's lease
        assert {j["job"] for j in live.get("/v1/jobs")} == {"gpt", "other"}
        # the job token is no operator credential
        reply = live.post("/v1/jobs/gpt/tuning", {"by": "x", "action": "pause"},
                          token="issued-to-gpt-only")
        assert reply.status_code == 403


def test_attaching_again_never_replaces_the_baseline_and_is_audited(live: Live) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def attach(baseline: dict[str, Any], knobs: list[dict[str, Any]] = KNOBS) -> Any:
        reply = live.http.post("/v1/jobs/gpt/attach", headers=headers, json={
            "knobs": knobs, "baseline": baseline, "lease_ttl_s": 60})
        assert reply.status_code == 200, reply.text
        return reply.json()

    first = attach({"threads": 4})
    assert first["baseline"]["values"]["threads"] == 4
    # a second attach (a restarted job, or someone holding a token) proposing other values
    second = attach({"threads": 1, "precision.ffn": "bf16"})
    assert second["baseline"]["values"] == first["baseline"]["values"]
    assert second["config"]["values"]["precision.ffn"] == "fp32"
    # a job declaring one knob less (a new version of it): the stored values stay
    fewer = [k for k in KNOBS if k["name"] != "kv.value_bits"]
    third = attach({"threads": 2}, fewer)
    assert third["baseline"]["values"]["threads"] == 4 and "kv.value_bits" not in (
        third["baseline"]["values"])
    assert live.get("/v1/changes") == []  # no change was made behind the operator's back
    attaches = [e for e in live.get("/v1/audit") if e["kind"] == "attach"]
    assert [e["detail"]["outcome"] for e in attaches] == ["new", "resumed", "merged"]
    assert attaches[1]["detail"]["ignored"] == ["precision.ffn", "threads"]
    assert attaches[1]["actor"] == "job:gpt" and "ignored" in attaches[1]["reason"]
