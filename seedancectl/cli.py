"""`seedancectl`: the operator's command line.

Every user mistake ends in one red line and exit code 2, never a traceback: commands raise
SeedanceError subclasses and `main()` turns them into that line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table
from typer.core import TyperGroup

from collectors import SeedanceError
from seedancectl._config import load_config
from seedancectl._timeparse import parse_instant_ns

stdout = Console()
err = Console(stderr=True)


class _Group(TyperGroup):
    """Every user mistake, from any command, ends in one red line and exit code 2."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except SeedanceError as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=_Group,
    name="seedancectl",
    help="Attach to a live PyTorch job, find what holds it back, and tune it safely.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
metrics_app = typer.Typer(help="Look at what the time-series store holds.", no_args_is_help=True)
config_app = typer.Typer(help="Check configuration files.", no_args_is_help=True)
app.add_typer(metrics_app, name="metrics")
app.add_typer(config_app, name="config")
dashboards_app = typer.Typer(help="Generate dashboards for the metrics the sidecar exports.",
                             no_args_is_help=True)
app.add_typer(dashboards_app, name="dashboards")

changes_app = typer.Typer(help="Changes the tuner proposed, applied, kept or rolled back.",
                          no_args_is_help=True)
app.add_typer(changes_app, name="changes")
tuning_app = typer.Typer(help="Pause or resume a job's search.", no_args_is_help=True)
app.add_typer(tuning_app, name="tuning")
scheduler_app = typer.Typer(help="The job's scheduler (restart scope: needs approval).",
                            no_args_is_help=True)
app.add_typer(scheduler_app, name="scheduler")
precision_app = typer.Typer(help="Layer-wise precision of the job's module groups.",
                            no_args_is_help=True)
app.add_typer(precision_app, name="precision")
kv_app = typer.Typer(help="The serving job's quantised KV cache.", no_args_is_help=True)
app.add_typer(kv_app, name="kv")


ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML configuration file.")
]
StoreOption = Annotated[
    Path, typer.Option("--store", help="Time-series store file.")
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


class UsageError(SeedanceError):
    """A command was given input it cannot use."""


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@app.command()
def sidecar(
    config: ConfigOption = None,
    job: Annotated[str | None, typer.Option(help="Job name (service.name).")] = None,
    listen: Annotated[
        str | None, typer.Option(help="HOST:PORT for the API and OTLP receiver.")
    ] = None,
    store: Annotated[Path | None, typer.Option(help="Time-series store file.")] = None,
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
        "job": job, "listen": listen, "store": store, "upstream_otlp_endpoint": upstream,
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
    store: StoreOption = Path("seedance-data/metrics.db"), json_out: JsonFlag = False
) -> None:
    """Every metric name in the store, with its series and point counts."""
    with _open_store(store) as ts:
        frame = ts.metrics()
    if json_out:
        print_json(frame.to_dict(orient="records"))
        return
    table = Table(Column("name", overflow="fold"), "series", "points", "first", "last")
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
    store: StoreOption = Path("seedance-data/metrics.db"),
    json_out: JsonFlag = False,
) -> None:
    """Points of one metric, filtered by attributes and time range."""
    if resolution not in ("auto", "raw", "1m", "1h"):
        raise UsageError(f"--resolution {resolution!r}: expected auto, raw, 1m or 1h")
    filters = _parse_where(where or [])
    since_ns = parse_instant_ns(since)
    until_ns = parse_instant_ns(until) if until else None
    with _open_store(store) as ts:
        frame = ts.query(name, where=filters, since_ns=since_ns,
                         until_ns=until_ns, resolution=resolution)
    if json_out:
        records = frame.assign(time=frame["time"].astype(str)).to_dict(orient="records")
        print_json({"name": name, "points": records})
        return
    if frame.empty:
        stdout.print(f"no points for {name} in that range")
        return
    value_columns = [c for c in ("value", "min", "max", "count") if c in frame.columns]
    attributes = [c for c in frame.columns if c not in ("time", "last", *value_columns)]
    table = Table("time", *value_columns, "attributes")
    for _, row in frame.tail(limit).iterrows():
        labels = ", ".join(f"{k}={row[k]}" for k in attributes if isinstance(row[k], str))
        table.add_row(_short_time(row["time"]), *[f"{row[c]:.6g}" for c in value_columns],
                      labels)
    stdout.print(table)
    stdout.print(f"{len(frame)} points")


