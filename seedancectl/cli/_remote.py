"""Commands that talk to a running sidecar over its HTTP API: status, changes, approvals,
rollbacks, tuning, and the job's knobs. Every call goes through ``SidecarClient``, whose
``SidecarError`` is already the one line the app prints."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Column

from seedancectl._unknown import check_known
from seedancectl.cli._app import (
    ConfigOption,
    JsonFlag,
    UsageError,
    app,
    changes_app,
    folding_table,
    kv_app,
    precision_app,
    print_json,
    scheduler_app,
    stdout,
    tuning_app,
    when,
    whole,
)

if TYPE_CHECKING:
    from seedancectl._api_client import SidecarClient
    from seedancectl._api_types import ChangeJSON
    from seedancectl._config import SidecarConfig

DEFAULT_SIDECAR = "http://127.0.0.1:4318"
SidecarOption = Annotated[
    str | None, typer.Option("--sidecar", envvar="SEEDANCE_SIDECAR", help=(
        "The sidecar's URL, http(s)://HOST:PORT (default: the config's advertise_url or "
        "listen)."))
]
TokenFileOption = Annotated[
    Path | None, typer.Option("--token-file", help=(
        "File holding the API token (else $SEEDANCE_TOKEN, else the file "
        "$SEEDANCE_TOKEN_FILE names, else the config's token_file, else the token the "
        "sidecar wrote next to its store)."))
]
JobOption = Annotated[str, typer.Option("--job", help="The job (as it attached).")]
UserOption = Annotated[
    str | None, typer.Option("--by", help="Who you are, for the audit log (default: $USER).")
]
ReasonOption = Annotated[str, typer.Option("--reason", help="Why, for the audit log.")]


def _token(settings: SidecarConfig, token_file: Path | None) -> str:
    from tuner import TOKEN_ENV, TOKEN_FILE_ENV, find_token

    default_file = settings.token_file or settings.state_dir / "token"
    token = find_token(token_file, default_file=default_file)
    if token is None:
        raise UsageError(f"this command needs the sidecar's API token: pass --token-file, set "
                         f"{TOKEN_ENV} or {TOKEN_FILE_ENV}, or token_file in the config (no "
                         f"token at {default_file}, where a sidecar without one writes it)")
    return token


def _client(config: Path | None, sidecar: str | None, token_file: Path | None = None, *,
            writes: bool = False) -> SidecarClient:
    """The sidecar's API at ``--sidecar``, else where the configuration says it listens; a
    command that changes something needs the token before it calls (a missing one is the
    user's to fix, not the sidecar's 401)."""
    from collectors import ConfigError
    from seedancectl._api_client import SidecarClient
    from seedancectl._config import load_config

    settings = load_config(config)
    token = _token(settings, token_file) if writes else None
    try:
        return SidecarClient(sidecar or settings.advertised_url, token=token)
    except ConfigError as exc:
        raise UsageError(f"--sidecar {exc}") from None


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


def _print_change(change: ChangeJSON, api: SidecarClient) -> None:
    knobs = ", ".join(f"{k}: {change['baseline'].get(k)!r} -> {v!r}"
                      for k, v in sorted(change["values"].items()))
    stdout.print(f"change {change['id']} of job {change['job']}: [bold]{change['state']}[/] "
                 f"({change['scope']} scope, {change['risk']} risk) {knobs}", highlight=False,
                 soft_wrap=True)
    if change["state"] == "proposed":
        target = "" if api.url == DEFAULT_SIDECAR else f" --sidecar {api.url}"
        stdout.print(f"waits for a person: seedancectl approve {change['id']}{target}",
                     highlight=False, soft_wrap=True)


def _propose(api: SidecarClient, job: str, values: dict[str, Any], by: str | None,
             reason: str, json_out: bool) -> None:
    with api:
        change = api.propose(job, values, by=_user(by), reason=reason)
    _show_change(change, api, json_out)


def _show_change(change: ChangeJSON, api: SidecarClient, json_out: bool) -> None:
    if json_out:
        print_json(change)
        return
    _print_change(change, api)


def _show_knobs(api: SidecarClient, job: str, prefix: str, json_out: bool) -> None:
    with api:
        found = api.knobs(job)
    knobs = [k for k in found["knobs"] if k["name"].startswith(prefix)]
    if json_out:
        print_json({**found, "knobs": knobs})
        return
    if not knobs:
        stdout.print(f"job {job} declares no {prefix}* knobs")
        return
    table = folding_table("knob", "baseline", "desired", "domain", "scope", "risk",
                          title=f"job {job}: baseline v{found['baseline']['version']}, "
                                f"desired v{found['desired']['version']}")
    for k in knobs:
        domain = (", ".join(map(str, k["choices"])) if "choices" in k
                  else f"{k['low']:g} .. {k['high']:g}")
        table.add_row(k["name"], str(found["baseline"]["values"].get(k["name"])),
                      str(found["desired"]["values"].get(k["name"])), domain, k["scope"],
                      k["risk"])
    stdout.print(table)


@app.command()
def status(sidecar: SidecarOption = None, config: ConfigOption = None,
           json_out: JsonFlag = False) -> None:
    """What the sidecar watches: jobs, their config versions, modes, open findings, changes."""
    with _client(config, sidecar) as api:
        found = api.status()
    if json_out:
        print_json(found)
        return
    table = folding_table("job", "state", "config (desired/acked)", "mode", "tuning", "change",
                          title=f"seedance sidecar {found['sidecar']['job']} at {api.url}")
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
    sidecar: SidecarOption = None, config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Changes, oldest first."""
    with _client(config, sidecar) as api:
        found = api.changes(job=job, states=state)
        if job is not None and not found:
            check_known("job", job, (j["job"] for j in api.status()["jobs"]), where=api.url)
    if json_out:
        print_json(found)
        return
    if not found:
        stdout.print("no changes")
        return
    # Five columns, the state cell holding source and scope/risk on lines of their own: with
    # seven, 80 columns left each a few letters.
    table = folding_table(whole("id"), "job", Column("state", min_width=11, overflow="fold"),
                          Column("change", min_width=18, overflow="fold"),
                          Column("created", min_width=10, overflow="fold"))
    for c in found:
        table.add_row(c["id"], c["job"], f"{c['state']}\n{c['source']}\n{c['scope']}/{c['risk']}",
                      "\n".join(f"{k}={v}" for k, v in sorted(c["values"].items())),
                      when(int(c["created_at_s"] * 1e9)))
    stdout.print(table)


