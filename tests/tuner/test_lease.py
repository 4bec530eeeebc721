"""The sidecar side of the knob lease: registry semantics and the HTTP router."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from seedancectl._config import SidecarConfig
from seedancectl._sidecar import Sidecar
from tuner._knobs import Knob, KnobError
from tuner._lease import JobRegistry
from tuner._lease_http import lease_router
from tuner._lease_messages import InvalidRequestError, JobStatus, SessionError, UnknownJobError
from tuner._versions import VersionLedger

KNOBS = [
    Knob(name="precision.ffn", default="fp32", choices=("fp32", "bf16", "fp16")),
    Knob(name="lr_scale", default=1.0, low=0.1, high=10.0),
    Knob(name="threads", default=2, low=1, high=8, integer=True),
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> JobRegistry:
    return JobRegistry(lease_ttl_s=10.0, clock=clock)


def attach(registry: JobRegistry, job: str = "gpt", **kwargs: object) -> str:
    session, _ = registry.attach(job, knobs=KNOBS, baseline={"threads": 4}, **kwargs)  # type: ignore[arg-type]
    return session


def test_attach_gives_the_baseline_and_versions_continue_above_the_job(
        registry: JobRegistry) -> None:
    session, config = registry.attach("gpt", knobs=KNOBS, baseline={"threads": 4}, version=41)
    assert config.values == {"precision.ffn": "fp32", "lr_scale": 1.0, "threads": 4}
    assert config.version == 42
    status = registry.status("gpt")
    assert status.state == "attached" and status.session == session
    assert status.baseline == config == status.desired
    assert status.acked_version is None and status.last_step is None


def test_versions_never_repeat_across_a_restart(state_db_url: str, clock: FakeClock) -> None:
    url = state_db_url
    before = JobRegistry(lease_ttl_s=10.0, clock=clock, ledger=VersionLedger(url))
    attach(before)
    issued = [before.set_desired("gpt", {"lr_scale": x}).version for x in (2.0, 3.0)]
    # the sidecar dies here: the job applied v1 only and never saw the two versions above it
    after = JobRegistry(lease_ttl_s=10.0, clock=clock, ledger=VersionLedger(url))
    _, config = after.attach("gpt", knobs=KNOBS, baseline={"threads": 4}, version=1)
    assert config.version > max(issued)
    assert after.set_desired("gpt", {"lr_scale": 4.0}).version == config.version + 1
    assert VersionLedger(url).last("gpt") == config.version + 1
    assert VersionLedger(url).last("other") == 0


def test_set_desired_assigns_a_new_version_every_call_and_keeps_baseline_values(
        registry: JobRegistry) -> None:
    attach(registry)
    first = registry.set_desired("gpt", {"lr_scale": 2.0}, change_id="c1")
    again = registry.set_desired("gpt", {"lr_scale": 2.0}, change_id="c1")
    assert again.version > first.version > registry.status("gpt").baseline.version
    assert again.values == {"precision.ffn": "fp32", "lr_scale": 2.0, "threads": 4}
    assert registry.status("gpt").change_id == "c1"


@pytest.mark.parametrize("values", [{"lr_scale": 99.0}, {"precision.ffn": "int4"},
                                    {"nope": 1}, {"threads": 2.5}])
def test_set_desired_refuses_values_outside_the_knob_space(registry: JobRegistry,
                                                           values: dict[str, object]) -> None:
    attach(registry)
    before = registry.status("gpt").desired
    with pytest.raises(KnobError):
        registry.set_desired("gpt", values)
    assert registry.status("gpt").desired == before


def test_unknown_job_and_stale_session_and_other_ranks(registry: JobRegistry) -> None:
    with pytest.raises(UnknownJobError):
        registry.set_desired("nope", {})
    old = attach(registry)
    attach(registry)  # a second attach replaces the session
    with pytest.raises(SessionError):
        registry.lease("gpt", old, 0, 0)
    with pytest.raises(SessionError):
        registry.attach("gpt", rank=1, knobs=KNOBS, baseline={})


def test_long_poll_returns_at_once_on_a_new_version(registry: JobRegistry) -> None:
    session = attach(registry)
    desired = registry.set_desired("gpt", {"lr_scale": 3.0}, change_id="c7",
                                   traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    lease = registry.lease("gpt", session, known_version=desired.version - 1, wait_s=0)
    assert lease.config == desired and lease.change_id == "c7"
    assert lease.traceparent is not None and lease.baseline.values["lr_scale"] == 1.0


def test_long_poll_wakes_when_the_desired_config_changes(registry: JobRegistry) -> None:
    session = attach(registry)
    known = registry.status("gpt").desired.version
    polled = threading.Event()
    result: list[int] = []

    def poll() -> None:
        polled.set()
        result.append(registry.lease("gpt", session, known, wait_s=5.0).config.version)

    poller = threading.Thread(target=poll)
    poller.start()
    polled.wait(5)
    pushed = registry.set_desired("gpt", {"threads": 1})
    poller.join(10)
    assert result == [pushed.version]


def test_long_poll_times_out_with_the_same_config(registry: JobRegistry) -> None:
    session = attach(registry)
    known = registry.status("gpt").desired.version
    start = time.monotonic()
    lease = registry.lease("gpt", session, known, wait_s=0.2)
    assert time.monotonic() - start >= 0.2
    assert lease.config.version == known


def test_long_poll_is_capped_at_half_the_ttl() -> None:
    registry = JobRegistry(lease_ttl_s=0.4)
    session = attach(registry)
    lease = registry.lease("gpt", session, registry.status("gpt").desired.version, wait_s=3600)
    assert lease.lease_ttl_s == 0.4  # returned: a wait of an hour would hang the test


def test_acks_and_wait_ack(registry: JobRegistry) -> None:
    session = attach(registry)
    desired = registry.set_desired("gpt", {"lr_scale": 2.0})
    assert registry.wait_ack("gpt", desired.version, timeout_s=0.05) is None
    threading.Timer(0.05, registry.ack, args=("gpt", session), kwargs={
        "version": desired.version, "step": 17, "status": "applied"}).start()
    ack = registry.wait_ack("gpt", desired.version, timeout_s=10)
    assert ack is not None and (ack.version, ack.step, ack.status) == (desired.version, 17,
                                                                       "applied")
    status = registry.status("gpt")
    assert (status.acked_version, status.last_step) == (desired.version, 17)
    later = registry.set_desired("gpt", {"lr_scale": 3.0})
    registry.ack("gpt", session, version=later.version, step=30, status="failed", error="boom")
    assert registry.wait_ack("gpt", desired.version + 1, timeout_s=0).version == later.version
    assert registry.status("gpt").acked_version == desired.version  # failed is not applied
    assert [a.step for a in registry.acks("gpt")] == [17, 30]
    with pytest.raises(InvalidRequestError):
        registry.ack("gpt", session, version=later.version + 5, step=31, status="applied")


def test_actions_bump_the_version_and_stay_pending_until_acked(registry: JobRegistry) -> None:
    session = attach(registry)
    desired = registry.set_desired("gpt", {"precision.ffn": "bf16"}, change_id="c1")
    snap = registry.push_action("gpt", {"kind": "snapshot", "change_id": "c1"})
    assert snap.version > desired.version and snap.values == desired.values
    lease = registry.lease("gpt", session, desired.version, wait_s=0)
    assert lease.config == snap
    assert lease.actions == ({"kind": "snapshot", "change_id": "c1"},)
    registry.ack("gpt", session, version=snap.version, step=3, status="applied",
                 actions=[{"kind": "snapshot", "status": "done"}])
    assert registry.lease("gpt", session, 0, wait_s=0).actions == ()
    with pytest.raises(InvalidRequestError):
        registry.push_action("gpt", {"kind": "rollback", "scope": "local"})  # no group
    with pytest.raises(InvalidRequestError):
        registry.push_action("gpt", {"kind": "explode"})


def test_lapse_resets_to_baseline_and_calls_back_once(registry: JobRegistry,
                                                      clock: FakeClock) -> None:
    lapsed: list[JobStatus] = []
    registry.on_lapse(lapsed.append)
    session = attach(registry)
    trial = registry.set_desired("gpt", {"lr_scale": 5.0}, change_id="c9")
    registry.push_action("gpt", {"kind": "snapshot", "change_id": "c9"})
    clock.now += 7.5
    registry.lease("gpt", session, trial.version, wait_s=0)  # renews
    clock.now += 7.5
    assert registry.reap() == []
    clock.now += 3.0
    assert registry.reap() == ["gpt"]
    assert registry.reap() == []
    assert [s.job for s in lapsed] == ["gpt"]
    status = registry.status("gpt")
    assert status.state == "lapsed" and status.change_id is None
    assert status.desired.values == status.baseline.values
    assert status.desired.version > trial.version
    with pytest.raises(SessionError):
        registry.lease("gpt", session, status.desired.version, wait_s=0)
    session, config = registry.attach("gpt", knobs=KNOBS, baseline={})
    assert config == status.desired  # the sidecar's baseline, not the job's new proposal
    assert registry.lease("gpt", session, config.version, wait_s=0).actions == ()
    assert registry.status("gpt").state == "attached"


def test_reattach_with_other_knobs_takes_the_jobs_baseline(registry: JobRegistry) -> None:
    attach(registry)
    registry.set_desired("gpt", {"lr_scale": 5.0})
    other = [Knob(name="micro_batch", default=4, choices=(1, 2, 4))]
    _, config = registry.attach("gpt", knobs=other, baseline={"micro_batch": 2})
    assert config.values == {"micro_batch": 2}
    assert registry.status("gpt").baseline == config


def test_reaper_thread_finds_a_lapse() -> None:
    registry = JobRegistry(lease_ttl_s=0.2)
    seen = threading.Event()
    registry.on_lapse(lambda status: seen.set())
    registry.on_lapse(lambda status: 1 / 0)  # a failing callback is logged, not fatal
    attach(registry)
    registry.start()
    try:
        assert seen.wait(10)
        assert registry.status("gpt").state == "lapsed"
    finally:
        registry.shutdown()
        registry.shutdown()


# ---- HTTP ---------------------------------------------------------------------------------------


SIDECAR_TOKEN = "sidecar-token"
JOB_TOKENS = {"gpt": "gpt-token", "other": "other-token"}


def _authorise(job: str, token: str) -> bool:
    """As the sidecar does: its own token for every job, a job's own token for that job."""
    return token in (SIDECAR_TOKEN, JOB_TOKENS.get(job))