StateDbOption = Annotated[
    str | None, typer.Option("--state-db", help="State database URL (default from config).")
]


@contextmanager
def _finding_store(config: Path | None, state_db: str | None) -> Iterator[Any]:
    """The findings of the state database; a bad URL or file is a UsageError of one line."""
    from sqlalchemy.exc import SQLAlchemyError

    from policies import FindingStore

    url = state_db or load_config(config).state_db
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        raise UsageError(f"{url}: no state database here (is the sidecar running for this job?)")
    try:
        with FindingStore(url) as store:
            yield store
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise UsageError(f"{url}: not a usable state database ({reason})") from None


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
    if json_out:
        print_json([f.to_dict() for f in found])
        return
    if not found:
        stdout.print("no findings" + ("" if all_ else " open"))
        return
    table = Table("id", "detector", "job", "resource", "severity", "opened", "closed")
    for f in found:
        table.add_row(f.id, f.detector, f.job, ", ".join(f"{k}={v}" for k, v in
                                                          f.resource.items()),
                      f.severity, _when(f.opened_at_ns), _when(f.closed_at_ns))
    stdout.print(table)


def _when(ns: int | None) -> str:
    import datetime as dt

    if ns is None:
        return "-"
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


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
        float, typer.Option(help="Price of one GPU-hour, for the cost saved.")] = 2.5,
    prometheus: Annotated[
        str | None, typer.Option(help="Read series from this Prometheus URL, not the store.")
    ] = None,
    store: StoreOption = Path("seedance-data/metrics.db"),
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
    if prometheus is None and not store.exists():
        raise UsageError(f"{store}: no store here (give --store or --prometheus)")
    with _finding_store(config, state_db) as findings_db:
        url = findings_db.url
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create: {exc}") from None
    paths = build_report(store_path=store, state_db_url=url, since_ns=since_ns,
                         until_ns=until_ns, job=job, out_dir=out,
                         price_per_gpu_hour=price_per_gpu_hour, prometheus_url=prometheus)
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


# ---- talking to a running sidecar ------------------------------------------------------------

DEFAULT_SIDECAR = "http://127.0.0.1:4318"
SidecarOption = Annotated[
    str, typer.Option("--sidecar", envvar="SEEDANCE_SIDECAR", help="The sidecar's URL.")
]
TokenFileOption = Annotated[
    Path | None, typer.Option("--token-file", help=(
        "File holding the API token (else $SEEDANCE_TOKEN, else the file "
        "$SEEDANCE_TOKEN_FILE names, else seedance-data/token)."))
]
JobOption = Annotated[str, typer.Option("--job", help="The job (as it attached).")]
ByOption = Annotated[str, typer.Option("--by", help="Who you are, for the audit log.")]
UserOption = Annotated[
    str | None, typer.Option("--by", help="Who you are, for the audit log (default: $USER).")
]
ReasonOption = Annotated[str, typer.Option("--reason", help="Why, for the audit log.")]


def _token(token_file: Path | None) -> str:
    from tuner import DEFAULT_TOKEN_FILE, TOKEN_ENV, TOKEN_FILE_ENV, find_token

    token = find_token(token_file)
    if token is None:
        raise UsageError(f"this command needs the sidecar's API token: pass --token-file or set "
                         f"{TOKEN_ENV} or {TOKEN_FILE_ENV} (a sidecar without a token_file "
                         f"writes one to {DEFAULT_TOKEN_FILE})")
    return token


