"""Gathering a report: what the store, the findings store and the rollout journal hold.

Nothing here re-derives what another package computes: the measured effect of a change and its
confidence interval are the rollout controller's own (``Change.comparison``), p99s come from
``policies``' ``histogram_quantile`` per export interval, counter increases from ``policies``'
reset-aware helper, and the payback estimate from the ROI cost models. What is new is the
bookkeeping of a week: which states were entered, how long decisions took, and the GPU-hours a
kept change saved (formula in :func:`_savings`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from collectors import (
    CONFIG_VERSION_ATTR,
    REPLAYED_ATTR,
    Resolution,
    SeedanceError,
    StoreReader,
)
from policies import FindingStore, equivalent_scale_out_nodes, payback_months
from policies.detectors import interval_increases, p99_per_interval
from tuner import Change, ChangeJournal

JOB_ATTR = "service.name"
HOST_ATTR = "host.name"
RANK_ATTR = "seedance.rank"
HOURS_PER_MONTH = 730.0
"""Hours in an average month (8,760 / 12): a GPU's monthly cost is price x 730."""
_NS = 1_000_000_000
_VALUE_COLUMNS = ("time", "value", "min", "max", "count", "last")
MAX_INTERVALS = 1500
"""Histogram intervals per series a plot gets at most (a week of minutes is 10,080)."""
HUMAN_EXCLUDED = frozenset({"auto", "mode:off", "controller", "recovery", "job"})
"""Actors that are not people: their decisions do not count as time to a human decision."""


class ReportError(SeedanceError):
    """A report cannot be built as asked (bad range, unreadable source)."""


# ---- values ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FindingRow:
    """One finding of the job that was open at some time in the range."""

    id: str
    detector: str
    severity: str
    resource: Mapping[str, str]
    opened_at_ns: int
    closed_at_ns: int | None
    open_s: float
    """Closed: closed - opened. Still open: the range's end - opened."""
    summary: str
    opened_in_range: bool
    closed_in_range: bool


@dataclass(frozen=True, kw_only=True)
class ChangeRow:
    """One change of the job with a journal event in the range, as the journal tells it."""

    id: str
    state: str
    source: str
    reason: str
    values: Mapping[str, Any]
    risk: str
    scope: str
    proposed_at_ns: int
    decided_at_ns: int | None
    decided_by: str | None
    decision: str | None
    decision_s: float | None
    """Proposal to a person's approve/reject (None when no person decided)."""
    applied_at_ns: int | None
    kept_at_ns: int | None
    rolled_back_at_ns: int | None
    rollback_cause: str | None
    rollback_kind: str | None
    rolled_back_by: str | None
    gain: float | None
    ci_low: float | None
    ci_high: float | None
    confidence: float | None
    pairs: int | None
    candidate_gpu_hours: float
    """GPU-hours the change's candidate windows ran (the price of trying it)."""
    states_entered: tuple[str, ...]
    """States this change entered inside the range, in order."""


@dataclass(frozen=True, kw_only=True)
class Savings:
    """GPU-hours and money one kept change saved in the range (see :func:`_savings`)."""

    change_id: str
    gain: float
    ci_low: float
    ci_high: float
    gpus: int
    hours_after: float
    gpu_hours_after: float
    gpu_hours_saved: float
    gpu_hours_saved_low: float
    gpu_hours_saved_high: float
    cost_saved: float
    cost_saved_low: float
    cost_saved_high: float
    nodes_saved: float
    nodes_saved_low: float
    nodes_saved_high: float


@dataclass(frozen=True, kw_only=True)
class Payback:
    """The ROI model's payback of the week's tuning for one job."""

    fix_cost: float
    gpu_months_saved: float
    gpu_months_saved_low: float
    gpu_months_saved_high: float
    node_cost_per_month: float
    months: float
    months_best: float
    months_worst: float


@dataclass(frozen=True, kw_only=True)
class Panel:
    """One plotted quantity: ``frame`` has time (UTC), value and series (a label per line)."""

    key: str
    title: str
    unit: str
    metrics: tuple[str, ...]
    frame: pd.DataFrame
    replayed: bool