@changes_app.command("show")
def changes_show(
    change_id: Annotated[str, typer.Argument(help="Change id (see `seedancectl changes list`).")],
    sidecar: SidecarOption = None, config: ConfigOption = None,
    json_out: JsonFlag = False,
) -> None:
    """One change with its audit trail."""
    with _client(config, sidecar) as api:
        found = api.change(change_id)
    if json_out:
        print_json(found)
        return
    _print_change(found, api)
    stdout.print(f"reason: {found['reason']}", highlight=False, soft_wrap=True)
    if c := found.get("comparison"):
        stdout.print(f"measured gain {c['gain']:+.2%} [{c['ci_low']:+.2%}, {c['ci_high']:+.2%}]",
                     highlight=False)
    table = folding_table(whole("when"), "event", "by", "versions", "reason")
    for e in found["events"]:
        versions = f"{e['version_before'] or '-'} -> {e['version_after'] or '-'}"
        table.add_row(when(e["at_ns"]), e["kind"], e["actor"], versions, e["reason"])
    stdout.print(table)


@app.command()
def approve(
    change_id: Annotated[str, typer.Argument(help="The change to approve.")],
    by: UserOption = None,
    comment: Annotated[str, typer.Option(help="A note for the audit log.")] = "",
    sidecar: SidecarOption = None, config: ConfigOption = None,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Approve a proposed change; the controller applies and measures it."""
    with _client(config, sidecar, token_file, writes=True) as api:
        change = api.approve(change_id, by=_user(by), comment=comment)
    _show_change(change, api, json_out)


@app.command()
def reject(
    change_id: Annotated[str, typer.Argument(help="The change to reject.")],
    reason: ReasonOption,
    by: UserOption = None,
    sidecar: SidecarOption = None, config: ConfigOption = None,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Reject a proposed (or approved, not yet applied) change."""
    with _client(config, sidecar, token_file, writes=True) as api:
        change = api.reject(change_id, by=_user(by), reason=reason)
    _show_change(change, api, json_out)


@app.command()
def rollback(
    job: JobOption,
    reason: ReasonOption,
    by: UserOption = None,
    sidecar: SidecarOption = None, config: ConfigOption = None,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Roll back the job's change in flight, else its last kept one."""
    with _client(config, sidecar, token_file, writes=True) as api:
        change = api.rollback(job, by=_user(by), reason=reason)
    _show_change(change, api, json_out)


def _tuning(action: str, job: str, by: str | None, api: SidecarClient, json_out: bool) -> None:
    with api:
        found = api.set_tuning(job, action, by=_user(by))
    if json_out:
        print_json(found)
        return
    stdout.print(f"job {job}: tuning {found['tuning']}")


@tuning_app.command("pause")
def tuning_pause(job: JobOption, by: UserOption = None, sidecar: SidecarOption = None,
                 config: ConfigOption = None, token_file: TokenFileOption = None,
                 json_out: JsonFlag = False) -> None:
    """Stop proposing new trials for the job (a change in flight runs to its end)."""
    _tuning("pause", job, by, _client(config, sidecar, token_file, writes=True), json_out)


@tuning_app.command("resume")
def tuning_resume(job: JobOption, by: UserOption = None,
                  sidecar: SidecarOption = None, config: ConfigOption = None,
                  token_file: TokenFileOption = None, json_out: JsonFlag = False) -> None:
    """Propose trials for the job again."""
    _tuning("resume", job, by, _client(config, sidecar, token_file, writes=True), json_out)


SCHEDULER_POLICIES = ("static", "dynamic-topo")


@scheduler_app.command("set")
def scheduler_set(
    job: JobOption,
    policy: Annotated[str | None, typer.Option(help="static | dynamic-topo")] = None,
    rdma_enable: Annotated[str | None, typer.Option(help="true | false")] = None,
    numa_aware: Annotated[str | None, typer.Option(help="true | false")] = None,
    by: UserOption = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "scheduler set",
    sidecar: SidecarOption = None, config: ConfigOption = None,
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
    _propose(_client(config, sidecar, token_file, writes=True), job, values, by, reason,
             json_out)


@precision_app.command("show")
def precision_show(job: JobOption, sidecar: SidecarOption = None, config: ConfigOption = None,
                   json_out: JsonFlag = False) -> None:
    """Each module group's precision: baseline, desired, allowed."""
    _show_knobs(_client(config, sidecar), job, "precision", json_out)


@precision_app.command("set")
def precision_set(
    job: JobOption,
    groups: Annotated[list[str], typer.Argument(help="GROUP=PRECISION, e.g. ffn=bf16.")],
    by: UserOption = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "precision set",
    sidecar: SidecarOption = None, config: ConfigOption = None,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Propose new precisions for module groups (applied, measured, kept or rolled back)."""
    values = _values(groups, "precision.", "GROUP=PRECISION")
    _propose(_client(config, sidecar, token_file, writes=True), job, values, by, reason,
             json_out)


@kv_app.command("show")
def kv_show(job: JobOption, sidecar: SidecarOption = None, config: ConfigOption = None,
            json_out: JsonFlag = False) -> None:
    """The KV cache knobs (kv.*): baseline, desired, allowed."""
    _show_knobs(_client(config, sidecar), job, "kv.", json_out)


@kv_app.command("set")
def kv_set(
    job: JobOption,
    settings: Annotated[list[str], typer.Argument(help="key_bits=N value_bits=N (kv.* knobs).")],
    by: UserOption = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "kv set",
    sidecar: SidecarOption = None, config: ConfigOption = None,
    token_file: TokenFileOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Propose KV cache settings (knobs kv.key_bits, kv.value_bits, ...)."""
    values = _values(settings, "kv.", "KEY=VALUE")
    _propose(_client(config, sidecar, token_file, writes=True), job, values, by, reason,
             json_out)