def _call(method: str, sidecar: str, path: str, *, token_file: Path | None = None,
          mutate: bool = False, body: dict[str, Any] | None = None,
          params: dict[str, Any] | None = None) -> Any:
    """One API call; every failure is a UsageError of one line."""
    import httpx

    headers = {"Authorization": f"Bearer {_token(token_file)}"} if mutate else {}
    url = sidecar.rstrip("/") + path
    try:
        reply = httpx.request(method, url, json=body, params=params, headers=headers,
                              timeout=30.0)
    except httpx.InvalidURL as exc:
        raise UsageError(f"--sidecar {sidecar!r}: {exc}") from None
    except httpx.HTTPError as exc:
        raise UsageError(f"no sidecar answers at {sidecar} ({type(exc).__name__}: {exc}); "
                         "is `seedancectl sidecar` running?") from None
    if reply.is_success:
        return reply.json()
    try:
        detail = reply.json().get("detail")
    except ValueError:
        detail = reply.text.strip()[:200]
    if isinstance(detail, list) and detail:  # a validation error: name the field
        first = detail[0]
        detail = f"{'.'.join(str(p) for p in first.get('loc', ())[1:])}: {first.get('msg')}"
    raise UsageError(f"sidecar {sidecar}: HTTP {reply.status_code}: {detail}")


def _user(by: str | None) -> str:
    import getpass

    return by or getpass.getuser()


def _values(items: list[str], prefix: str, option: str) -> dict[str, Any]:
    """KEY=VALUE items as knob values ``prefix + KEY``; numbers and true/false are typed."""
    if not items:
        raise UsageError(f"give at least one {option}")
    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key or not text:
            raise UsageError(f"{item!r}: expected {option}")
        values[prefix + key] = _typed(text)
    return values