@pytest.fixture
def http(registry: JobRegistry) -> Iterator[TestClient]:
    app = FastAPI()
    app.include_router(lease_router(registry, _authorise))
    with TestClient(app, headers={"Authorization": f"Bearer {SIDECAR_TOKEN}"}) as client:
        yield client


def test_attach_lease_and_ack_need_the_jobs_token(http: TestClient,
                                                  registry: JobRegistry) -> None:
    anonymous = {"Authorization": ""}
    r = http.post("/v1/jobs/gpt/attach", json=attach_body(), headers=anonymous)
    assert r.status_code == 401 and "SEEDANCE_TOKEN" in r.json()["detail"]
    r = http.post("/v1/jobs/gpt/attach", json=attach_body(),
                  headers={"Authorization": "Bearer other-token"})  # another job's token
    assert r.status_code == 403 and "'gpt'" in r.json()["detail"]
    with pytest.raises(UnknownJobError):
        registry.status("gpt")  # nothing was attached by the refused calls
    session = http.post("/v1/jobs/gpt/attach", json=attach_body(),
                        headers={"Authorization": "Bearer gpt-token"}).json()["session"]
    for method, path, kwargs in (
            ("GET", "/v1/jobs/gpt/lease", {"params": {"session": session, "version": 0}}),
            ("POST", "/v1/jobs/gpt/ack", {"json": {"session": session, "version": 1,
                                                    "step": 1, "status": "applied"}})):
        r = http.request(method, path, headers=anonymous, **kwargs)  # type: ignore[arg-type]
        assert r.status_code == 401, (path, r.text)
    assert registry.status("gpt").last_step is None
    assert http.get("/v1/jobs", headers=anonymous).status_code == 200  # reading stays open


