"""Commands that work on local files: the sidecar itself, configuration, the store, findings,
ROI, dashboards, the report and the demo."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.markup import escape
from rich.table import Table

from seedancectl._config import load_config
from seedancectl._timeparse import parse_instant_ns
from seedancectl.cli._app import (
    ConfigOption,
    JsonFlag,
    StateDbOption,
    StoreOption,
    UsageError,
    app,
    config_app,
    dashboards_app,
    db_app,
    err,
    folding_table,
    metrics_app,
    print_json,
    stdout,
    when,
    whole,
)

if TYPE_CHECKING:
    from collectors import Resolution


@app.command()
def sidecar(
    config: ConfigOption = None,
    job: Annotated[str | None, typer.Option(help="Job name (service.name).")] = None,
    listen: Annotated[
        str | None, typer.Option(help="HOST:PORT for the API and OTLP receiver.")
    ] = None,
    store: StoreOption = None,
    state_db: Annotated[str | None, typer.Option(
        "--state-db", help="State database URL (default: state.db next to the store).")] = None,
    upstream: Annotated[
        str | None, typer.Option("--upstream", help="Upstream OTLP/HTTP endpoint to forward to.")
    ] = None,
    prometheus_port: Annotated[
        int | None, typer.Option(help="Also serve /metrics on 127.0.0.1:PORT.")
    ] = None,
    nvml: Annotated[
        str | None, typer.Option(help="auto | off | replay:TRACE (replayed data is labelled).")
    ] = None,
) -> None:
    """Run the agent: OTLP receiver, NVML sampler, store, API on loopback."""
    settings = load_config(config, overrides={
        "job": job, "listen": listen, "store": store, "state_db": state_db,
        "upstream_otlp_endpoint": upstream,
        "prometheus_port": prometheus_port, "nvml": nvml,
    })
    from seedancectl._preflight import preflight
    from seedancectl._sidecar import Sidecar, run_sidecar

    preflight(settings)  # unwritable paths, missing token files: one line, before the banner
    built = Sidecar(settings)  # a bad trace or scrape URL fails here, before the banner
    err.print(f"[bold]seedance sidecar[/] job={settings.job} listening on "
              f"http://{settings.listen} store={settings.store}", soft_wrap=True)
    run_sidecar(built)


@config_app.command("check")
def config_check(path: Annotated[Path, typer.Argument(help="TOML file to check.")]) -> None:
    """Validate a configuration file (and what the sidecar checks before it starts: writable
    paths, token files) and print the effective settings."""
    from seedancectl._preflight import preflight

    settings = load_config(path)
    preflight(settings)
    stdout.print(f"[green]ok[/] {escape(str(path))}", soft_wrap=True)
    print_json(settings.model_dump(mode="json"))


def store_path(config: Path | None, store: Path | None) -> Path:
    """``--store``, else the configuration's, else the default."""
    return load_config(config, overrides={"store": store}).store


def _open_store(path: Path) -> Any:
    from collectors import TimeSeriesStore

    if not path.exists():
        raise UsageError(f"{path}: no store here (start `seedancectl sidecar --store {path}`)")
    if path.is_dir():
        raise UsageError(f"--store {path}: a folder; give the store file in it "
                         f"(e.g. {path / 'metrics.db'})")
    return TimeSeriesStore(path, readonly=True)


@metrics_app.command("list")
def metrics_list(
    store: StoreOption = None, config: ConfigOption = None, json_out: JsonFlag = False
) -> None:
    """Every metric name in the store, with its series and point counts."""
    with _open_store(store_path(config, store)) as ts:
        frame = ts.metrics()
    if json_out:
        print_json(frame.to_dict(orient="records"))
        return
    table = folding_table("name", "series", "points", "first", "last")
    for row in frame.itertuples(index=False):
        table.add_row(str(row.name), str(row.series), str(row.points),
                      _short_time(row.first), _short_time(row.last))
    stdout.print(table)


def _short_time(value: Any) -> str:
    """Timestamps to the second, UTC: the table is for eyes, --json keeps full precision."""
    import pandas as pd

    return "-" if pd.isna(value) else pd.Timestamp(value).strftime("%Y-%m-%d %H:%M:%S")


def _parse_where(items: list[str]) -> dict[str, str]:
    where = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--where {item!r}: expected KEY=VALUE")
        where[key] = value
    return where