def _typed(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _bool(text: str, option: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "yes", "on", "1"):
        return True
    if lowered in ("false", "no", "off", "0"):
        return False
    raise UsageError(f"{option} {text!r}: expected true or false")


def _print_change(change: dict[str, Any], sidecar: str) -> None:
    knobs = ", ".join(f"{k}: {change['baseline'].get(k)!r} -> {v!r}"
                      for k, v in sorted(change["values"].items()))
    stdout.print(f"change {change['id']} of job {change['job']}: [bold]{change['state']}[/] "
                 f"({change['scope']} scope, {change['risk']} risk) {knobs}", highlight=False,
                 soft_wrap=True)
    if change["state"] == "proposed":
        target = "" if sidecar == DEFAULT_SIDECAR else f" --sidecar {sidecar}"
        stdout.print(f"waits for a person: seedancectl approve {change['id']} --by NAME{target}",
                     highlight=False, soft_wrap=True)


def _propose(sidecar: str, token_file: Path | None, job: str, values: dict[str, Any],
             by: str, reason: str, json_out: bool) -> None:
    change = _call("POST", sidecar, f"/v1/jobs/{job}/changes", token_file=token_file,
                   mutate=True, body={"values": values, "by": by, "reason": reason})
    if json_out:
        print_json(change)
        return
    _print_change(change, sidecar)


def _show_knobs(sidecar: str, job: str, prefix: str, json_out: bool) -> None:
    found = _call("GET", sidecar, f"/v1/jobs/{job}/knobs")
    knobs = [k for k in found["knobs"] if k["name"].startswith(prefix)]
    if json_out:
        print_json({**found, "knobs": knobs})
        return
    if not knobs:
        stdout.print(f"job {job} declares no {prefix}* knobs")
        return
    table = Table("knob", "baseline", "desired", "domain", "scope", "risk",
                  title=f"job {job}: baseline v{found['baseline']['version']}, desired "
                        f"v{found['desired']['version']}")
    for k in knobs:
        domain = (", ".join(map(str, k["choices"])) if "choices" in k
                  else f"{k['low']:g} .. {k['high']:g}")
        table.add_row(k["name"], str(found["baseline"]["values"].get(k["name"])),
                      str(found["desired"]["values"].get(k["name"])), domain, k["scope"],
                      k["risk"])
    stdout.print(table)


@app.command()
def status(sidecar: SidecarOption = DEFAULT_SIDECAR, json_out: JsonFlag = False) -> None:
    """What the sidecar watches: jobs, their config versions, modes, open findings, changes."""
    found = _call("GET", sidecar, "/v1/status")
    if json_out:
        print_json(found)
        return
    table = Table("job", "state", "config (desired/acked)", "mode", "tuning",
                  Column("change", no_wrap=True),
                  title=f"seedance sidecar {found['sidecar']['job']} at {sidecar}")
    for job in found["jobs"]:
        change = job["change"]
        table.add_row(job["job"], job["state"],
                      f"v{job['desired_version']} / v{job['acked_version']}"
                      if job["desired_version"] is not None else "-",
                      job["mode"], job["tuning"],
                      "-" if change is None else f"{change['id']} {change['state']}")
    stdout.print(table)
    findings_line = ", ".join(f"{k} {v}" for k, v in found["findings"].items()) or "none"
    stdout.print(f"open findings: {findings_line}", highlight=False)
    stdout.print(f"waiting for approval: {', '.join(found['waiting']) or 'none'}",
                 highlight=False)


@changes_app.command("list")
def changes_list(
    job: Annotated[str | None, typer.Option(help="Only this job.")] = None,
    state: Annotated[list[str] | None, typer.Option(help="Only this state (repeatable).")] = None,
    sidecar: SidecarOption = DEFAULT_SIDECAR,
    json_out: JsonFlag = False,
) -> None:
    """Changes, oldest first."""
    params: dict[str, Any] = {"job": job, "state": state or None}
    found = _call("GET", sidecar, "/v1/changes",
                  params={k: v for k, v in params.items() if v is not None})
    if json_out:
        print_json(found)
        return
    if not found:
        stdout.print("no changes")
        return
    table = Table(Column("id", no_wrap=True), "job", "state", "source", "scope/risk", "change",
                  "created")
    for c in found:
        table.add_row(c["id"], c["job"], c["state"], c["source"], f"{c['scope']}/{c['risk']}",
                      ", ".join(f"{k}={v}" for k, v in sorted(c["values"].items())),
                      _when(int(c["created_at_s"] * 1e9)))
    stdout.print(table)


@changes_app.command("show")
def changes_show(
    change_id: Annotated[str, typer.Argument(help="Change id (see `seedancectl changes list`).")],
    sidecar: SidecarOption = DEFAULT_SIDECAR,
    json_out: JsonFlag = False,
) -> None:
    """One change with its audit trail."""
    found = _call("GET", sidecar, f"/v1/changes/{change_id}")
    if json_out:
        print_json(found)
        return
    _print_change(found, sidecar)
    stdout.print(f"reason: {found['reason']}", highlight=False, soft_wrap=True)
    if found.get("comparison"):
        c = found["comparison"]
        stdout.print(f"measured gain {c['gain']:+.2%} [{c['ci_low']:+.2%}, {c['ci_high']:+.2%}]",
                     highlight=False)
    table = Table("when", "event", "by", "versions", "reason")
    for e in found["events"]:
        versions = f"{e['version_before'] or '-'} -> {e['version_after'] or '-'}"
        table.add_row(_when(e["at_ns"]), e["kind"], e["actor"], versions, e["reason"])
    stdout.print(table)


@app.command()
def approve(
    change_id: Annotated[str, typer.Argument(help="The change to approve.")],
    by: ByOption,
    comment: Annotated[str, typer.Option(help="A note for the audit log.")] = "",
    sidecar: SidecarOption = DEFAULT_SIDECAR,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Approve a proposed change; the controller applies and measures it."""
    change = _call("POST", sidecar, f"/v1/changes/{change_id}/approve", token_file=token_file,
                   mutate=True, body={"by": by, "comment": comment})
    if json_out:
        print_json(change)
        return
    _print_change(change, sidecar)


@app.command()
def reject(
    change_id: Annotated[str, typer.Argument(help="The change to reject.")],
    by: ByOption,
    reason: ReasonOption,
    sidecar: SidecarOption = DEFAULT_SIDECAR,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Reject a proposed (or approved, not yet applied) change."""
    change = _call("POST", sidecar, f"/v1/changes/{change_id}/reject", token_file=token_file,
                   mutate=True, body={"by": by, "reason": reason})
    if json_out:
        print_json(change)
        return
    _print_change(change, sidecar)


@app.command()
def rollback(
    job: JobOption,
    by: ByOption,
    reason: ReasonOption,
    sidecar: SidecarOption = DEFAULT_SIDECAR,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Roll back the job's change in flight, else its last kept one."""
    change = _call("POST", sidecar, f"/v1/jobs/{job}/rollback", token_file=token_file,
                   mutate=True, body={"by": by, "reason": reason})
    if json_out:
        print_json(change)
        return
    _print_change(change, sidecar)


def _tuning(action: str, job: str, by: str | None, sidecar: str, token_file: Path | None,
            json_out: bool) -> None:
    found = _call("POST", sidecar, f"/v1/jobs/{job}/tuning", token_file=token_file,
                  mutate=True, body={"action": action, "by": _user(by)})
    if json_out:
        print_json(found)
        return
    stdout.print(f"job {job}: tuning {found['tuning']}")


@tuning_app.command("pause")
def tuning_pause(job: JobOption, by: UserOption = None, sidecar: SidecarOption = DEFAULT_SIDECAR,
                 token_file: TokenFileOption = None, json_out: JsonFlag = False) -> None:
    """Stop proposing new trials for the job (a change in flight runs to its end)."""
    _tuning("pause", job, by, sidecar, token_file, json_out)


@tuning_app.command("resume")
def tuning_resume(job: JobOption, by: UserOption = None,
                  sidecar: SidecarOption = DEFAULT_SIDECAR,
                  token_file: TokenFileOption = None, json_out: JsonFlag = False) -> None:
    """Propose trials for the job again."""
    _tuning("resume", job, by, sidecar, token_file, json_out)


SCHEDULER_POLICIES = ("static", "dynamic-topo")


@scheduler_app.command("set")
def scheduler_set(
    job: JobOption,
    policy: Annotated[str | None, typer.Option(help="static | dynamic-topo")] = None,
    rdma_enable: Annotated[str | None, typer.Option(help="true | false")] = None,
    numa_aware: Annotated[str | None, typer.Option(help="true | false")] = None,
    by: UserOption = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "scheduler set",
    sidecar: SidecarOption = DEFAULT_SIDECAR,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Propose a scheduler change (restart scope, high risk: it waits for approval)."""
    values: dict[str, Any] = {}
    if policy is not None:
        if policy not in SCHEDULER_POLICIES:
            raise UsageError(f"--policy {policy!r}: expected static or dynamic-topo")
        values["scheduler.policy"] = policy
    if rdma_enable is not None:
        values["scheduler.rdma"] = _bool(rdma_enable, "--rdma-enable")
    if numa_aware is not None:
        values["scheduler.numa_aware"] = _bool(numa_aware, "--numa-aware")
    if not values:
        raise UsageError("give at least one of --policy, --rdma-enable, --numa-aware")
    _propose(sidecar, token_file, job, values, _user(by), reason, json_out)


@precision_app.command("show")
def precision_show(job: JobOption, sidecar: SidecarOption = DEFAULT_SIDECAR,
                   json_out: JsonFlag = False) -> None:
    """Each module group's precision: baseline, desired, allowed."""
    _show_knobs(sidecar, job, "precision", json_out)


@precision_app.command("set")
def precision_set(
    job: JobOption,
    groups: Annotated[list[str], typer.Argument(help="GROUP=PRECISION, e.g. ffn=bf16.")],
    by: UserOption = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "precision set",
    sidecar: SidecarOption = DEFAULT_SIDECAR,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Propose new precisions for module groups (applied, measured, kept or rolled back)."""
    _propose(sidecar, token_file, job, _values(groups, "precision.", "GROUP=PRECISION"),
             _user(by), reason, json_out)


@kv_app.command("show")
def kv_show(job: JobOption, sidecar: SidecarOption = DEFAULT_SIDECAR,
            json_out: JsonFlag = False) -> None:
    """The KV cache knobs (kv.*): baseline, desired, allowed."""
    _show_knobs(sidecar, job, "kv.", json_out)


@kv_app.command("set")
def kv_set(
    job: JobOption,
    settings: Annotated[list[str], typer.Argument(help="key_bits=N value_bits=N (kv.* knobs).")],
    by: UserOption = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "kv set",
    sidecar: SidecarOption = DEFAULT_SIDECAR,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Propose KV cache settings (knobs kv.key_bits, kv.value_bits, ...)."""
    _propose(sidecar, token_file, job, _values(settings, "kv.", "KEY=VALUE"), _user(by),
             reason, json_out)


def main() -> None:
    """Entry point: one line and exit 2 for a user mistake (``_Group`` and click see to it)."""
    app()


if __name__ == "__main__":
    main()
