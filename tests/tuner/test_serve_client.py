"""The serving client against a real lease server: the job declares the serving knobs, applies
a pushed config at a batch boundary and acks it; a config its apply refuses is acked failed and
the previous values stay; actions are refused with the reason; no sidecar, no network."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from tests.servers import free_port
from tests.tuner.test_client import LeaseServer
from tuner._knobs import KnobValue
from tuner._lease import JobRegistry
from tuner.job import NO_STATE, SERVING_KNOBS, ServeSession, attach_serving

pytestmark = pytest.mark.integration


@pytest.fixture
def server() -> Iterator[LeaseServer]:
    registry = JobRegistry(lease_ttl_s=5.0)
    registry.start()
    srv = LeaseServer(registry, free_port())
    srv.start()
    yield srv
    srv.stop()
    registry.shutdown()


class Replica:
    """Stands for the engine: records what it was told; refuses 2-bit keys when asked to."""

    def __init__(self, refuse_two_bit: bool = False) -> None:
        self.applied: list[dict[str, KnobValue]] = []
        self.refuse_two_bit = refuse_two_bit

    def apply(self, values: Mapping[str, KnobValue]) -> None:
        if self.refuse_two_bit and values["kv.key_bits"] == 2:
            raise ValueError("2-bit keys are not supported here")
        self.applied.append(dict(values))


def run_until(session: ServeSession, done: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "condition not met"
        session.boundary()
        time.sleep(0.01)


def acked(registry: JobRegistry, job: str, version: int) -> Callable[[], Any]:
    return lambda: [a for a in registry.acks(job) if a.version == version]


def test_a_serving_job_attaches_with_its_knobs_and_applies_at_a_batch_boundary(
        server: LeaseServer) -> None:
    replica = Replica()
    session = attach_serving(job="srv", sidecar=server.url, apply=replica.apply,
                             defaults={"kv.key_bits": 8, "kv.value_bits": 8})
    registry = server.registry
    try:
        run_until(session, lambda: any(s.job == "srv" for s in registry.jobs()))
        status = registry.status("srv")
        assert status.kind == "serve"
        assert set(status.knobs.knobs) == {k.name for k in SERVING_KNOBS}
        assert status.knobs.knobs["serving.sharding"].scope == "restart"
        assert status.baseline.values["kv.key_bits"] == 8
        assert not {"micro_batch", "threads"} & set(status.knobs.knobs)
        config = registry.set_desired("srv", {"kv.key_bits": 16,
                                              "prefix_cache.capacity_entries": 64})
        run_until(session, acked(registry, "srv", config.version))
        (ack,) = acked(registry, "srv", config.version)()
        assert ack.status == "applied"
        assert session.version == config.version
        assert replica.applied[-1]["kv.key_bits"] == 16
        assert replica.applied[-1]["prefix_cache.capacity_entries"] == 64
        assert replica.applied[-1]["kv.value_bits"] == 8  # not named: the baseline's
        assert session.switches[-1][1] == config.version
    finally:
        session.close()


def test_a_refused_config_is_acked_failed_and_actions_are_refused_with_the_reason(
        server: LeaseServer) -> None:
    replica = Replica(refuse_two_bit=True)
    session = attach_serving(job="srv", sidecar=server.url, apply=replica.apply)
    registry = server.registry
    try:
        run_until(session, lambda: any(s.job == "srv" for s in registry.jobs())
                  and session.version == registry.status("srv").desired.version)
        before = session.version
        registry.set_desired("srv", {"kv.key_bits": 2})
        config = registry.push_action("srv", {"kind": "snapshot", "change_id": "c1"})
        run_until(session, acked(registry, "srv", config.version))
        (ack,) = acked(registry, "srv", config.version)()
        assert ack.status == "failed" and "2-bit keys" in (ack.error or "")
        assert [a["status"] for a in ack.actions] == ["failed"]
        assert ack.actions[0]["error"] == NO_STATE
        assert session.version == before
        assert session.values["kv.key_bits"] == 32
    finally:
        session.close()


def test_without_a_sidecar_the_session_keeps_its_defaults() -> None:
    replica = Replica()
    session = attach_serving(job="srv", sidecar=None, apply=replica.apply,
                             defaults={"prefix_cache.policy": "pinned"})
    for _ in range(3):
        assert session.boundary() is False
    assert session.version == 0 and replica.applied == []
    assert session.values["prefix_cache.policy"] == "pinned"
    with pytest.raises(Exception, match="undeclared"):
        attach_serving(job="srv", sidecar=None, apply=replica.apply, defaults={"nope": 1})


def test_the_cache_size_a_search_may_ask_for_fits_in_the_memory_free_now() -> None:
    from tuner.job import available_memory_mib
    session = ServeSession(job="serve", sidecar=None, apply=lambda values: None)
    capacity = session.knobs.knobs["prefix_cache.capacity_mib"]
    assert capacity.high is not None
    assert capacity.high <= max(capacity.default, available_memory_mib() / 2) * 1.01