def attach_body(**overrides: object) -> dict[str, object]:
    return {"rank": 0, "world_size": 2, "kind": "train",
            "knobs": [k.to_json() for k in KNOBS], "baseline": {"threads": 4}, **overrides}


def test_router_attach_lease_ack(http: TestClient, registry: JobRegistry) -> None:
    r = http.post("/v1/jobs/gpt/attach", json=attach_body())
    assert r.status_code == 200, r.text
    body = r.json()
    session, version = body["session"], body["config"]["version"]
    assert body["lease_ttl_s"] == 10.0 and body["config"]["values"]["threads"] == 4
    desired = registry.set_desired("gpt", {"precision.ffn": "bf16"}, change_id="c2")
    r = http.get("/v1/jobs/gpt/lease", params={"session": session, "version": version,
                                               "wait_s": 5})
    assert r.status_code == 200
    lease = r.json()
    assert lease["config"] == desired.to_json() and lease["change_id"] == "c2"
    r = http.post("/v1/jobs/gpt/ack", json={"session": session, "version": desired.version,
                                            "step": 12, "status": "applied"})
    assert r.json() == {"ok": True}
    assert registry.status("gpt").last_step == 12
    jobs = http.get("/v1/jobs").json()
    assert [(j["job"], j["acked_version"], j["world_size"]) for j in jobs] == [
        ("gpt", desired.version, 2)]


