"""One change, one trace, end to end: the real sidecar (uvicorn on 127.0.0.1), a real small
torch job attached with tuner.job (its metrics and its job.apply spans exported over OTLP to
the sidecar), an operator proposing and approving over the API; the controller's spans and the
job's are read back from the sidecar's span table."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from collectors._tracing import span_context
from tests.seedancectl._live import Live, live_sidecar
from tuner.job import attach

pytestmark = pytest.mark.integration
FINAL = ("kept", "rolled_back", "failed")
TRIAL_S = 15.0
"""The trial's budget here: this test is about its trace, not its measurement."""


def test_a_change_and_the_jobs_apply_share_one_trace(tmp_path: Path) -> None:
    with live_sidecar(tmp_path, rollout={"trial_budget_s": TRIAL_S,
                                         "max_window_s": 5.0}) as live:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        session = attach(model, optimizer, job="mlp", sidecar=live.url, global_batch=8,
                         export_interval_s=0.1)
        data = torch.Generator().manual_seed(0)
        change_id = None
        # A trial's budget, its last pair and a wide margin: a hang guard, not a timing check.
        deadline = time.monotonic() + TRIAL_S + 180
        try:
            while True:
                assert time.monotonic() < deadline, "the change did not finish"
                x = torch.randn(8, 16, generator=data)
                with session.step(tokens=8 * 16, samples=8):
                    n = session.micro_batches(8)
                    for xs, ys in zip(x.chunk(n), x.sum(1, keepdim=True).chunk(n), strict=True):
                        (nn.functional.mse_loss(model(xs), ys) / n).backward()
                    session.after_backward()
                    optimizer.step()
                    optimizer.zero_grad()
                time.sleep(0.01)
                if change_id is None and session.steps_done >= 3:
                    reply = live.post("/v1/jobs/mlp/changes", {
                        "values": {"micro_batch": 4}, "by": "alice", "reason": "fewer stalls?"})
                    assert reply.status_code == 201, reply.text
                    change_id = reply.json()["id"]
                    reply = live.post(f"/v1/changes/{change_id}/approve",
                                      {"by": "bob", "comment": "try it"})
                    assert reply.status_code == 200, reply.text
                if change_id is not None and live.get(f"/v1/changes/{change_id}")["state"] in \
                        FINAL:
                    break
            # The verdict's config reaches the job too: the journal names its version (the
            # state moves first, so wait for the event), then the job acks it at a boundary.
            while (verdict_version := sent_version(live, change_id)) is None or \
                    live.get("/v1/jobs/mlp/knobs")["acked_version"] < verdict_version:
                assert time.monotonic() < deadline, "the verdict's config never reached the job"
                with session.step(tokens=8 * 16, samples=8):
                    pass
                time.sleep(0.01)
        finally:
            session.close()  # flushes the job's spans to the sidecar
        change = live.sidecar.controller.get(change_id)  # type: ignore[union-attr]
        assert change.state in ("kept", "rolled_back"), change.plan
        root = span_context(change.traceparent)
        spans = live.sidecar.traces.spans_for_change(change.traceparent)
    verdict = "keep" if change.state == "kept" else "rollback"
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert {"change", "propose", "approve", "apply", "observe", verdict, "job.apply"} <= set(
        by_name), sorted(by_name)
    assert {s.trace_id for s in spans} == {f"{root.trace_id:032x}"}
    [top] = by_name["change"]
    assert top.span_id == f"{root.span_id:016x}" and top.parent_span_id == ""
    assert top.service == "test-sidecar"
    sidecar_spans = [s for s in spans if s.service == "test-sidecar"]
    assert all(s.parent_span_id == top.span_id for s in sidecar_spans if s is not top)
    # Every job.apply is a child of what the controller sent: an apply, or the verdict.
    sent = {s.span_id: s for s in by_name["apply"] + by_name[verdict]}
    jobs = by_name["job.apply"]
    assert all(s.service == "mlp" and s.parent_span_id in sent for s in jobs)
    for span in jobs:
        parent = sent[span.parent_span_id]
        if parent.name == "apply":
            assert span.attributes["seedance.config.version"] == \
                parent.attributes["seedance.config.version.after"]
        assert span.attributes["seedance.rank"] == 0 and span.attributes["seedance.step"] >= 3
        assert span.start_ns >= parent.start_ns
    assert len(jobs) == len(by_name["apply"]) + 1  # every window, then the verdict's config
    assert by_name["approve"][0].attributes["seedance.actor"] == "bob"


def sent_version(live: Live, change_id: str) -> int | None:
    """The config version the change's verdict sent the job; None until it is journaled."""
    events = live.get("/v1/audit", change=change_id)
    return next((e["version_after"] for e in events if e["kind"] in ("baseline", "restored")),
                None)