@metrics_app.command("query")
def metrics_query(
    name: Annotated[str, typer.Argument(help="Metric name, e.g. seedance.train.loss.")],
    since: Annotated[str, typer.Option(help="Start: a duration ago (10m) or ISO time.")] = "1h",
    until: Annotated[str | None, typer.Option(help="End: duration ago or ISO time.")] = None,
    where: Annotated[
        list[str] | None, typer.Option(help="Attribute filter KEY=VALUE (repeatable).")
    ] = None,
    resolution: Annotated[str, typer.Option(help="auto | raw | 1m | 1h")] = "auto",
    limit: Annotated[int, typer.Option(help="Rows to print in the table view.")] = 20,
    store: StoreOption = None,
    config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Points of one metric, filtered by attributes and time range; an OTel histogram's
    count, sum and buckets."""
    from seedancectl._metric_query import query_metric

    if resolution not in ("auto", "raw", "1m", "1h"):
        raise UsageError(f"--resolution {resolution!r}: expected auto, raw, 1m or 1h")
    filters = _parse_where(where or [])
    since_ns = parse_instant_ns(since)
    until_ns = parse_instant_ns(until) if until else None
    path = store_path(config, store)
    with _open_store(path) as ts:
        found = query_metric(ts, name, where=filters, where_from=str(path), since_ns=since_ns,
                             until_ns=until_ns, resolution=cast("Resolution", resolution))
    frame = found.frame
    if json_out:
        records = frame.assign(time=frame["time"].astype(str)).to_dict(orient="records")
        print_json({"name": name, "kind": "histogram" if found.histogram else "points",
                    "points": records})
        return
    if frame.empty:
        stdout.print(f"no points for {name} in that range")
        return
    value_columns = (["count", "sum", "buckets"] if found.histogram else
                     [c for c in ("value", "min", "max", "count") if c in frame.columns])
    table = folding_table(whole("time"), *value_columns, "attributes")
    for _, row in frame.tail(limit).iterrows():
        labels = ", ".join(f"{k}={row[k]}" for k in found.attributes
                           if isinstance(row[k], str) and row[k])
        table.add_row(_short_time(row["time"]), *[_cell(row[c]) for c in value_columns],
                      labels)
    stdout.print(table)
    stdout.print(f"{len(frame)} points")


def _cell(value: Any) -> str:
    """A number to 6 significant digits; a histogram's buckets as ``le: count`` lines."""
    if isinstance(value, dict):
        return "\n".join(f"le {le}: {count:g}" for le, count in value.items())
    return f"{value:.6g}"


def state_db_url(config: Path | None, state_db: str | None, store: Path | None = None) -> str:
    """``--state-db``, else the configuration's (next to ``store`` when only that is given);
    a SQLite file that is not there is a UsageError (opening it would create an empty one)."""
    url = load_config(config, overrides={"state_db": state_db, "store": store}).state_db
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        raise UsageError(f"{url}: no state database here (is the sidecar running for this job?)")
    return url


@contextmanager
def state_db_errors(url: str) -> Iterator[None]:
    """A database error inside the block (bad URL, not a state database, server down) as a
    UsageError of one line."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise UsageError(f"{url}: not a usable state database ({reason})") from None


@contextmanager
def _finding_store(config: Path | None, state_db: str | None) -> Iterator[Any]:
    """The findings of the state database; a bad URL or file is a UsageError of one line."""
    from policies import FindingStore

    url = state_db_url(config, state_db)
    with state_db_errors(url), FindingStore(url) as store:
        yield store


@db_app.command("upgrade")
def db_upgrade(config: ConfigOption = None, state_db: StateDbOption = None) -> None:
    """Create or upgrade the state database's tables (the sidecar does it when it starts)."""
    from seedancectl._state_schema import current, migrate

    url = load_config(config, overrides={"state_db": state_db}).state_db
    before = current(url)
    after = migrate(url)
    stdout.print(f"state database at revision {after}"
                 + ("" if before == after else f" (was {before or 'empty'})"))


@app.command()
def findings(
    job: Annotated[str | None, typer.Option(help="Only this job.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Closed findings too.")] = False,
    config: ConfigOption = None,
    state_db: StateDbOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Findings of the policy engine: what is wrong, where, since when."""
    with _finding_store(config, state_db) as store:
        found = store.history(job=job) if all_ else [
            f for f in store.active() if job is None or f.job == job]
        if job is not None and not found:
            _check_job(store, job)
    if json_out:
        print_json([f.to_dict() for f in found])
        return
    if not found:
        stdout.print("no findings" + ("" if all_ else " open"))
        return
    table = folding_table(whole("id"), "detector", "job", "resource", "severity", "opened",
                          "closed")
    for f in found:
        table.add_row(f.id, f.detector, f.job, ", ".join(f"{k}={v}" for k, v in
                                                          f.resource.items()),
                      f.severity, when(f.opened_at_ns), when(f.closed_at_ns))
    stdout.print(table)


def _check_job(store: Any, job: str) -> None:
    """A job that neither a finding nor the fleet's registry names is a typo, not a quiet job."""
    from seedancectl._unknown import check_known
    from tuner import FleetDirectory

    with FleetDirectory(store.url) as fleet:
        known = {f.job for f in store.history()} | {j.job for j in fleet.jobs()}
    check_known("job", job, known, where=store.url)


@app.command()
def explain(
    finding_id: Annotated[str, typer.Argument(help="Finding id (see `seedancectl findings`).")],
    config: ConfigOption = None,
    state_db: StateDbOption = None,
    json_out: JsonFlag = False,
) -> None:
    """The evidence of one finding in words and numbers."""
    with _finding_store(config, state_db) as store:
        finding = store.get(finding_id)
    if finding is None:
        raise UsageError(f"no finding {finding_id!r} (see `seedancectl findings --all`)")
    if json_out:
        print_json(finding.to_dict())
        return
    stdout.print(finding.render(), markup=False, highlight=False, soft_wrap=True)


def _floats(text: str, option: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected comma-separated numbers") from None
    if not values:
        raise UsageError(f"{option}: give at least one number")
    return values


@app.command()
def roi(
    util: Annotated[str, typer.Option(help="Current utilisations (fractions).")] = (
        "0.4,0.5,0.6,0.7,0.8,0.9"),
    scale: Annotated[str, typer.Option(help="Planned scale-out factors.")] = (
        "1.0,1.375,1.75,2.125,2.5"),
    nodes: Annotated[float, typer.Option(help="Nodes today.")] = 8.0,
    target: Annotated[float, typer.Option(help="Utilisation after the repair.")] = 0.9,
    node_cost: Annotated[float, typer.Option(help="Cost of one node per month.")] = 20_000.0,
    fix_cost: Annotated[float, typer.Option(help="One-off cost of the repair.")] = 100_000.0,
    horizon: Annotated[float, typer.Option(help="Months the savings are counted.")] = 12.0,
    gamma: Annotated[float, typer.Option(help="Throughput elasticity to node count.")] = 0.78,
    png: Annotated[Path | None, typer.Option(help="Also write a heatmap PNG here.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """The ROI of repairing utilisation vs scaling out (the seed's matrix, gamma 0.78)."""
    from policies import roi_matrix

    try:
        matrix = roi_matrix(
            utilisation_grid=_floats(util, "--util"), scale_out_grid=_floats(scale, "--scale"),
            n_nodes=nodes, target_utilisation=target, node_cost_per_month=node_cost,
            fix_cost=fix_cost, horizon_months=horizon, gamma=gamma)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if png is not None:
        from dashboards import roi_heatmap

        if not png.parent.is_dir():
            raise UsageError(f"--png {png}: folder {png.parent} does not exist")
        if png.is_dir():
            raise UsageError(f"--png {png}: a folder; give a file name (e.g. {png / 'roi.png'})")
        try:
            roi_heatmap(matrix, png)
        except OSError as exc:
            raise UsageError(f"--png {png}: cannot write: {exc}") from None
    if json_out:
        print_json({"utilisation": list(matrix.columns), "scale_out": list(matrix.index),
                    "roi": matrix.to_numpy().tolist(), "png": str(png) if png else None})
        return
    table = Table("scale-out \\ util", *[f"{u:.0%}" for u in matrix.columns],
                  title=f"ROI over {horizon:g} months (gamma {gamma})")
    for scale_out, row in matrix.iterrows():
        table.add_row(f"{scale_out:.2f}x", *[f"{v:+.0%}" for v in row])
    stdout.print(table)
    if png is not None:
        stdout.print(f"heatmap: {png}", markup=False, soft_wrap=True)


@dashboards_app.command("grafana")
def dashboards_grafana(
    out: Annotated[Path, typer.Option(help="Folder for dashboards/ and provisioning/.")],
    prometheus_url: Annotated[
        str, typer.Option(help="Prometheus URL for the provisioned data source.")
    ] = "http://127.0.0.1:9090",
    json_out: JsonFlag = False,
) -> None:
    """Grafana dashboards (GPUs, training, serving, tuning, findings) + provisioning files."""
    from dashboards.grafana import write_grafana

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder")
    try:
        paths = write_grafana(out, prometheus_url=prometheus_url)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write: {exc}") from None
    if json_out:
        print_json([str(p) for p in paths])
        return
    for path in paths:
        stdout.print(str(path), markup=False, soft_wrap=True)


@app.command()
def report(
    out: Annotated[Path, typer.Option(help="Folder for report.html, report.md, report.json.")],
    week: Annotated[str | None, typer.Option(help="ISO week, e.g. 2026-W47 (UTC).")] = None,
    since: Annotated[
        str | None, typer.Option(help="Start: a duration ago (7d) or ISO time.")] = None,
    until: Annotated[str | None, typer.Option(help="End: duration ago or ISO time (now).")] = None,
    job: Annotated[str | None, typer.Option(help="Only this job.")] = None,
    price_per_gpu_hour: Annotated[
        float | None, typer.Option(help="Price of one GPU-hour, for the money saved "
                                   "(default: price_per_gpu_hour of the configuration).")
    ] = None,
    prometheus: Annotated[
        str | None, typer.Option(help="Read series from this Prometheus URL, not the store "
                                 "(default: metrics_source of the configuration).")
    ] = None,
    store: StoreOption = None,
    config: ConfigOption = None,
    state_db: StateDbOption = None,
    json_out: JsonFlag = False,
) -> None:
    """The tuning report of a week (or range): findings, changes, savings, plots."""
    from dashboards.report import build_report
    from seedancectl._timeparse import parse_iso_week

    if (week is None) == (since is None):
        raise UsageError("give either --week YYYY-Www or --since (with an optional --until)")
    if week is not None:
        if until is not None:
            raise UsageError("--until goes with --since, not with --week")
        since_ns, until_ns = parse_iso_week(week)
    else:
        since_ns = parse_instant_ns(since or "")
        until_ns = parse_instant_ns(until) if until else parse_instant_ns("0s")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder")
    settings = load_config(config, overrides={"store": store, "state_db": state_db})
    store, prometheus = settings.store, prometheus or settings.prometheus_url
    if prometheus is None and not store.exists():
        raise UsageError(f"{store}: no store here (give --store or --prometheus)")
    with _finding_store(config, settings.state_db) as findings_db:
        url = findings_db.url
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create: {exc}") from None
    paths = build_report(store_path=store, state_db_url=url, since_ns=since_ns,
                         until_ns=until_ns, job=job, out_dir=out,
                         price_per_gpu_hour=settings.price_per_gpu_hour if price_per_gpu_hour is None
                         else price_per_gpu_hour,
                         currency=settings.currency, prometheus_url=prometheus)
    if json_out:
        print_json({"html": str(paths.html), "markdown": str(paths.markdown),
                    "json": str(paths.json), "plots": [str(p) for p in paths.plots]})
        return
    for path in (paths.html, paths.markdown, paths.json):
        stdout.print(str(path), markup=False, soft_wrap=True)


@app.command()
def demo(
    minutes: Annotated[float, typer.Option(help="How long the jobs run (tuning + incident).")
                       ] = 4.0,
    out: Annotated[Path, typer.Option(
        help="Folder for summary.json, report/, logs/, the store and the state DB.")] = Path(
        "seedance-demo"),
    nvml_trace: Annotated[
        str, typer.Option(help="Recorded GPU trace to replay (labelled replayed), or 'off'.")
    ] = "h100_gpu_burn",
    replicas: Annotated[int, typer.Option(help="Serving replicas (1 or 2).")] = 1,
) -> None:
    """A real CPU run: sidecar + training and serving jobs, a tuning session, a staged fp16
    incident rolled back; live view, summary table, OUT/summary.json and OUT/report/."""
    from seedancectl._demo import DemoConfig
    from seedancectl._demo_view import run_demo
    from seedancectl._sources import resolve_trace

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder")
    config = DemoConfig(out=out, minutes=minutes, replicas=replicas,
                        nvml_trace=None if nvml_trace == "off" else resolve_trace(nvml_trace))
    code = run_demo(config, stdout=stdout, err=err)
    if code:
        raise typer.Exit(code)


