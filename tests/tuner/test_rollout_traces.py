"""Every change is one trace: the real controller, a real registry and state DB, a SIMULATED
job (tests/tuner/_simjob.py); spans caught by an in-memory exporter on a real TracerProvider."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from collectors._otel import TelemetryConfig
from collectors._store import TimeSeriesStore
from collectors._tracing import Tracing, setup_tracing, span_context
from policies._state_db import sqlite_url
from tests.tuner._simjob import SimJob
from tests.tuner.test_rollout import CONFIG, Clock, drive, fast_micro_batch
from tuner._change import Change
from tuner._lease import JobRegistry
from tuner._rollout import RolloutController


class Spans:
    """One process's tracing with an in-memory exporter."""

    def __init__(self, job: str = "sidecar") -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing: Tracing = setup_tracing(TelemetryConfig(job=job), exporters=[self.exporter])

    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all() if s.name == name]


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[dict[str, Any]]:
    clock = Clock()
    registry = JobRegistry(lease_ttl_s=30.0, clock=clock)
    store = TimeSeriesStore(tmp_path / "metrics.db")
    yield {"clock": clock, "registry": registry, "store": store,
           "url": sqlite_url(tmp_path / "state.db")}
    store.close()


def controller(parts: dict[str, Any], spans: Spans) -> RolloutController:
    return RolloutController(parts["registry"], parts["store"], db_url=parts["url"],
                             clock=parts["clock"], config=CONFIG, tracing=spans.tracing)


def hexid(value: int, width: int) -> str:
    return f"{value:0{width}x}"


def assert_one_trace(change: Change, spans: list[ReadableSpan]) -> None:
    """Every span in the change's trace; every non-root a child of the root."""
    root = span_context(change.traceparent)
    assert {s.context.trace_id for s in spans} == {root.trace_id}
    for span in spans:
        if span.name == "change":
            assert span.parent is None and span.context.span_id == root.span_id
        else:
            assert span.parent is not None and span.parent.span_id == root.span_id, span.name
        assert span.attributes is not None
        assert span.attributes["seedance.change.id"] == change.id


def test_a_kept_change_is_one_trace_from_proposal_to_verdict(parts: dict[str, Any]) -> None:
    spans = Spans()
    registry = parts["registry"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts, spans)
    ctl.set_mode(job.job, "auto", by="alice")
    sent: list[str | None] = []
    original = registry.set_desired

    def spy(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs.get("traceparent"))
        return original(*args, **kwargs)

    registry.set_desired = spy  # type: ignore[method-assign]
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="trial 3", source="trial",
                         meta={"trial": 3, "finding": "f-1"})
    done = drive(ctl, job, change.id)
    assert done.state == "kept"
    got = spans.all()
    assert_one_trace(done, got)
    names = sorted(s.name for s in got)
    assert names == sorted(["change", "propose", "approve", "keep"] + ["apply", "observe"] * 6)
    root = spans.named("change")[0]
    assert root.attributes is not None
    assert root.attributes["seedance.change.state"] == "kept"
    assert root.attributes["seedance.change.knobs"] == "micro_batch: 8 -> 4"
    assert root.attributes["seedance.finding.id"] == "f-1"
    assert root.attributes["seedance.change.source"] == "trial"
    approve = spans.named("approve")[0].attributes
    assert approve is not None and approve["seedance.approve.auto"] is True
    keep = spans.named("keep")[0].attributes
    assert keep is not None and keep["seedance.gain.ci_low"] == done.comparison["ci_low"]
    observes = sorted(spans.named("observe"), key=lambda s: s.start_time or 0)
    assert [o.attributes["seedance.window.arm"] for o in observes  # type: ignore[index]
            ] == [w.arm for w in done.windows]
    # What the job was sent is the span it joins: each apply's own id, then the keep's.
    applies = sorted(spans.named("apply"), key=lambda s: s.start_time or 0)
    ids = [hexid(s.context.span_id, 16) for s in [*applies, spans.named("keep")[0]]]
    assert [tp.split("-")[2] if tp else None for tp in sent] == ids
    versions = [a.attributes["seedance.config.version.after"] for a in applies]  # type: ignore[index]
    assert versions == [w.version for w in done.windows]
    assert done.spans == {}  # nothing left open


