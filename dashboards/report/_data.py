"""Gathering a report: what the store, the findings store and the rollout journal hold.

Nothing here re-derives what another package computes: the measured effect of a change and its
confidence interval are the rollout controller's own (``Change.comparison``), p99s come from
``policies``' ``histogram_quantile`` per export interval, counter increases from ``policies``'
reset-aware helper, and the payback estimate from the ROI cost models. What is new is the
bookkeeping of a week: which states were entered, how long decisions took, and the GPU-hours a
kept change saved (formula in :func:`savings_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from collectors import (
    Resolution,
    StoreReader,
)
from dashboards.report._change_rows import (
    change_row,
    marker_times,
    payback_of,
    read_journal,
    savings_of,
)
from dashboards.report._configs import config_rows, version_configs
from dashboards.report._headline import headline
from dashboards.report._panels import (
    PANELS,
    PanelReader,
    active_hours,
    has_data,
    weighted_by_version,
)
from dashboards.report._values import (
    HOST_ATTR,
    JOB_ATTR,
    NS,
    RANK_ATTR,
    FindingRow,
    JobReport,
    Marker,
    ReportData,
    ReportError,
)
from policies import FindingStore
from tuner import Change

# ---- the whole report -----------------------------------------------------------------------


def _jobs_in(source: StoreReader, changes: Sequence[Change], finding_jobs: Sequence[str],
             since_ns: int, until_ns: int) -> list[str]:
    jobs = {c.job for c in changes} | set(finding_jobs)
    for name in PANELS[0].metrics:
        frame = source.query(name, since_ns=since_ns, until_ns=until_ns, resolution="1h")
        if JOB_ATTR in frame.columns:
            jobs |= set(frame[JOB_ATTR].dropna().astype(str))
    return sorted(jobs)


def gather(*, source: StoreReader, source_name: str, state_db_url: str, since_ns: int,
           until_ns: int, job: str | None = None, price_per_gpu_hour: float,
           currency: str = "USD", resolution: Resolution = "auto") -> ReportData:
    """Everything the report shows for [since_ns, until_ns], one :class:`JobReport` per job:
    the ones with results first, quiet ones (nothing measured, changed or found) last."""
    if since_ns >= until_ns:
        raise ReportError(f"the range is empty: since {since_ns} >= until {until_ns}")
    if not price_per_gpu_hour > 0:
        raise ReportError(f"price_per_gpu_hour must be > 0, got {price_per_gpu_hour}")
    changes, events = read_journal(state_db_url)
    with FindingStore(state_db_url) as findings_db:
        all_findings = [f for f in findings_db.history(job=job)
                        if f.opened_at_ns is not None and f.opened_at_ns <= until_ns
                        and (f.closed_at_ns is None or f.closed_at_ns >= since_ns)]
    jobs = [job] if job is not None else _jobs_in(
        source, changes, [f.job for f in all_findings], since_ns, until_ns)
    reports = []
    for name in jobs:
        reader = PanelReader(source, name, since_ns, until_ns, resolution)
        train, serve = (reader.job_series(m) for m in PANELS[0].metrics)
        kind = "serve" if train.empty and not serve.empty else "train"
        throughput = pd.concat([train, serve], ignore_index=True)
        if HOST_ATTR in throughput.columns:
            reader.hosts = sorted(set(throughput[HOST_ATTR].dropna().astype(str)))
        gpus = (max(1, throughput[RANK_ATTR].nunique()) if RANK_ATTR in throughput.columns
                else 1)
        by_change: dict[str, list[dict[str, Any]]] = {}
        for e in events:
            if e["job"] == name and e["change_id"]:
                by_change.setdefault(e["change_id"], []).append(e)
        rows = [change_row(c, by_change.get(c.id, []), since_ns, until_ns, gpus)
                for c in changes if c.job == name and any(
                    since_ns <= e["at_ns"] <= until_ns for e in by_change.get(c.id, []))]
        counts = {s: sum(s in r.states_entered for r in rows)
                  for s in ("proposed", "approved", "rejected", "kept", "rolled_back",
                            "expired", "failed")}
        savings = [s for s in (savings_of(r, throughput, until_ns, gpus, price_per_gpu_hour)
                               for r in rows) if s is not None]
        markers = sorted(
            (Marker(at_ns=at, kind=what, change_id=r.id) for r in rows
             for what, at in marker_times(r)
             if at is not None and since_ns <= at <= until_ns), key=lambda m: m.at_ns)
        finding_rows = tuple(
            FindingRow(id=f.id, detector=f.detector, severity=f.severity,
                       resource=dict(f.resource), opened_at_ns=int(f.opened_at_ns or 0),
                       closed_at_ns=f.closed_at_ns,
                       open_s=((f.closed_at_ns or until_ns) - int(f.opened_at_ns or 0)) / NS,
                       summary=f.evidence.summary,
                       opened_in_range=since_ns <= int(f.opened_at_ns or 0) <= until_ns,
                       closed_in_range=f.closed_at_ns is not None
                       and since_ns <= f.closed_at_ns <= until_ns)
            for f in all_findings if f.job == name)
        panels = tuple(p for p in (reader.panel(spec) for spec in PANELS if kind in spec.kinds)
                       if has_data(p))
        job_changes = [c for c in changes if c.job == name]
        by_version = weighted_by_version(throughput)
        start = min(job_changes, key=lambda c: c.created_at_s).baseline if job_changes else None
        gpu_hours = active_hours(throughput, since_ns, until_ns) * gpus
        reports.append(JobReport(
            job=name, kind=kind, findings=finding_rows, changes=tuple(rows),
            state_counts=counts, panels=panels, markers=tuple(markers),
            throughput_by_version=by_version,
            by_config=config_rows(by_version, version_configs(
                job_changes, [e for e in events if e["job"] == name]), start),
            gpus=gpus, gpu_hours=gpu_hours, savings=tuple(savings),
            payback=payback_of(rows, savings, price_per_gpu_hour),
            headline=headline(rows, savings, finding_rows, gpu_hours, price_per_gpu_hour,
                              currency)))
    reports.sort(key=lambda r: (r.quiet, not r.changes, not r.findings, r.job))
    replayed = tuple(f"{r.job}/{p.key}" for r in reports for p in r.panels if p.replayed)
    return ReportData(since_ns=since_ns, until_ns=until_ns, source=source_name,
                      price_per_gpu_hour=price_per_gpu_hour, currency=currency,
                      jobs=tuple(reports), replayed_panels=replayed)
