"""The report's view of the rollout journal: one row per change with its time to a human
decision, and the GPU-hours a kept change saved (formula in :func:`savings_of`) with its payback."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import pandas as pd

from dashboards.report._panels import active_hours
from dashboards.report._values import (
    HOURS_PER_MONTH,
    HUMAN_EXCLUDED,
    NS,
    ChangeRow,
    Payback,
    Savings,
)
from policies import equivalent_scale_out_nodes, payback_months
from tuner import Change, ChangeJournal

# ---- journal --------------------------------------------------------------------------------


def read_journal(state_db_url: str) -> tuple[list[Change], list[dict[str, Any]]]:
    """Every change and audit event, read-only (a journal opened without creating anything)."""
    journal = ChangeJournal(state_db_url, create=False)
    try:
        return journal.changes(), journal.events()
    finally:
        journal.close()


def change_row(change: Change, events: list[dict[str, Any]], since_ns: int, until_ns: int,
                gpus: int) -> ChangeRow:
    def first(pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((e for e in events if pred(e)), None)

    decision = first(lambda e: e["to_state"] in ("approved", "rejected"))
    human = decision is not None and decision["actor"] not in HUMAN_EXCLUDED
    proposed_ns = int(change.created_at_s * NS)
    applied = first(lambda e: e["kind"] == "apply")
    kept = first(lambda e: e["to_state"] == "kept")
    rolled = first(lambda e: e["to_state"] == "rolled_back")
    comparison = change.comparison or {}

    def number(key: str) -> float | None:
        value = comparison.get(key)
        return None if value is None or not math.isfinite(float(value)) else float(value)

    candidate_s = sum((w.end_ns - w.start_ns) / NS for w in change.windows
                      if w.arm == "candidate")
    return ChangeRow(
        id=change.id, state=change.state, source=change.source, reason=change.reason,
        values=dict(change.values), baseline=dict(change.baseline),
        risk=change.risk, scope=change.scope,
        proposed_at_ns=proposed_ns,
        decided_at_ns=None if decision is None else int(decision["at_ns"]),
        decided_by=None if decision is None else decision["actor"],
        decision=None if decision is None else decision["to_state"],
        decision_s=(int(decision["at_ns"]) - proposed_ns) / NS if human and decision else None,
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


def savings_of(row: ChangeRow, throughput: pd.DataFrame, until_ns: int, gpus: int,
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
    hours = active_hours(throughput, row.kept_at_ns, end)
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


def payback_of(rows: Sequence[ChangeRow], savings: Sequence[Savings],
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


def marker_times(row: ChangeRow) -> tuple[tuple[MarkerKind, int | None], ...]:
    return (("apply", row.applied_at_ns), ("kept", row.kept_at_ns),
            ("rolled_back", row.rolled_back_at_ns))


