"""The demo's `summary.json`: what the run found, tried, kept and rolled back, with where every
number came from. The shape is `demo_summary.schema.json` (package data; docs/demo.md).

Read after the sidecar stopped: the changes, findings and audit log as its API answered last
(``DemoRun.final``), the Optuna study and the spans from the state DB, the series from the
store. Nothing here measures anything itself.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from collectors.names import (
    ATTR_SERVICE_NAME,
    HW_GPU_UTILIZATION,
    SERVE_TOKENS_PER_SECOND,
    TRAIN_LOSS,
    TRAIN_STEP,
    TRAIN_TOKENS_PER_SECOND,
)
from policies.detectors import COLLAPSE, UNDERFLOW
from seedancectl._demo import (
    OBJECTIVE,
    SERVE_JOB,
    SUMMARY_SCHEMA_VERSION,
    TRAIN_JOB,
    DemoRun,
    change_row,
)

INCIDENT_DETECTORS = (UNDERFLOW, COLLAPSE)
"""Detectors whose finding means "this precision change underflows" (the staged incident)."""
TRAIL = ("proposed", "approved", "apply", "ack", ("kept", "rolled_back"))
"""The audit events every applied change must have, in order (a tuple: one of)."""


def _config_key(values: Mapping[str, Any]) -> str:
    return json.dumps(dict(values), sort_keys=True)


def objectives_by_config(changes: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """tokens/s of every measured window, by the config it measured (candidate windows
    measure baseline + values, baseline windows the baseline)."""
    found: dict[str, list[float]] = {}
    for change in changes:
        candidate = {**change["baseline"], **change["values"]}
        for window in change.get("windows", []):
            config = candidate if window["arm"] == "candidate" else change["baseline"]
            value = window.get("tokens_per_s")
            if isinstance(value, int | float) and math.isfinite(value):
                found.setdefault(_config_key(config), []).append(float(value))
    return found


def _mean(values: Sequence[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def objective_summary(changes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The baseline config and the kept one (the last kept change's candidate, else the
    baseline) with their mean measured tokens/s over every window that ran them."""
    if not changes:
        return {"name": OBJECTIVE, "baseline_config": None, "baseline": None,
                "kept_config": None, "kept": None, "kept_change": None}
    measured = objectives_by_config(changes)
    baseline = dict(changes[0]["baseline"])
    kept = [c for c in changes if c["state"] == "kept"]
    kept_config = {**kept[-1]["baseline"], **kept[-1]["values"]} if kept else baseline
    return {"name": OBJECTIVE, "baseline_config": baseline,
            "baseline": _mean(measured.get(_config_key(baseline))),
            "kept_config": kept_config, "kept": _mean(measured.get(_config_key(kept_config))),
            "kept_change": kept[-1]["id"] if kept else None}


def study_trials(state_db_url: str, study_name: str,
                 changes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every trial of the job's Optuna study: config, state, measured objective (tokens/s),
    where it came from, and the change that ran it (None for one answered without running)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=study_name, storage=state_db_url)
    except KeyError:  # the search never started (the job did not attach)
        return []
    by_trial = {(c.get("meta") or {}).get("trial"): c["id"] for c in changes
                if c["source"] == "trial"}
    return [{
        "number": t.number, "state": t.state.name.lower(), "values": dict(t.params),
        "objective": t.value if t.value is not None and math.isfinite(t.value) else None,
        "origin": t.user_attrs.get("seedance:origin"),
        "note": t.user_attrs.get("seedance:fail_reason"),
        "change_id": by_trial.get(t.number),
    } for t in study.get_trials(deepcopy=False)]


