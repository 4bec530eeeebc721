"""Small PromQL and panel helpers over grafana-foundation-sdk, the names coming from _names.

A :class:`Scope` is one dashboard's template filter (catalogue attribute -> variable): every
selector it writes filters on those variables, with label names taken from the sidecar's
translation, so a filter on an attribute a metric lacks fails generation. :data:`JOB` stands
for whichever attribute names a metric's job, so one ``$job`` filters every panel.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gs
from grafana_foundation_sdk.builders import timeseries as gt
from grafana_foundation_sdk.builders.common import (
    ReduceDataOptions,
    VizLegendOptions,
    VizTooltipOptions,
)
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

from collectors import ConfigError, PromMetric, prom_metric
from collectors.names import ATTR_SEEDANCE_JOB, ATTR_SERVICE_NAME

DATASOURCE_VAR = "datasource"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")
"""Every panel and target names the data source through the ``datasource`` variable."""
JOB = "(job)"
"""The attribute that names a metric's job: ``seedance.job`` on the series the sidecar emits
about a job (its own ``service.name`` is the sidecar's), else ``service.name`` (the job's)."""
RATE_WINDOW = "$__rate_interval"
RANGE_WINDOW = "$__range"
WIDTH = 24


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    """One PromQL target and its legend."""

    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Scope:
    """The template variables a dashboard filters every series on: attribute -> variable."""

    filters: tuple[tuple[str, str], ...]

    def series(self, metric: PromMetric, name: str, *extra: str) -> str:
        """``name{label=~"$var",...}`` for this scope's filters plus ``extra`` matchers."""
        matchers = [f'{metric.label(_attribute(metric, attr))}=~"${var}"'
                    for attr, var in self.filters]
        return f"{name}{{{', '.join([*matchers, *extra])}}}"

    def gauge(self, name: str, *extra: str) -> str:
        metric = prom_metric(name)
        return self.series(metric, metric.gauge, *extra)

    def rate(self, name: str, window: str = RATE_WINDOW) -> str:
        """Per-second rate of a counter."""
        metric = prom_metric(name)
        return f"rate({self.series(metric, metric.total)}[{window}])"

    def increase(self, name: str, window: str = RANGE_WINDOW) -> str:
        """Increase of a counter over ``window`` (default: the dashboard's time range)."""
        metric = prom_metric(name)
        return f"increase({self.series(metric, metric.total)}[{window}])"

    def seconds_per_second(self, name: str) -> str:
        """Rate of a histogram's ``_sum``: for a duration, the share of wall time it took."""
        metric = prom_metric(name)
        return f"rate({self.series(metric, metric.sum)}[{RATE_WINDOW}])"

    def quantile(self, q: float, name: str, by: Sequence[str]) -> str:
        """``histogram_quantile`` over the rate of the buckets, kept apart by attributes ``by``."""
        metric = prom_metric(name)
        labels = ", ".join(["le", *labels_of(name, by)])
        return (f"histogram_quantile({q:g}, sum by ({labels}) "
                f"(rate({self.series(metric, metric.bucket)}[{RATE_WINDOW}])))")


def _attribute(metric: PromMetric, attribute: str) -> str:
    """``attribute``, with :data:`JOB` resolved for ``metric``."""
    if attribute != JOB:
        return attribute
    return ATTR_SEEDANCE_JOB if ATTR_SEEDANCE_JOB in metric.spec.attributes else ATTR_SERVICE_NAME


def labels_of(name: str, attributes: Sequence[str]) -> list[str]:
    """Label names of ``attributes`` of catalogue metric ``name``."""
    metric = prom_metric(name)
    return [metric.label(_attribute(metric, attr)) for attr in attributes]


def by(name: str, attributes: Sequence[str], agg: str, expr: str) -> str:
    """``agg by (labels) (expr)`` with the labels of ``attributes`` of metric ``name``."""
    return f"{agg} by ({', '.join(labels_of(name, attributes))}) ({expr})"


def legend(name: str, *parts: str) -> str:
    """A legend template; a part that is a catalogue attribute of ``name`` becomes its label."""
    metric = prom_metric(name)
    resolved = [_attribute(metric, p) for p in parts]
    return " ".join(f"{{{{{metric.label(p)}}}}}" if p in metric.spec.attributes else p
                    for p in resolved)


@dataclass(frozen=True, slots=True, kw_only=True)
class PanelSpec:
    """One panel: what it shows and how wide it is (grid units of 24)."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: Literal["timeseries", "stat"] = "timeseries"
    span: int = 12
    height: int = 8

    def __post_init__(self) -> None:
        if not 1 <= len(self.queries) <= len(string.ascii_uppercase):
            raise ConfigError(f"panel {self.title!r}: queries must hold 1..26 queries, "
                             f"got {len(self.queries)}")
        if not 1 <= self.span <= WIDTH:
            raise ConfigError(f"panel {self.title!r}: span must be 1..{WIDTH}, got {self.span}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Variable:
    """A query variable: ``label_values(<series>, <label>)``."""

    name: str
    label: str
    query: str
    multi: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Annotation:
    """A Prometheus annotation: a marker wherever ``expr`` has a sample."""

    name: str
    expr: str
    color: str


@dataclass(slots=True, kw_only=True)
class DashboardSpec:
    """One dashboard: identity, variables and rows of panels."""

    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: list[tuple[str, list[PanelSpec]]] = field(default_factory=list)
    annotations: tuple[Annotation, ...] = ()

    def build(self) -> model.Dashboard:
        board = (gd.Dashboard(self.title).uid(self.uid).description(self.description)
                 .tags(["seedance"]).editable().time("now-1h", "now").refresh("30s")
                 .tooltip(model.DashboardCursorSync.CROSSHAIR)
                 .with_variable(gd.DatasourceVariable(DATASOURCE_VAR).label("Data source")
                                .type("prometheus")))
        for var in self.variables:
            board = board.with_variable(
                gd.QueryVariable(var.name).label(var.label).query(var.query)
                .datasource(DATASOURCE).refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(model.VariableSort.ALPHABETICAL_ASC).multi(var.multi)
                .include_all(var.multi))
        for note in self.annotations:
            board = board.annotation(gd.AnnotationQuery().name(note.name).datasource(DATASOURCE)
                                     .enable(True).icon_color(note.color).expr(note.expr))
        panel_id = 0
        for title, panels in self.rows:
            panel_id += 1
            board = board.with_row(gd.Row(title).id(panel_id))
            for spec in panels:
                panel_id += 1
                board = board.with_panel(_panel(spec, panel_id))
        return board.build()


def _panel(spec: PanelSpec, panel_id: int) -> gt.Panel | gs.Panel:
    builder: gt.Panel | gs.Panel = (
        gt.Panel()
        .legend(VizLegendOptions().show_legend(True).placement(common.LegendPlacement.BOTTOM)
                .display_mode(common.LegendDisplayMode.LIST))
        .tooltip(VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                 .sort(common.SortOrder.DESCENDING))
        if spec.kind == "timeseries" else
        gs.Panel().reduce_options(ReduceDataOptions().calcs(["lastNotNull"])))
    builder = (builder.id(panel_id).title(spec.title).description(spec.description)
               .unit(spec.unit).span(spec.span).height(spec.height).datasource(DATASOURCE))
    for ref, query in zip(string.ascii_uppercase, spec.queries, strict=False):
        builder = builder.with_target(gp.Dataquery().expr(query.expr)
                                      .legend_format(query.legend).ref_id(ref)
                                      .datasource(DATASOURCE).range())
    return builder