@dataclass(frozen=True, kw_only=True)
class Marker:
    """A vertical line on every plot: a change applied, kept or rolled back."""

    at_ns: int
    kind: Literal["apply", "kept", "rolled_back"]
    change_id: str


@dataclass(frozen=True, kw_only=True)
class JobReport:
    job: str
    kind: str
    findings: tuple[FindingRow, ...]
    changes: tuple[ChangeRow, ...]
    state_counts: Mapping[str, int]
    """Changes that entered each state inside the range (journal events)."""
    panels: tuple[Panel, ...]
    markers: tuple[Marker, ...]
    throughput_by_version: pd.DataFrame
    """version, mean (tokens/s, weighted by points), points: the throughput panel's metric."""
    gpus: int
    savings: tuple[Savings, ...]
    payback: Payback | None


@dataclass(frozen=True, kw_only=True)
class ReportData:
    since_ns: int
    until_ns: int
    source: str
    price_per_gpu_hour: float
    jobs: tuple[JobReport, ...]
    replayed_panels: tuple[str, ...] = field(default=())
    """``job/panel`` keys whose points carry seedance.replayed=true."""


# ---- panels ---------------------------------------------------------------------------------


def _attr_columns(frame: pd.DataFrame, drop: Sequence[str] = ()) -> list[str]:
    return [c for c in frame.columns if c not in _VALUE_COLUMNS and c not in drop]


def _cumulative(frame: pd.DataFrame) -> pd.DataFrame:
    """A cumulative series' value per row: the bucket's last value for rollups."""
    return frame.assign(value=frame["last"]) if "last" in frame.columns else frame


_SHORT = {HOST_ATTR: "host", "gpu.index": "gpu", RANK_ATTR: "rank", "seedance.kv.part": "part"}


def _label(frame: pd.DataFrame, keys: Sequence[str]) -> pd.Series:
    """One legend label per series ("rank=0 gpu=1"), built once per distinct attribute set."""
    present = [k for k in keys if k in frame.columns]
    if not present:
        return pd.Series(["all"] * len(frame), index=frame.index, dtype="str")
    codes, uniques = pd.MultiIndex.from_frame(frame[present].astype(str)).factorize()
    names = [" ".join(f"{_SHORT.get(k, k.rsplit('.', 1)[-1])}={v}"
                      for k, v in zip(present, u, strict=True)) for u in uniques]
    return pd.Series(np.asarray(names, dtype=object)[codes], index=frame.index, dtype="str")


