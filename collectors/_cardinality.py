"""A bound on distinct series, so a flood of attribute values cannot take the sidecar's memory
or its store: past ``max_per_metric`` series of one metric from one job, or ``max_per_job``
series of one job (``service.name``), points of new series are dropped and counted, as the
OpenTelemetry SDK does with its own cardinality limit. Series already admitted always get
through, and one job's flood never takes another job's room."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from collectors._errors import ConfigError
from collectors._points import Point
from collectors.names import ATTR_SERVICE_NAME

JOB_ATTR = ATTR_SERVICE_NAME


@dataclass(frozen=True, slots=True, kw_only=True)
class CardinalityLimit:
    max_per_metric: int = 2000
    max_per_job: int = 20_000

    def __post_init__(self) -> None:
        if self.max_per_metric < 1 or self.max_per_job < 1:
            raise ConfigError("CardinalityLimit: both limits must be >= 1")


class SeriesLimiter:
    """Admits points of known series and of new ones while under the limits. Thread-safe."""

    def __init__(self, limit: CardinalityLimit | None = None) -> None:
        self.limit = limit or CardinalityLimit()
        self._lock = threading.Lock()
        self._seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
        self._per_metric: Counter[tuple[str, str]] = Counter()  # (job, metric)
        self._per_job: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        """Points dropped, by the limit that dropped them ("metric" or "job")."""

    def admit(self, points: Iterable[Point]) -> list[Point]:
        kept: list[Point] = []
        limit = self.limit
        with self._lock:
            for p in points:
                key = (p.name, frozenset(p.attributes.items()))
                if key not in self._seen:
                    job = str(p.attributes.get(JOB_ATTR, ""))
                    if self._per_metric[(job, p.name)] >= limit.max_per_metric:
                        self.dropped["metric"] += 1
                        continue
                    if self._per_job[job] >= limit.max_per_job:
                        self.dropped["job"] += 1
                        continue
                    self._seen.add(key)
                    self._per_metric[(job, p.name)] += 1
                    self._per_job[job] += 1
                kept.append(p)
        return kept

    def series(self) -> int:
        with self._lock:
            return len(self._seen)