def test_router_errors_are_404_409_422_with_one_line(http: TestClient) -> None:
    r = http.get("/v1/jobs/ghost/lease", params={"session": "x", "version": 0})
    assert r.status_code == 404 and "ghost" in r.json()["detail"]
    session = http.post("/v1/jobs/gpt/attach", json=attach_body()).json()["session"]
    http.post("/v1/jobs/gpt/attach", json=attach_body())
    r = http.get("/v1/jobs/gpt/lease", params={"session": session, "version": 0})
    assert r.status_code == 409 and "re-attach" in r.json()["detail"]
    r = http.post("/v1/jobs/gpt/attach", json=attach_body(baseline={"lr_scale": 50}))
    assert r.status_code == 422 and "lr_scale" in r.json()["detail"]
    assert "\n" not in r.json()["detail"]
    r = http.post("/v1/jobs/gpt/attach", json=attach_body(knobs=[{"name": "bad name"}]))
    assert r.status_code == 422
    r = http.post("/v1/jobs/gpt/attach", json=attach_body(rank=1))
    assert r.status_code == 409


def test_the_sidecar_serves_the_lease_router(tmp_path: Path) -> None:
    sidecar = Sidecar(SidecarConfig(store=tmp_path / "m.db", nvml="off"))
    sidecar.token = "the-sidecars-token"  # start() would read it; no lifespan here
    client = TestClient(sidecar.app())  # no lifespan: only the routing is under test
    assert client.post("/v1/jobs/gpt/attach", json=attach_body()).status_code == 401
    r = client.post("/v1/jobs/gpt/attach", json=attach_body(),
                    headers={"Authorization": "Bearer the-sidecars-token"})
    assert r.status_code == 200, r.text
    assert sidecar.jobs.status("gpt").session == r.json()["session"]
