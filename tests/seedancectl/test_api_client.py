"""``SidecarClient`` against a real sidecar on 127.0.0.1 (``tests.seedancectl._live``) and a
SIMULATED job holding a real lease: every body has exactly the keys its type names, and every
failure is one ``SidecarError`` whose message is the HTTP status and the server's detail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import ConfigError, SeedanceError
from seedancectl._api_client import SidecarClient, SidecarError
from seedancectl._api_types import (
    AckJSON,
    ChangeDetailJSON,
    ChangeJSON,
    ComparisonJSON,
    ConfigJSON,
    EventJSON,
    KnobJSON,
    KnobsJSON,
    LeaseJobJSON,
    ReadinessJSON,
    SidecarInfoJSON,
    StatusJobJSON,
    StatusJSON,
    TuningJSON,
    WindowJSON,
)
from tests.seedancectl._live import TOKEN, Live, SimulatedJob, live_sidecar
from tests.servers import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    with live_sidecar(tmp_path, jobs={"gpt": {"tune": True, "knobs": ["threads"]}}) as live:
        live.post("/v1/jobs/gpt/tuning", {"by": "setup", "action": "pause"})  # quiet search
        yield live


@pytest.fixture
def api(live: Live) -> Iterator[SidecarClient]:
    with SidecarClient(live.url, token=TOKEN, timeout_s=10) as client:
        yield client


def conforms(body: Any, kind: Any) -> None:
    """``body`` has every key ``kind`` requires and none it does not name."""
    assert isinstance(body, dict), body
    keys = set(body)
    assert kind.__required_keys__ <= keys, kind.__required_keys__ - keys
    assert keys <= kind.__required_keys__ | kind.__optional_keys__, (
        keys - kind.__required_keys__ - kind.__optional_keys__)


def test_reads_and_writes_answer_in_their_types(live: Live, api: SidecarClient) -> None:
    job = SimulatedJob(live)
    assert api.readiness() == {"ready": True, "job": "test", "reasons": []}
    conforms(api.readiness(), ReadinessJSON)

    leased = [j for j in api.jobs() if j["job"] == "gpt"]
    assert len(leased) == 1 and leased[0]["state"] == "attached"
    conforms(leased[0], LeaseJobJSON)
    knobs = api.knobs("gpt")
    conforms(knobs, KnobsJSON)
    conforms(knobs["baseline"], ConfigJSON)
    for knob in knobs["knobs"]:
        conforms(knob, KnobJSON)
    assert knobs["baseline"]["values"]["precision.ffn"] == "fp32"
    assert api.changes(job="gpt") == []

    proposed = api.propose("gpt", {"precision.ffn": "bf16"}, by="alice", reason="try bf16")
    conforms(proposed, ChangeJSON)
    assert (proposed["state"], proposed["values"]) == ("proposed", {"precision.ffn": "bf16"})
    approved = api.approve(proposed["id"], by="alice", comment="ok")
    assert (approved["state"], approved["approved_by"]) == ("approved", "alice")
    live.wait_state(proposed["id"], "applying")
    job.ack_latest()
    shown = api.change(proposed["id"])
    conforms(shown, ChangeDetailJSON)
    assert [e["kind"] for e in shown["events"]][:2] == ["proposed", "approved"]
    for event in shown["events"]:
        conforms(event, EventJSON)
    # the controller journals on (the ack, the next window) between the two reads
    audit = api.audit(change_id=proposed["id"])
    assert audit[:len(shown["events"])] == shown["events"]
    assert [c["id"] for c in api.changes(job="gpt", states=["applying", "observing"])] == [
        proposed["id"]]
    assert api.changes(job="gpt", states=["kept"]) == []

    acks = api.acks("gpt")
    assert acks and acks[-1]["status"] == "applied"
    conforms(acks[-1], AckJSON)
    rolled = api.rollback("gpt", by="bob", reason="pager", change_id=proposed["id"])
    assert rolled["state"] == "rolled_back"
    for window in rolled["windows"]:
        conforms(window, WindowJSON)
    if rolled["comparison"] is not None:
        conforms(rolled["comparison"], ComparisonJSON)

    tuning = api.set_tuning("gpt", "resume", by="carol")
    conforms(tuning, TuningJSON)
    assert tuning == {"job": "gpt", "tuning": "running"}
    status = api.status()
    conforms(status, StatusJSON)
    conforms(status["sidecar"], SidecarInfoJSON)
    (gpt,) = [j for j in status["jobs"] if j["job"] == "gpt"]
    conforms(gpt, StatusJobJSON)
    assert (gpt["state"], gpt["tuning"]) == ("attached", "running")
    assert api.findings() == [] and api.findings(job="gpt", include_closed=True) == []


def test_writes_without_the_token_are_the_sidecars_401(live: Live) -> None:
    before = live.get("/v1/audit")
    with SidecarClient(live.url) as anonymous:
        assert anonymous.status()["sidecar"]["job"] == "test"  # reads need none
        with pytest.raises(SidecarError) as refused:
            anonymous.set_tuning("gpt", "resume", by="mallory")
    assert refused.value.status == 401
    assert str(refused.value) == (f"sidecar {live.url}: HTTP 401: a bearer token is required "
                                  "(seedancectl --token-file)")
    with SidecarClient(live.url, token="not-the-token") as wrong, \
            pytest.raises(SidecarError) as forbidden:
        wrong.set_tuning("gpt", "resume", by="mallory")
    assert forbidden.value.status == 403
    assert str(forbidden.value) == (f"sidecar {live.url}: HTTP 403: the bearer token is not "
                                    "this sidecar's")
    assert live.get("/v1/audit") == before  # refused before the handler ran


@pytest.mark.parametrize(("call", "status", "message"), [
    (lambda api: api.change("nope"), 404, "no change 'nope'"),
    (lambda api: api.knobs("ghost"), 404, "ghost"),
    (lambda api: api.approve("nope", by="x"), 404, "no change 'nope'"),
    (lambda api: api.rollback("gpt", by="x", reason="r"), 409, "no change"),
    (lambda api: api.set_tuning("gpt", "stop", by="x"), 422, "action: "),
    (lambda api: api.propose("gpt", {"precision.ffn": "fp64"}, by="x", reason="r"), 422,
     "precision.ffn"),
])
def test_an_error_answer_is_one_line_with_status_and_detail(
        live: Live, api: SidecarClient, call: Any, status: int, message: str) -> None:
    SimulatedJob(live)
    with pytest.raises(SidecarError) as failed:
        call(api)
    assert failed.value.status == status
    text = str(failed.value)
    assert text.startswith(f"sidecar {live.url}: HTTP {status}: ") and message in text, text
    assert "\n" not in text and isinstance(failed.value, SeedanceError)


def test_a_stopping_sidecar_is_a_503_with_its_reason(live: Live, api: SidecarClient) -> None:
    live.sidecar.shutdown()  # its parts stop; the HTTP server still answers
    with pytest.raises(SidecarError) as stopping:
        api.status()
    assert stopping.value.status == 503
    assert str(stopping.value) == (f"sidecar {live.url}: HTTP 503: the sidecar is starting or "
                                   "stopping")
    ready = api.readiness()  # a 503 is /readyz's answer, not an error
    assert ready["ready"] is False and ready["reasons"], ready


def test_no_answer_has_no_status_and_a_bad_url_is_a_config_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with SidecarClient(url, timeout_s=5) as nobody, pytest.raises(SidecarError) as silent:
        nobody.status()
    assert silent.value.status is None
    assert str(silent.value).startswith(f"no sidecar answers at {url} (ConnectError: ")
    with pytest.raises(ConfigError, match="Invalid port"):
        SidecarClient("http://127.0.0.1:notaport")
