"""Parse the times users type: `10m`, `2h`, `7d`, or an ISO-8601 instant."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from collectors import SeedanceError

_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")


class TimeParseError(SeedanceError):
    """A time or duration the user typed could not be read."""


def parse_duration_s(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise TimeParseError(f"{text!r} is not a duration like 30s, 10m, 2h, 7d")
    return float(match.group(1)) * _UNITS_S[match.group(2)]


def parse_instant_ns(text: str, *, now_ns: int | None = None) -> int:
    """A duration means that long before now; anything else must be ISO-8601 (UTC if naive)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    if _DURATION.match(text.strip()):
        return now_ns - int(parse_duration_s(text) * 1e9)
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise TimeParseError(
            f"{text!r} is neither a duration (10m) nor an ISO time (2026-11-30T12:00)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1e9)


_ISO_WEEK = re.compile(r"^(\d{4})-W(\d{2})$")


def parse_iso_week(text: str) -> tuple[int, int]:
    """``2026-W47`` -> [Monday 00:00 UTC, next Monday 00:00 UTC) in ns."""
    match = _ISO_WEEK.match(text.strip())
    try:
        if not match:
            raise ValueError
        monday = datetime.fromisocalendar(int(match.group(1)), int(match.group(2)), 1)
    except ValueError:
        raise TimeParseError(f"{text!r} is not an ISO week like 2026-W47") from None
    since_ns = int(monday.replace(tzinfo=UTC).timestamp()) * 1_000_000_000
    return since_ns, since_ns + 7 * 86_400 * 1_000_000_000