def _lines(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    if frame.empty:
        return pd.DataFrame({"time": frame["time"], "value": frame["value"],
                             "series": pd.Series([], dtype="str")})
    return pd.DataFrame({"time": frame["time"], "value": frame["value"].astype(float),
                         "series": _label(frame, keys)}).reset_index(drop=True)


def _per_group(frame: pd.DataFrame, ignore: Sequence[str],
               fn: Callable[[pd.DataFrame], pd.DataFrame]) -> pd.DataFrame:
    """Apply ``fn`` to each series group (attributes but ``ignore``) and stack the results."""
    if frame.empty:
        return pd.DataFrame({"time": frame["time"], "value": frame["value"]})
    keys = _attr_columns(frame, ignore)
    groups = frame.groupby(keys, dropna=False, sort=False) if keys else [((), frame)]
    parts = [fn(g.sort_values("time")) for _, g in groups]
    parts = [p for p in parts if not p.empty]
    if not parts:
        return pd.DataFrame({"time": frame["time"].iloc[0:0], "value": np.empty(0)})
    return pd.concat(parts, ignore_index=True).sort_values("time", kind="stable")


def _thin(frame: pd.DataFrame, max_times: int) -> pd.DataFrame:
    """Keep every k-th timestamp of a cumulative series so at most ``max_times`` remain: the
    increases between kept points are exact over k times longer intervals."""
    times = frame["time"].unique()
    if len(times) <= max_times:
        return frame
    step = -(-len(times) // max_times)
    return frame[frame["time"].isin(times[::step])]


def _p99(frame: pd.DataFrame) -> pd.DataFrame:
    """p99 per export interval (per rollup bucket; fewer, longer intervals past
    ``MAX_INTERVALS``) of each cumulative histogram series."""
    def one(group: pd.DataFrame) -> pd.DataFrame:
        thin = _thin(_cumulative(group), MAX_INTERVALS)
        series = p99_per_interval(thin[["time", "value", "le"]])
        return pd.DataFrame({"time": pd.to_datetime(series.index, utc=True),
                             "value": series.to_numpy(dtype=np.float64)})
    return _per_group(frame, ("le",), one)


def _ratio_of_increases(num: pd.DataFrame, den: pd.DataFrame) -> pd.DataFrame:
    """Per interval: increase of ``num`` / increase of ``den`` (cumulative series, same attrs)."""
    if num.empty or den.empty:
        return pd.DataFrame({"time": pd.Series([], dtype="datetime64[ns, UTC]"),
                             "value": np.empty(0)})
    keys = [k for k in _attr_columns(num) if k in den.columns]

    def deltas(frame: pd.DataFrame) -> pd.DataFrame:
        out = _per_group(frame, (), lambda g: interval_increases(
            _cumulative(g)[["time", "value"]]).rename(columns={"delta": "value"}).assign(
            **{k: g[k].iloc[0] for k in keys}))
        return out
    merged = pd.merge(deltas(num), deltas(den), on=["time", *keys], suffixes=("_n", "_d"))
    merged = merged[merged["value_d"] > 0]
    return pd.DataFrame({"time": merged["time"],
                         "value": merged["value_n"] / merged["value_d"]}).reset_index(drop=True)


@dataclass(frozen=True, kw_only=True)
class _PanelSpec:
    key: str
    title: str
    unit: str
    metrics: tuple[str, ...]
    host_level: bool = False
    line_keys: tuple[str, ...] = (RANK_ATTR,)


PANELS: tuple[_PanelSpec, ...] = (
    _PanelSpec(key="throughput", title="Throughput", unit="tokens/s",
               metrics=("seedance.train.tokens_per_second", "seedance.serve.tokens_per_second")),
    _PanelSpec(key="p99_latency", title="p99 latency (step / request)", unit="s",
               metrics=("seedance.train.step.duration.bucket",
                        "gen_ai.server.request.duration.bucket")),
    _PanelSpec(key="gpu_utilization", title="GPU utilisation", unit="fraction",
               metrics=("hw.gpu.utilization",), host_level=True,
               line_keys=(HOST_ATTR, "gpu.index")),
    _PanelSpec(key="memory_bandwidth", title="Memory-bandwidth utilisation", unit="fraction",
               metrics=("hw.gpu.memory.utilization", "seedance.gpu.dram.active"),
               host_level=True, line_keys=(HOST_ATTR, "gpu.index")),
    _PanelSpec(key="comm_share", title="Communication share of step time", unit="fraction",
               metrics=("seedance.comm.allreduce.duration.sum",
                        "seedance.train.step.duration.sum")),
    _PanelSpec(key="grad_norm", title="Gradient norm", unit="1",
               metrics=("seedance.train.grad.norm",)),
    _PanelSpec(key="kv_bits", title="KV-cache bits", unit="bit",
               metrics=("seedance.serve.kv_cache.bits",),
               line_keys=(RANK_ATTR, "seedance.kv.part")),
    _PanelSpec(key="cache_hit_rate", title="Prefix-cache hit rate", unit="fraction",
               metrics=("seedance.serve.prefix_cache.hits", "seedance.serve.prefix_cache.queries",
                        "seedance.serve.prefix_cache.hit_ratio")),
)


class _Reader:
    """Reads one job's series from the source over the range."""

    def __init__(self, source: StoreReader, job: str, since_ns: int, until_ns: int,
                 resolution: Resolution) -> None:
        self.source, self.job = source, job
        self.since_ns, self.until_ns, self.resolution = since_ns, until_ns, resolution
        self.hosts: list[str] | None = None

    def job_series(self, name: str) -> pd.DataFrame:
        return self.source.query(name, where={JOB_ATTR: self.job}, since_ns=self.since_ns,
                                 until_ns=self.until_ns, resolution=self.resolution)

    def host_series(self, name: str) -> pd.DataFrame:
        """A host-level series (GPUs) on the hosts the job's points name (all if none do)."""
        if not self.hosts:
            return self.source.query(name, since_ns=self.since_ns, until_ns=self.until_ns,
                                     resolution=self.resolution)
        frames = [self.source.query(name, where={HOST_ATTR: h}, since_ns=self.since_ns,
                                    until_ns=self.until_ns, resolution=self.resolution)
                  for h in self.hosts]
        return pd.concat(frames, ignore_index=True).sort_values("time", kind="stable")

    def panel(self, spec: _PanelSpec) -> Panel:
        read = self.host_series if spec.host_level else self.job_series
        frames = {name: read(name) for name in spec.metrics}
        if spec.key == "p99_latency":
            parts = [_p99(f).assign(of=name.split(".")[1])
                     for name, f in frames.items() if not f.empty]
            lines = (pd.concat([_lines(p, ("of",)) for p in parts], ignore_index=True)
                     if parts else _lines(next(iter(frames.values())), ()))
        elif spec.key == "comm_share":
            lines = _lines(_ratio_of_increases(*frames.values()), ())
        elif spec.key == "cache_hit_rate":
            hits, queries, ratio = frames.values()
            lines = _lines(_ratio_of_increases(hits, queries), ())
            if lines.empty:
                lines = _lines(ratio, ("gen_ai.request.model",))
        else:
            lines = pd.concat([_lines(f, spec.line_keys) for f in frames.values()],
                              ignore_index=True)
        replayed = not lines.empty and any(
            REPLAYED_ATTR in f.columns and (f[REPLAYED_ATTR] == "true").any()
            for f in frames.values())
        return Panel(key=spec.key, title=spec.title, unit=spec.unit, metrics=spec.metrics,
                     frame=lines, replayed=replayed)


def _weighted_by_version(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean of a gauge per config version, weighted by points (exact from rollups too)."""
    if frame.empty or CONFIG_VERSION_ATTR not in frame.columns:
        return pd.DataFrame({"version": pd.Series([], dtype="int64"),
                             "mean": np.empty(0), "points": pd.Series([], dtype="int64")})
    count = frame["count"] if "count" in frame.columns else pd.Series(1, index=frame.index)
    table = pd.DataFrame({"version": pd.to_numeric(frame[CONFIG_VERSION_ATTR]).astype("int64"),
                          "sum": frame["value"] * count, "points": count.astype("int64")})
    out = table.groupby("version", as_index=False)[["sum", "points"]].sum()
    out["mean"] = out["sum"] / out["points"]
    return out[["version", "mean", "points"]]


def _active_hours(frame: pd.DataFrame, start_ns: int, end_ns: int) -> float:
    """Hours in [start, end) with at least one throughput point, counted in whole minutes."""
    if frame.empty or end_ns <= start_ns:
        return 0.0
    t = pd.DatetimeIndex(frame["time"]).asi8
    t = t[(t >= start_ns // (60 * _NS) * 60 * _NS) & (t < end_ns)]
    return float(np.unique(t // (60 * _NS)).size) / 60.0


# ---- journal --------------------------------------------------------------------------------


def _read_journal(state_db_url: str) -> tuple[list[Change], list[dict[str, Any]]]:
    """Every change and audit event, read-only (a journal opened without creating anything)."""
    journal = ChangeJournal(state_db_url, create=False)
    try:
        return journal.changes(), journal.events()
    finally:
        journal.close()


def _change_row(change: Change, events: list[dict[str, Any]], since_ns: int, until_ns: int,
                gpus: int) -> ChangeRow:
    def first(pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((e for e in events if pred(e)), None)

    decision = first(lambda e: e["to_state"] in ("approved", "rejected"))
    human = decision is not None and decision["actor"] not in HUMAN_EXCLUDED
    proposed_ns = int(change.created_at_s * _NS)
    applied = first(lambda e: e["kind"] == "apply")
    kept = first(lambda e: e["to_state"] == "kept")
    rolled = first(lambda e: e["to_state"] == "rolled_back")
    comparison = change.comparison or {}

    def number(key: str) -> float | None:
        value = comparison.get(key)
        return None if value is None or not math.isfinite(float(value)) else float(value)

    candidate_s = sum((w.end_ns - w.start_ns) / _NS for w in change.windows
                      if w.arm == "candidate")
    return ChangeRow(
        id=change.id, state=change.state, source=change.source, reason=change.reason,
        values=dict(change.values), risk=change.risk, scope=change.scope,
        proposed_at_ns=proposed_ns,
        decided_at_ns=None if decision is None else int(decision["at_ns"]),
        decided_by=None if decision is None else decision["actor"],
        decision=None if decision is None else decision["to_state"],
        decision_s=(int(decision["at_ns"]) - proposed_ns) / _NS if human and decision else None,
        applied_at_ns=None if applied is None else int(applied["at_ns"]),
        kept_at_ns=None if kept is None else int(kept["at_ns"]),
        rolled_back_at_ns=None if rolled is None else int(rolled["at_ns"]),
        rollback_cause=None if rolled is None else rolled["reason"],
        rollback_kind=None if rolled is None else change.plan.get("rollback"),
        rolled_back_by=None if rolled is None else rolled["actor"],
        gain=number("gain"), ci_low=number("ci_low"), ci_high=number("ci_high"),
        confidence=number("confidence"),
        pairs=None if comparison.get("pairs") is None else int(comparison["pairs"]),
        candidate_gpu_hours=candidate_s / 3600 * gpus,
        states_entered=tuple(e["to_state"] for e in events
                             if e["to_state"] and since_ns <= e["at_ns"] <= until_ns))


def _savings(row: ChangeRow, throughput: pd.DataFrame, until_ns: int, gpus: int,
             price_per_gpu_hour: float) -> Savings | None:
    """GPU-hours a kept change saved from its keep to the range's end (or its rollback).

    A throughput gain g (0.10 = +10%) means the work done in H GPU-hours after the change would
    have taken H (1 + g) GPU-hours before it: the change saved H g GPU-hours. H counts GPUs
    (one per rank) x the minutes the job reported throughput after the keep. The controller's
    interval [low, high] for g is linear in the saving, so it maps to [H low, H high]. Nodes
    saved use the ROI model's ``equivalent_scale_out_nodes`` (gamma < 1: scale-out adds
    communication, so the equivalent extra capacity is larger than H g).
    """
    if row.kept_at_ns is None or row.gain is None or row.ci_low is None or row.ci_high is None:
        return None
    end = until_ns if row.rolled_back_at_ns is None else min(until_ns, row.rolled_back_at_ns)
    hours = _active_hours(throughput, row.kept_at_ns, end)
    gpu_hours = hours * gpus
    saved = [gpu_hours * g for g in (row.gain, row.ci_low, row.ci_high)]
    nodes = [equivalent_scale_out_nodes(gpus, g) if g > -1 else -float(gpus)
             for g in (row.gain, row.ci_low, row.ci_high)]
    return Savings(change_id=row.id, gain=row.gain, ci_low=row.ci_low, ci_high=row.ci_high,
                   gpus=gpus, hours_after=hours, gpu_hours_after=gpu_hours,
                   gpu_hours_saved=saved[0], gpu_hours_saved_low=saved[1],
                   gpu_hours_saved_high=saved[2],
                   cost_saved=saved[0] * price_per_gpu_hour,
                   cost_saved_low=saved[1] * price_per_gpu_hour,
                   cost_saved_high=saved[2] * price_per_gpu_hour,
                   nodes_saved=nodes[0], nodes_saved_low=nodes[1], nodes_saved_high=nodes[2])


def _payback(rows: Sequence[ChangeRow], savings: Sequence[Savings],
             price_per_gpu_hour: float) -> Payback | None:
    """``payback_months`` of the week's tuning: its cost is every candidate window's GPU-hours
    at the price (counted whole, although the job did useful work in them); its saving the
    nodes the still-kept changes are worth (``equivalent_scale_out_nodes``) at price x 730 h."""
    if not savings:
        return None
    by_id = {r.id: r for r in rows}
    live = [s for s in savings if by_id[s.change_id].rolled_back_at_ns is None]
    fix_cost = sum(r.candidate_gpu_hours for r in rows) * price_per_gpu_hour
    node_cost = price_per_gpu_hour * HOURS_PER_MONTH
    nodes = [sum(getattr(s, f) for s in live)
             for f in ("nodes_saved", "nodes_saved_low", "nodes_saved_high")]
    months = [payback_months(fix_cost, n, node_cost) for n in nodes]
    return Payback(fix_cost=fix_cost, gpu_months_saved=nodes[0], gpu_months_saved_low=nodes[1],
                   gpu_months_saved_high=nodes[2], node_cost_per_month=node_cost,
                   months=months[0], months_best=months[2], months_worst=months[1])


MarkerKind = Literal["apply", "kept", "rolled_back"]


def _marker_times(row: ChangeRow) -> tuple[tuple[MarkerKind, int | None], ...]:
    return (("apply", row.applied_at_ns), ("kept", row.kept_at_ns),
            ("rolled_back", row.rolled_back_at_ns))


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
           resolution: Resolution = "auto") -> ReportData:
    """Everything the report shows for [since_ns, until_ns], one :class:`JobReport` per job."""
    if since_ns >= until_ns:
        raise ReportError(f"the range is empty: since {since_ns} >= until {until_ns}")
    if not price_per_gpu_hour > 0:
        raise ReportError(f"price_per_gpu_hour must be > 0, got {price_per_gpu_hour}")
    changes, events = _read_journal(state_db_url)
    with FindingStore(state_db_url) as findings_db:
        all_findings = [f for f in findings_db.history(job=job)
                        if f.opened_at_ns is not None and f.opened_at_ns <= until_ns
                        and (f.closed_at_ns is None or f.closed_at_ns >= since_ns)]
    jobs = [job] if job is not None else _jobs_in(
        source, changes, [f.job for f in all_findings], since_ns, until_ns)
    reports = []
    for name in jobs:
        reader = _Reader(source, name, since_ns, until_ns, resolution)
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
        rows = [_change_row(c, by_change.get(c.id, []), since_ns, until_ns, gpus)
                for c in changes if c.job == name and any(
                    since_ns <= e["at_ns"] <= until_ns for e in by_change.get(c.id, []))]
        counts = {s: sum(s in r.states_entered for r in rows)
                  for s in ("proposed", "approved", "rejected", "kept", "rolled_back",
                            "expired", "failed")}
        savings = [s for s in (_savings(r, throughput, until_ns, gpus, price_per_gpu_hour)
                               for r in rows) if s is not None]
        markers = sorted(
            (Marker(at_ns=at, kind=what, change_id=r.id) for r in rows
             for what, at in _marker_times(r)
             if at is not None and since_ns <= at <= until_ns), key=lambda m: m.at_ns)
        finding_rows = tuple(
            FindingRow(id=f.id, detector=f.detector, severity=f.severity,
                       resource=dict(f.resource), opened_at_ns=int(f.opened_at_ns or 0),
                       closed_at_ns=f.closed_at_ns,
                       open_s=((f.closed_at_ns or until_ns) - int(f.opened_at_ns or 0)) / _NS,
                       summary=f.evidence.summary,
                       opened_in_range=since_ns <= int(f.opened_at_ns or 0) <= until_ns,
                       closed_in_range=f.closed_at_ns is not None
                       and since_ns <= f.closed_at_ns <= until_ns)
            for f in all_findings if f.job == name)
        panels = tuple(reader.panel(spec) for spec in PANELS)
        reports.append(JobReport(
            job=name, kind=kind, findings=finding_rows, changes=tuple(rows),
            state_counts=counts, panels=panels, markers=tuple(markers),
            throughput_by_version=_weighted_by_version(throughput), gpus=gpus,
            savings=tuple(savings), payback=_payback(rows, savings, price_per_gpu_hour)))
    replayed = tuple(f"{r.job}/{p.key}" for r in reports for p in r.panels if p.replayed)
    return ReportData(since_ns=since_ns, until_ns=until_ns, source=source_name,
                      price_per_gpu_hour=price_per_gpu_hour, jobs=tuple(reports),
                      replayed_panels=replayed)
