"""The command line's shell: the Typer app and its command groups, the consoles, the options
every command shares, and how a user mistake becomes one red line."""

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
fleet_app = typer.Typer(help="Every job of the sidecars that share one state database.",
                        no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")
db_app = typer.Typer(help="The state database's schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")


ConfigOption = Annotated[
    Path | None, typer.Option(
        "--config", "-c", envvar="SEEDANCE_CONFIG",
        help="TOML configuration file, the sidecar's: a flag wins over it, it wins over the "
             "defaults.")
]
StoreOption = Annotated[
    Path | None, typer.Option("--store", help="Time-series store file (default from config).")
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
StateDbOption = Annotated[
    str | None, typer.Option("--state-db", help="State database URL (default from config).")
]


class UsageError(SeedanceError):
    """A command was given input it cannot use."""


@contextmanager
def state_database(config: Path | None, state_db: str | None) -> Iterator[str]:
    """The state database's URL (``--state-db``, else the configuration's); a missing SQLite
    file, or a database error inside the block, is a UsageError of one line."""
    from sqlalchemy.exc import SQLAlchemyError

    url = state_db or load_config(config).state_db
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        raise UsageError(f"{url}: no state database here (is the sidecar running for this job?)")
    try:
        yield url
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise UsageError(f"{url}: not a usable state database ({reason})") from None


def folding_table(*columns: str | Column, **options: Any) -> Table:
    """A table whose cells fold onto more lines where they do not fit, instead of being cut to
    "…": at 80 columns Rich would otherwise shorten every cell to a few letters. A ``Column``
    given keeps its own settings (``no_wrap`` for ids and times, which must stay whole)."""
    return Table(*(c if isinstance(c, Column) else Column(c, overflow="fold") for c in columns),
                 **options)


def whole(header: str) -> Column:
    """A column that never wraps: ids and timestamps, copied or read as one piece."""
    return Column(header, no_wrap=True, min_width=len(header))


def print_json(data: Any) -> None:
    """``--json`` output: plain JSON on stdout, no markup, so that it pipes into ``jq``."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def when(ns: int | None) -> str:
    """A timestamp (ns) as UTC date and time; "-" for none."""
    import datetime as dt

    if ns is None:
        return "-"
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
