"""`seedancectl study dashboard`: optuna-dashboard on the state database, on loopback.

The tuner's studies live in the state database (Optuna's RDB storage next to the sidecar's own
tables), so the well-kept viewer for them is optuna-dashboard: this command only finds the
database and the job's study, serves the dashboard's WSGI app on 127.0.0.1 and prints its URL.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Annotated
from wsgiref.simple_server import WSGIRequestHandler, make_server

import typer

from seedancectl._config import load_config
from seedancectl.cli._app import ConfigOption, StateDbOption, UsageError, app, stdout
from seedancectl.cli._local import state_db_errors, state_db_url

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

study_app = typer.Typer(help="The tuner's Optuna studies, kept in the state database.",
                        no_args_is_help=True)
app.add_typer(study_app, name="study")

HOST = "127.0.0.1"
"""Loopback only: the dashboard can edit studies (notes, trial states) and has no login."""


@study_app.command("dashboard")
def dashboard(
    job: Annotated[str | None, typer.Argument(help="Open this job's study (default: the list "
                                                   "of every study).")] = None,
    config: ConfigOption = None,
    state_db: StateDbOption = None,
    port: Annotated[int, typer.Option("--port", min=0, max=65535,
                                      help="Port on 127.0.0.1 (0: a free one).")] = 0,
) -> None:
    """Serve optuna-dashboard on the state database at http://127.0.0.1:PORT/ until Ctrl-C."""
    try:
        from optuna_dashboard import wsgi
    except ImportError:
        raise UsageError("optuna-dashboard is not installed: pip install "
                         "'seedance-tuner[study]'") from None
    from sqlalchemy import make_url

    url = state_db_url(config, state_db)
    with state_db_errors(url):
        storage = _storage(url)
        path = "/dashboard/" if job is None else _study_path(storage, job, config)
    try:
        server = make_server(HOST, port, wsgi(storage), handler_class=_QuietHandler)
    except OSError as exc:
        raise UsageError(f"cannot listen on {HOST}:{port} ({exc.strerror})") from None
    shown = make_url(url).render_as_string(hide_password=True)
    stdout.print(f"optuna-dashboard for {shown} at http://{HOST}:{server.server_port}{path}",
                 highlight=False, soft_wrap=True)
    stdout.print("Ctrl-C stops it.", style="dim")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _storage(url: str) -> BaseStorage:
    import optuna

    from collectors import state_engine_options

    return optuna.storages.RDBStorage(url, engine_kwargs=state_engine_options(url))


def _study_path(storage: BaseStorage, job: str, config: ConfigOption) -> str:
    """The dashboard page of ``job``'s study; a job without one is a UsageError naming the
    studies there are."""
    from seedancectl._job_searches import study_name

    name = study_name(load_config(config), job)
    if name is None:
        raise UsageError(f"job {job!r} is not tuned in the configuration (jobs.{job}.tune), "
                         "so it has no study; leave out JOB to list every study")
    studies = sorted(s.study_name for s in storage.get_all_studies())
    if name not in studies:
        near = difflib.get_close_matches(name, studies, n=3)
        hint = (f"; did you mean {', '.join(near)}?" if near
                else f"; studies here: {', '.join(studies) or 'none'}")
        raise UsageError(f"no study {name!r} for job {job!r} in the state database{hint}")
    return f"/dashboard/studies/{storage.get_study_id_from_name(name)}"


class _QuietHandler(WSGIRequestHandler):
    """No access line per request on the terminal the URL was printed to."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        return
