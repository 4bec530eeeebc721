"""What each config version of a job was, from the rollout journal, and the throughput table
grouped by config (many versions run the same config: every trial window is a new version)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from dashboards.report._values import ConfigRow
from tuner import Change

MAX_CONFIG_ROWS = 8
"""Configs the table lists; the rest are summed into one line."""


def version_configs(changes: Sequence[Change],
                    events: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Config values per version, as the journal recorded them when it issued the version: a
    window's ``apply`` values, a kept change's candidate, a restored baseline, and the baseline
    a proposal names for the version then in force."""
    by_id = {c.id: c for c in changes}
    configs: dict[int, dict[str, Any]] = {}
    applying: dict[str, Any] | None = None
    for e in events:
        change = by_id.get(e["change_id"] or "")
        detail = e["detail"] or {}
        if e["kind"] == "apply":
            applying = detail.get("values")
        elif e["kind"] == "proposed" and e["version_before"] is not None and change:
            configs.setdefault(int(e["version_before"]), dict(change.baseline))
        version = e["version_after"]
        if version is None or int(version) in configs or change is None:
            continue
        if e["kind"] == "desired" and applying is not None:
            configs[int(version)] = dict(applying)
        elif e["kind"] == "baseline":
            kept = {**change.baseline, **change.values}
            configs[int(version)] = kept
            if detail.get("baseline_version") is not None:
                configs.setdefault(int(detail["baseline_version"]), kept)
        elif e["kind"] == "restored":
            configs[int(version)] = dict(change.baseline)
    return configs


def config_rows(by_version: pd.DataFrame, configs: Mapping[int, Mapping[str, Any]],
                start: Mapping[str, Any] | None,
                limit: int = MAX_CONFIG_ROWS) -> tuple[ConfigRow, ...]:
    """Throughput per distinct config (weighted by points), most points first, at most
    ``limit`` rows with the rest in one; each named by what it changes from ``start``."""
    from dashboards.report._words import diff

    groups: dict[str, list[Any]] = {}
    for r in by_version.itertuples():
        config = configs.get(int(r.version))
        if config is None:
            label = "config not in the journal"
        elif start is None:
            label = ", ".join(f"{k}={v}" for k, v in sorted(config.items())) or "defaults"
        else:
            label = diff(start, config)
            label = "starting config" if label == "no change" else label
        groups.setdefault(label, []).append(r)
    base = _mean(groups["starting config"]) if "starting config" in groups else None
    rows = [ConfigRow(config=label, versions=tuple(int(r.version) for r in rs),
                      points=int(sum(r.points for r in rs)), mean=_mean(rs),
                      vs_start=_mean(rs) / base - 1 if base else None)
            for label, rs in groups.items()]
    rows.sort(key=lambda c: (c.config != "starting config", -c.points))
    if len(rows) <= limit:
        return tuple(rows)
    rest = rows[limit - 1:]
    points = sum(r.points for r in rest)
    return (*rows[:limit - 1], ConfigRow(
        config=f"{len(rest)} other configs", versions=tuple(v for r in rest for v in r.versions),
        points=points, mean=_mean(rest), vs_start=None))


def _mean(rows: Sequence[Any]) -> float:
    """Mean tokens/s over rows that each hold a mean and its points."""
    return float(sum(r.mean * r.points for r in rows) / sum(r.points for r in rows))
