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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from collectors._errors import ConfigError
from collectors._generations import GenerationalMap
from collectors._otlp_decode import DecodedMetrics
from collectors._points import Point
from collectors.names import ATTR_SERVICE_NAME

JOB_ATTR = ATTR_SERVICE_NAME
_Key = tuple[str, frozenset[tuple[str, str]]]
"""A series: its metric name and attribute set."""
_SHAPE_KEY = "cardinality.keys"
_SHAPE_ADMITTED = "cardinality.admitted"


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
        self._seen: GenerationalMap[_Key, tuple[str, str]] = \
            GenerationalMap(self.limit.idle_s, clock=clock)
        self._per_metric: Counter[tuple[str, str]] = Counter()  # (job, metric)
        self._per_job: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        """Points dropped, by the limit that dropped them ("metric" or "job")."""
        self._token = object()
        """Marks the shapes this limiter admitted whole (a shape may meet several limiters)."""

    def admit(self, points: Iterable[Point]) -> list[Point]:
        """The points of series within the limits (every other one dropped and counted)."""
        listed = list(points)
        dropped, _ = self._dropped([(p.name, frozenset(p.attributes.items())) for p in listed],
                                   lambda i: listed[i].attributes)
        if not dropped:
            return listed
        out = set(dropped)
        return [p for i, p in enumerate(listed) if i not in out]

    def admit_decoded(self, decoded: DecodedMetrics) -> DecodedMetrics:
        """:meth:`admit` for a decoded request: itself when every point gets through. The
        series keys of a shape are built once per shape."""
        shape = decoded.shape
        if shape is None:
            admitted = self.admit(decoded.points)
            return decoded if len(admitted) == len(decoded) else \
                DecodedMetrics(points=admitted, metrics=decoded.metrics)
        if shape.derived.get(_SHAPE_ADMITTED) == (self._token, self._seen.generation):
            # all its keys are in the current generation: nothing to look up, but other
            # series may be due to go. A rotation now leaves them in the previous generation,
            # from where the next repeat's lookup brings them back.
            with self._lock:
                self._forget_idle()
            return decoded
        keys = shape.derived.get(_SHAPE_KEY)
        if keys is None:
            keys = shape.derived[_SHAPE_KEY] = [
                (name, frozenset(attributes.items()))
                for name, attributes in zip(shape.names, shape.attributes, strict=True)]
        dropped, generation = self._dropped(keys, shape.attributes.__getitem__)  # type: ignore[arg-type]
        if not dropped:
            # every key was read or written in this generation, so until the next rotation
            # they are all present and a repeat of the shape has nothing to look up
            shape.derived[_SHAPE_ADMITTED] = (self._token, generation)
            return decoded
        out = set(dropped)
        return DecodedMetrics(points=[p for i, p in enumerate(decoded.points) if i not in out],
                              metrics=decoded.metrics)

    def _dropped(self, keys: Sequence[_Key], attributes: Callable[[int], Mapping[str, str]]
                 ) -> tuple[list[int], int]:
        """Admit the series ``keys`` (``attributes(i)``: those of the i-th point, read only
        for a new series); the indices of those over a limit, and the generation of the
        series map they were admitted in."""
        dropped: list[int] = []
        limit = self.limit
        seen = self._seen
        with self._lock:
            self._forget_idle()
            for i, key in enumerate(keys):
                if seen.get(key) is None:
                    name = key[0]
                    job = str(attributes(i).get(JOB_ATTR, ""))
                    if self._per_metric[(job, name)] >= limit.max_per_metric:
                        self.dropped["metric"] += 1
                        dropped.append(i)
                        continue
                    if self._per_job[job] >= limit.max_per_job:
                        self.dropped["job"] += 1
                        dropped.append(i)
                        continue
                    seen[key] = (job, name)
                    self._per_metric[(job, name)] += 1
                    self._per_job[job] += 1
            return dropped, seen.generation

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
