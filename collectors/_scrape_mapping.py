"""Prometheus text exposition -> Points, through the exporters' rule tables (pure).

Users who already run dcgm-exporter or vLLM should not need a second agent on the GPU: the
sidecar reads their ``/metrics`` and files the numbers under the project's names (units, labels,
throttle bitmasks, counters and histograms converted), so policies read one vocabulary whether
a number came from NVML, a job or a scrape. :func:`map_exposition` is the pure entry the tests
drive.

docs/internals.md, 'Scraped Prometheus metrics' gives the mapping rules.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from collectors._catalogue import BY_NAME
from collectors._errors import SeedanceError
from collectors._points import MetricKind, Point
from collectors._scrape_rules import EXPORTERS, SOURCE_ATTR, Exporter, SeriesRule

log = logging.getLogger(__name__)


class ScrapeError(SeedanceError):
    """A scrape failed: the endpoint did not answer in time, or answered with no exposition."""


_GENERIC = Exporter("prometheus", "prometheus", "", {}, ())
_SCALAR_TYPES = frozenset({"gauge", "counter", "unknown", "untyped"})


def map_exposition(
    text: str,
    *,
    time_ns: int,
    kind: str = "auto",
    attributes: Mapping[str, str] | None = None,
) -> list[Point]:
    """Parse Prometheus text exposition and map it to Points (see the module docstring).

    ``kind`` picks the rule table ("dcgm", "vllm"), or "auto" recognises the exporter from
    its families' prefixes. ``attributes`` are added to every point (a clash: the label wins).
    Raises :class:`ScrapeError` when the text is not a valid exposition.
    """
    if kind != "auto" and kind not in EXPORTERS:
        raise ValueError(f"kind: expected 'auto' or one of {sorted(EXPORTERS)}, got {kind!r}")
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError, KeyError) as e:
        raise ScrapeError(f"not a Prometheus text exposition: {e}") from e
    if kind == "auto":
        candidates = list(EXPORTERS.values())
        default = next(  # for families with no exporter prefix (process_*, python_gc_*)
            (e for e in candidates if any(f.name.startswith(e.prefix) for f in families)),
            _GENERIC,
        )
    else:
        candidates = [EXPORTERS[kind]]
        default = EXPORTERS[kind]
    winners = _winning_rules(families, candidates)
    created = _created_families(families)
    extra = dict(attributes or {})
    points: list[Point] = []
    try:
        for family in families:
            if family.name in created:
                continue
            exporter = next((e for e in candidates if family.name.startswith(e.prefix)), default)
            base = {**extra, SOURCE_ATTR: exporter.source}
            rule = winners.get(family.name)
            if rule is not None and not _fits(rule, family):
                log.warning("scrape: %s has TYPE %s, %s expects %s; kept unmapped",
                            family.name, family.type, rule.name, BY_NAME[rule.name].kind.value)
                rule = None
            points.extend(_family_points(family, rule, exporter.labels, base, time_ns))
    except ValueError as e:  # an unparseable ``le`` or ``quantile`` label
        raise ScrapeError(f"not a Prometheus text exposition: {e}") from e
    return points


def _winning_rules(families: list[Metric], exporters: list[Exporter]) -> dict[str, SeriesRule]:
    present = {family.name for family in families}
    winners: dict[str, SeriesRule] = {}
    for exporter in exporters:
        taken: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for rule in exporter.rules:
            if rule.series in present and rule.key not in taken:
                winners[rule.series] = rule
                taken.add(rule.key)
    return winners


def _created_families(families: list[Metric]) -> set[str]:
    """``X_created`` families that only timestamp a counter, histogram or summary ``X``."""
    cumulative = {f.name for f in families if f.type in ("counter", "histogram", "summary")}
    return {
        f.name for f in families
        if f.name.endswith("_created") and f.name.removesuffix("_created") in cumulative
    }


def _fits(rule: SeriesRule, family: Metric) -> bool:
    if BY_NAME[rule.name].kind is MetricKind.HISTOGRAM:
        return family.type == "histogram"
    return family.type in _SCALAR_TYPES


def _family_points(
    family: Metric,
    rule: SeriesRule | None,
    labels: Mapping[str, str],
    base: Mapping[str, str],
    time_ns: int,
) -> Iterator[Point]:
    name = family.name if rule is None else rule.name
    constant = {} if rule is None else dict(rule.attributes)
    scale = 1.0 if rule is None else rule.scale
    for sample in family.samples:
        attrs = {**base, **constant}
        for label, label_value in sample.labels.items():
            attrs[labels.get(label, label)] = label_value
        if family.type in ("histogram", "summary"):
            series, value = _histogram_part(family, sample, name, attrs)
        else:
            series, value = name, float(sample.value) * scale
        t_ns = time_ns if sample.timestamp is None else _ms_to_ns(float(sample.timestamp))
        if rule is not None and rule.bits:
            yield from _bit_points(series, value, rule, attrs, t_ns)
        else:
            yield Point(series, float(value), t_ns, attrs)


def _ms_to_ns(timestamp_s: float) -> int:
    """Exposition timestamps are whole milliseconds; the parser hands them over as float s."""
    return round(timestamp_s * 1000) * 1_000_000


def _histogram_part(
    family: Metric, sample: Sample, name: str, attrs: dict[str, str]
) -> tuple[str, float]:
    suffix = sample.name[len(family.name):]
    if suffix == "_bucket":
        attrs["le"] = floatToGoString(float(sample.labels["le"]))
        return f"{name}.bucket", sample.value
    if suffix in ("_count", "_sum"):
        return f"{name}.{suffix[1:]}", sample.value
    if "quantile" in sample.labels:
        attrs["quantile"] = floatToGoString(float(sample.labels["quantile"]))
    return name, sample.value


def _bit_points(
    name: str, value: float, rule: SeriesRule, attrs: Mapping[str, str], time_ns: int
) -> Iterable[Point]:
    mask = int(value)
    for bit in (1 << i for i in range(mask.bit_length())):
        if mask & bit:
            reason = rule.bits.get(bit, f"bit_{bit:#x}")
            yield Point(name, 1.0, time_ns, {**attrs, rule.bit_attribute: reason})
