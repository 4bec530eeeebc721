"""Numbers and configs as a person reads them: percentages, money with its currency, spans of
time in a fitting unit, and a config as what changed from another."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd


def when(ns: int | None) -> str:
    return "-" if ns is None else pd.Timestamp(ns, unit="ns", tz="UTC").strftime(
        "%Y-%m-%d %H:%M")


def duration(seconds: float | None) -> str:
    """A span in the unit that keeps it short: minutes, hours, days, months, years."""
    if seconds is None or not math.isfinite(seconds):
        return "-" if seconds is None or math.isnan(seconds) else "never"
    for unit, size in (("years", 365.25 * 86_400), ("months", 30.44 * 86_400),
                       ("days", 86_400.0), ("h", 3600.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return "under a minute"


def pct(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:+.1%}"


def num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "never"
    return f"{value:.{digits}g}"


def money(value: float, currency: str) -> str:
    return f"{value:,.2f} {currency}"


def values(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(config.items()))


def diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """What ``after`` changes from ``before``: "micro_batch 8 → 4, prefetch 2 → 6"."""
    moved = [f"{k} {before.get(k, '-')} → {v}" for k, v in sorted(after.items())
             if before.get(k) != v]
    return ", ".join(moved) or "no change"