def test_a_restarted_controller_continues_the_same_trace(parts: dict[str, Any]) -> None:
    """Controller A proposes; B (a new process: its own provider) approves and keeps."""
    first, second = Spans(), Spans()
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    a = controller(parts, first)
    change = a.propose(job.job, {"micro_batch": 4}, reason="faster?", source="operator")
    a.close()
    b = controller(parts, second)
    b.approve(change.id, "bob", "go")
    done = drive(b, job, change.id)
    assert done.state == "kept"
    assert [s.name for s in first.all()] == ["propose"]
    assert_one_trace(done, first.all() + second.all())
    assert len(second.named("change")) == 1
    approve = second.named("approve")[0].attributes
    assert approve is not None and approve["seedance.actor"] == "bob"


def test_a_change_in_flight_at_a_restart_ends_its_trace_with_the_rollback(
        parts: dict[str, Any]) -> None:
    first, second = Spans(), Spans()
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    a = controller(parts, first)
    change = a.propose(job.job, {"micro_batch": 4}, reason="faster?", source="operator")
    a.approve(change.id, "alice")
    a.tick()  # sends window 0
    job.run(3)  # too few steps to end the window
    a.tick()  # acked: observing, the observe span is open (journaled only)
    assert a.get(change.id).state == "observing"
    assert set(a.get(change.id).spans) == {"observe"}
    a.close()
    parts["clock"].now += 5.0
    b = controller(parts, second)
    b.recover()  # rolls it back
    done = b.get(change.id)
    assert done.state == "rolled_back"
    assert sorted(s.name for s in second.all()) == ["change", "observe", "rollback"]
    assert_one_trace(done, first.all() + second.all())
    observe = second.named("observe")[0]
    assert observe.status.status_code is StatusCode.ERROR
    # started by A (from the journal), ended by B
    assert (observe.end_time or 0) - (observe.start_time or 0) == 5 * 10**9
    rollback = second.named("rollback")[0].attributes
    assert rollback is not None
    assert rollback["seedance.rollback.scope"] == "config"
    assert "restarted" in str(rollback["seedance.rollback.cause"])


def test_a_lapsed_lease_fails_the_trace(parts: dict[str, Any]) -> None:
    spans = Spans()
    registry, clock = parts["registry"], parts["clock"]
    job = SimJob(registry, parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts, spans)
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="x", source="operator")
    ctl.approve(change.id, "alice")
    ctl.tick()
    clock.now += 60
    assert registry.reap() == [job.job]
    done = ctl.get(change.id)
    assert done.state == "failed"
    assert_one_trace(done, spans.all())
    failed = {s.name: s.status.status_code for s in spans.all()}
    assert failed["fail"] is StatusCode.ERROR and failed["change"] is StatusCode.ERROR
    assert failed["apply"] is StatusCode.ERROR  # never acked


def test_a_rejected_proposal_is_a_short_trace(parts: dict[str, Any]) -> None:
    spans = Spans()
    job = SimJob(parts["registry"], parts["store"], step_s=fast_micro_batch)
    ctl = controller(parts, spans)
    change = ctl.propose(job.job, {"micro_batch": 4}, reason="x", source="operator")
    done = ctl.reject(change.id, "carol", "not during the demo")
    assert_one_trace(done, spans.all())
    assert sorted(s.name for s in spans.all()) == ["change", "propose", "reject"]
    reject = spans.named("reject")[0].attributes
    assert reject is not None and reject["seedance.reason"] == "not during the demo"