def trails(audit: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The audit events of each change, oldest first (kind, actor, versions)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for event in audit:
        if event.get("change_id"):
            out.setdefault(event["change_id"], []).append({
                "kind": event["kind"], "actor": event["actor"], "at_ns": event["at_ns"],
                "version_before": event["version_before"],
                "version_after": event["version_after"]})
    return out


def trail_complete(kinds: Sequence[str]) -> bool:
    """Has the change every event of TRAIL, in that order?"""
    at = 0
    for want in TRAIL:
        options = want if isinstance(want, tuple) else (want,)
        found = next((i for i in range(at, len(kinds)) if kinds[i] in options), None)
        if found is None:
            return False
        at = found + 1
    return True


def span_counts(state_db_url: str, trace_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per trace: spans the sidecar recorded and spans the job sent (``job.apply``)."""
    from sqlalchemy import create_engine, func, select

    from collectors import spans_table

    if not trace_ids:
        return {}
    engine = create_engine(state_db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(spans_table.c.trace_id, spans_table.c.name,
                                       func.count()).where(
                spans_table.c.trace_id.in_(list(trace_ids))).group_by(
                spans_table.c.trace_id, spans_table.c.name)).all()
    finally:
        engine.dispose()
    counts: dict[str, dict[str, int]] = {t: {"sidecar": 0, "job": 0} for t in trace_ids}
    for trace_id, name, n in rows:
        counts[trace_id]["job" if name == "job.apply" else "sidecar"] += int(n)
    return counts


def _series(run: DemoRun) -> dict[str, Any]:
    """Training and serving numbers and the GPU counters' source, from the store."""
    from collectors import REPLAYED_ATTR, TimeSeriesStore

    with TimeSeriesStore(run.store_path, readonly=True) as store:
        def frame(name: str, job: str | None = None) -> Any:
            where = None if job is None else {ATTR_SERVICE_NAME: job}
            return store.query(name, where=where, since_ns=run.started_at_ns, resolution="raw")

        loss = frame(TRAIN_LOSS, TRAIN_JOB)
        steps = frame(TRAIN_STEP, TRAIN_JOB)
        train_tps = frame(TRAIN_TOKENS_PER_SECOND, TRAIN_JOB)
        serve_tps = frame(SERVE_TOKENS_PER_SECOND, SERVE_JOB)
        gpu = frame(HW_GPU_UTILIZATION)
        catalogue = store.metrics()

    def stat(data: Any, how: str) -> float | None:
        return None if data.empty else float(getattr(data["value"], how)())

    finite_loss = loss[loss["value"].map(math.isfinite)] if not loss.empty else loss
    replayed = (not gpu.empty and REPLAYED_ATTR in gpu
                and bool((gpu[REPLAYED_ATTR] == "true").all()))
    trace = run.config.nvml_trace
    return {
        "metrics": {"names": int(len(catalogue)),
                    "points": int(catalogue["points"].sum()) if not catalogue.empty else 0},
        "training": {
            "job": TRAIN_JOB, "steps": stat(steps, "max"),
            "first_loss": None if finite_loss.empty else float(finite_loss["value"].iloc[0]),
            "last_loss": None if finite_loss.empty else float(finite_loss["value"].iloc[-1]),
            "median_tokens_per_s": stat(train_tps, "median"),
            "search_moves_left": run.moves_left},
        "serving": {"job": SERVE_JOB, "replicas": run.config.replicas,
                    "rate_rps": run.config.serve_rate_rps,
                    "median_tokens_per_s": stat(serve_tps, "median"),
                    "launcher": _serve_result(run.logs / "serve.log")},
        "gpu": {"source": f"replayed NVML trace {trace.name}" if trace else "none (NVML off)",
                "trace": None if trace is None else str(trace), "replayed": replayed,
                "utilization_points": int(len(gpu))},
    }


def _serve_result(log: Path) -> dict[str, Any] | None:
    """The serving launcher's own JSON result (requests, lost, p50/p99 latency), the last
    JSON object in its log; None when it did not get that far."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
        body = json.loads(text[text.rindex("\n{") + 1:] if "\n{" in text else text)
    except (OSError, ValueError):
        return None
    keep = ("requests", "lost", "p50_s", "p99_s", "hit_rate")
    return {k: body.get(k) for k in keep if isinstance(body, dict)}


def incident(changes: Sequence[Mapping[str, Any]], findings: Sequence[Mapping[str, Any]],
             change_id: str | None) -> dict[str, Any] | None:
    """The staged fp16 change (``change_id``) once a guardrail rolled it back, with the
    findings of the kind that trip a local rollback; None if it was not rolled back."""
    tripped = [c for c in changes if c["id"] == change_id and c["state"] == "rolled_back"]
    if not tripped:
        return None
    change = tripped[-1]
    plan = change["plan"]
    return {
        "change_id": change["id"], "values": dict(change["values"]),
        "rollback": plan["rollback"], "cause": plan.get("ended_because"),
        "findings": [f["id"] for f in findings if f["detector"] in INCIDENT_DETECTORS
                     and f["job"] == change["job"]],
        "staged": True}


def summarise(run: DemoRun, *, report: Mapping[str, Any] | None) -> dict[str, Any]:
    """The whole summary (see demo_summary.schema.json)."""
    final = run.final
    changes: list[dict[str, Any]] = final.get("changes", [])
    findings: list[dict[str, Any]] = final.get("findings", [])
    by_change = trails(final.get("audit", []))
    rows = [change_row(c) for c in changes]
    trace_ids = [r["traceparent"].split("-")[1] for r in rows if r["traceparent"]]
    spans = span_counts(run.state_db_url, trace_ids)
    for row in rows:
        trace_id = row.pop("traceparent")
        trace_id = trace_id.split("-")[1] if trace_id else None
        kinds = [e["kind"] for e in by_change.get(row["id"], [])]
        row.update(trace_id=trace_id, spans=spans.get(trace_id or "", {"sidecar": 0, "job": 0}),
                   events=by_change.get(row["id"], []), trail_complete=trail_complete(kinds))
    series = _series(run)
    simulated = [{"what": "GPU counters",
                  "how": "replayed from a recorded NVML trace of a real GPU "
                         f"({run.config.nvml_trace.name}); points carry seedance.replayed=true"}
                 ] if run.config.nvml_trace else []
    simulated.append({"what": "the incident",
                      "how": "staged by the demo: a risky precision change (fp16 on one module "
                             "group) whose gradients underflow; detection and rollback are real"})
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "started_at_ns": run.started_at_ns, "finished_at_ns": time.time_ns(),
        "minutes": run.config.minutes, "wall_s": round(run.elapsed_s(), 1),
        "out": str(run.out),
        "sidecar": {"url": run.url, "store": str(run.store_path),
                    "state_db": run.state_db_url},
        "simulated": simulated,
        **series,
        "findings": [{"id": f["id"], "job": f["job"], "detector": f["detector"],
                      "severity": f["severity"], "resource": f["resource"],
                      "summary": f["evidence"]["summary"], "opened_at_ns": f["opened_at_ns"],
                      "closed_at_ns": f["closed_at_ns"]} for f in findings],
        "trials": study_trials(run.state_db_url, run.session.config.study, changes),
        "changes": rows,
        "objective": objective_summary(changes),
        "incident": incident(changes, findings, run.incident_change),
        "report": None if report is None else dict(report),
        "logs": sorted(str(p) for p in run.logs.glob("*.log")),
    }
