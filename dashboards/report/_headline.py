"""A job's result in a few plain sentences, the first thing the report shows: what was kept and
what it earned, what was rolled back and why, incidents, and what the job ran at what price."""

from __future__ import annotations

from collections.abc import Sequence

from dashboards.report._values import ChangeRow, FindingRow, Savings
from dashboards.report._words import diff, money, num, pct


def _effect(row: ChangeRow) -> str:
    if row.gain is None:
        return "not measured"
    interval = ("" if row.ci_low is None or row.ci_high is None or row.confidence is None else
                f" ({row.confidence:.0%} interval {pct(row.ci_low)} to {pct(row.ci_high)})")
    return f"throughput {pct(row.gain)}{interval}"


def _rolled_back(row: ChangeRow) -> str:
    person = row.rolled_back_by not in (None, "controller")
    by = f" by {row.rolled_back_by}" if person else ""
    measured = f" (it had measured {_effect(row)})" if person and row.gain is not None else ""
    return f"Rolled back {diff(row.baseline, row.values)}{by}: {row.rollback_cause}{measured}."


def _incidents(findings: Sequence[FindingRow]) -> str:
    opened = [f for f in findings if f.opened_in_range]
    if not findings:
        return "No incidents."
    worst = max(findings, key=lambda f: ("info", "warning", "critical").index(f.severity)
                if f.severity in ("info", "warning", "critical") else -1)
    still = sum(f.closed_at_ns is None for f in findings)
    return (f"Incidents: {len(opened)} opened in the range, {still} still open; the worst: "
            f"{worst.severity}, {worst.summary}.")


def headline(changes: Sequence[ChangeRow], savings: Sequence[Savings],
             findings: Sequence[FindingRow], gpu_hours: float, price: float,
             currency: str) -> tuple[str, ...]:
    """The sentences, in the order a reader asks: what it earned, what went wrong, cost."""
    saved = {s.change_id: s for s in savings}
    lines = []
    for row in changes:
        if row.kept_at_ns is None or row.rolled_back_at_ns is not None:
            continue
        s = saved.get(row.id)
        earned = ("" if s is None else
                  f"; saved {num(s.gpu_hours_saved)} GPU-hours "
                  f"({money(s.cost_saved, currency)}) since")
        lines.append(f"Kept {diff(row.baseline, row.values)}: {_effect(row)}{earned}.")
    lines += [_rolled_back(r) for r in changes if r.rolled_back_at_ns is not None]
    waiting = [r for r in changes if r.state == "proposed"]
    if waiting:
        lines.append(f"Waiting for approval: "
                     f"{'; '.join(diff(r.baseline, r.values) for r in waiting)}.")
    if not any(r.applied_at_ns is not None for r in changes):
        lines.append("No change was tried on the job.")
    lines.append(_incidents(findings))
    trials = sum(r.candidate_gpu_hours for r in changes)
    lines.append(f"Ran {num(gpu_hours)} GPU-hours ({money(gpu_hours * price, currency)} at "
                 f"{money(price, currency)} per GPU-hour); trying changes took {num(trials)} "
                 f"of them.")
    return tuple(lines)
