"""A bound on active series, so a flood of attribute values cannot take the sidecar's memory
or its store: past ``max_per_metric`` series of one metric from one job, or ``max_per_job``
series of one job (``service.name``), points of new series are dropped and counted, as the
OpenTelemetry SDK does with its own cardinality limit. Series already admitted get through,
and one job's flood never takes another job's room.

Only active series count: one that sent nothing for ``idle_s`` (to twice that) is forgotten
and frees its room, as a series goes stale in Prometheus. Every config version of a tuned job
starts new series, so counting every series ever seen would, after a few hundred trials,
refuse the telemetry the next trial is judged on, and hold memory for each one."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from collectors._errors import ConfigError
from collectors._generations import GenerationalMap
from collectors._points import Point
from collectors.names import ATTR_SERVICE_NAME

JOB_ATTR = ATTR_SERVICE_NAME


@dataclass(frozen=True, slots=True, kw_only=True)
class CardinalityLimit:
    max_per_metric: int = 2000
    max_per_job: int = 20_000
    idle_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_per_metric < 1 or self.max_per_job < 1:
            raise ConfigError("CardinalityLimit: both limits must be >= 1")
        if self.idle_s <= 0:
            raise ConfigError(f"CardinalityLimit: idle_s must be > 0, got {self.idle_s}")


class SeriesLimiter:
    """Admits points of known series and of new ones while under the limits. Thread-safe."""

    def __init__(self, limit: CardinalityLimit | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit or CardinalityLimit()
        self._lock = threading.Lock()
        # series -> (job, metric) it counts against
        self._seen: GenerationalMap[tuple[str, frozenset[tuple[str, str]]], tuple[str, str]] = \
            GenerationalMap(self.limit.idle_s, clock=clock)
        self._per_metric: Counter[tuple[str, str]] = Counter()  # (job, metric)
        self._per_job: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        """Points dropped, by the limit that dropped them ("metric" or "job")."""

    def admit(self, points: Iterable[Point]) -> list[Point]:
        kept: list[Point] = []
        limit = self.limit
        with self._lock:
            self._forget_idle()
            for p in points:
                key = (p.name, frozenset(p.attributes.items()))
                if self._seen.get(key) is None:
                    job = str(p.attributes.get(JOB_ATTR, ""))
                    if self._per_metric[(job, p.name)] >= limit.max_per_metric:
                        self.dropped["metric"] += 1
                        continue
                    if self._per_job[job] >= limit.max_per_job:
                        self.dropped["job"] += 1
                        continue
                    self._seen[key] = (job, p.name)
                    self._per_metric[(job, p.name)] += 1
                    self._per_job[job] += 1
                kept.append(p)
        return kept

    def _forget_idle(self) -> None:
        for job_metric in self._seen.expire().values():
            self._per_metric[job_metric] -= 1
            if not self._per_metric[job_metric]:
                del self._per_metric[job_metric]
            self._per_job[job_metric[0]] -= 1
            if not self._per_job[job_metric[0]]:
                del self._per_job[job_metric[0]]

    def series(self) -> int:
        with self._lock:
            return len(self._seen)
