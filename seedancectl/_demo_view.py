"""What the demo shows: the live view (refreshed from each Snapshot, ~1/s), the final tables,
and the run around them (Ctrl-C and SIGTERM stop everything; a failure is one line)."""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from collectors import SeedanceError
from seedancectl._demo import DemoConfig, DemoError, DemoRun, Snapshot, write_summary

STATE_STYLE = {"kept": "green", "rolled_back": "red", "rejected": "yellow", "failed": "red",
               "expired": "yellow", "observing": "cyan", "applying": "cyan",
               "approved": "cyan", "proposed": "magenta",
               "manual_intervention_required": "bold red"}


def _num(value: float | None, fmt: str = "{:.4g}") -> str:
    return "-" if value is None else fmt.format(value)


def _values(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(values.items())) or "-"


def _state(state: str) -> Text:
    return Text(state.replace("_", " "), style=STATE_STYLE.get(state, ""))


def live_view(snap: Snapshot, *, total_s: float, replayed_gpu: str | None,
              max_rows: int = 8) -> RenderableType:
    """Phase and progress, the job's numbers, findings open, the last changes and trials."""
    head = Table.grid(padding=(0, 2))
    head.add_row(Text("phase", style="bold"), Text(snap.phase),
                 ProgressBar(total=total_s, completed=min(snap.elapsed_s, total_s), width=30),
                 Text(f"{snap.elapsed_s:.0f} / {total_s:.0f} s"))
    numbers = Table.grid(padding=(0, 2))
    numbers.add_row(
        f"config v{_num(snap.config_version, '{}')} (baseline v"
        f"{_num(snap.baseline_version, '{}')})",
        f"loss {_num(snap.loss)}", f"train tokens/s {_num(snap.tokens_per_s, '{:.0f}')}",
        f"serve tokens/s {_num(snap.serve_tokens_per_s, '{:.1f}')}",
        f"findings open {len(snap.findings)}")
    parts: list[RenderableType] = [head, numbers]
    if snap.findings:
        found = Table("finding", "detector", "where", "what", title=None, box=None)
        for f in snap.findings[-3:]:
            found.add_row(f["id"], f["detector"], _values(f["resource"]),
                          f["evidence"]["summary"][:70])
        parts.append(found)
    changes = Table("change", "source", "values", "state", "tokens/s", "gain", box=None)
    for c in snap.changes[-max_rows:]:
        source = f"trial {c['trial']}" if c["source"] == "trial" else c["source"]
        changes.add_row(c["id"][:8], source, _values(c["values"]), _state(c["state"]),
                        _num(c["objective"], "{:.0f}"), _num(c["gain"], "{:+.1%}"))
    parts.append(changes if snap.changes else Text("no changes yet", style="dim"))
    if replayed_gpu:
        parts.append(Text(f"GPU counters: REPLAYED from {replayed_gpu} (no GPU here)",
                          style="dim"))
    if snap.error:
        parts.append(Text(f"view: {snap.error}", style="yellow"))
    return Group(*parts)


def summary_tables(summary: Mapping[str, Any]) -> list[Table]:
    """The end of the run: headline numbers, then every change with its verdict."""
    head = Table("what", "value", title="seedance demo")
    training, serving, obj = summary["training"], summary["serving"], summary["objective"]
    head.add_row("training steps", _num(training["steps"], "{:.0f}"))
    head.add_row("loss first -> last", f"{_num(training['first_loss'])} -> "
                                       f"{_num(training['last_loss'])}")
    head.add_row("objective", obj["name"])
    baseline = obj["baseline_config"] or {}
    kept = {k: v for k, v in (obj["kept_config"] or {}).items() if baseline.get(k) != v}
    head.add_row("baseline", _num(obj["baseline"], "{:.1f}"))
    head.add_row("kept", f"{_num(obj['kept'], '{:.1f}')}  "
                         f"({_values(kept) if kept else 'the baseline'})")
    states: dict[str, int] = {}
    for c in summary["changes"]:
        states[c["state"]] = states.get(c["state"], 0) + 1
    head.add_row("trials (study)", str(len(summary["trials"])))
    head.add_row("changes", ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "none")
    head.add_row("findings", str(len(summary["findings"])))
    incident = summary["incident"]
    head.add_row("incident", "none" if incident is None else
                 f"{_values(incident['values'])}: {incident['rollback']} rollback "
                 f"({incident['cause'] or 'no cause recorded'})")
    launcher = serving.get("launcher") or {}
    head.add_row("serving", f"{serving['replicas']} replica(s), {launcher.get('requests', '-')} "
                            f"requests, p99 {_num(launcher.get('p99_s'), '{:.2f}')} s")
    head.add_row("GPU counters", summary["gpu"]["source"])
    for item in summary["simulated"]:
        head.add_row(f"simulated: {item['what']}", item["how"])
    changes = Table("change", "source", "values", "state", "tokens/s", "gain [CI]", "trail",
                    title="changes")
    for c in summary["changes"]:
        ci = ("" if c["ci_low"] is None else
              f" [{c['ci_low']:+.1%}, {c['ci_high']:+.1%}]")
        changes.add_row(c["id"][:8], f"trial {c['trial']}" if c["source"] == "trial"
                        else c["source"], _values(c["values"]), _state(c["state"]),
                        _num(c["objective"], "{:.0f}"), _num(c["gain"], "{:+.1%}") + ci,
                        "complete" if c["trail_complete"] else "-")
    return [head, changes]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(config: DemoConfig, *, stdout: Console, err: Console) -> int:
    """Run the demo with its live view on ``err`` and the tables on ``stdout``; 0, or 130
    when interrupted (everything stopped first). Failures raise DemoError (one line)."""
    run = DemoRun(config)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    replayed = config.nvml_trace.name if config.nvml_trace else None
    try:
        run.start()
        with Live(console=err, refresh_per_second=2) as live:
            run.follow(lambda snap: live.update(live_view(snap, total_s=config.seconds,
                                                          replayed_gpu=replayed)))
        err.print("finishing: the serving job drains, the sidecar stops")
        run.finish()
    except KeyboardInterrupt:
        run.close()  # before the line, so that it is true when printed
        err.print(f"[yellow]interrupted:[/] stopped every process; logs in {run.logs}")
        return 130
    except SeedanceError:
        raise
    except Exception as exc:  # a bug: one line, where to look, nothing left running
        raise DemoError(f"the demo failed ({type(exc).__name__}: {exc}); "
                        f"logs in {run.logs}") from exc
    finally:
        run.close()
        signal.signal(signal.SIGTERM, previous)
    summary = _summarise(run)
    path = write_summary(run.out, summary)
    for table in summary_tables(summary):
        stdout.print(table)
    stdout.print(f"summary: {path}")
    if summary["report"]:
        stdout.print(f"report: {summary['report']['html']}")
    stdout.print(f"logs: {run.logs}")
    return 0


def _summarise(run: DemoRun) -> dict[str, Any]:
    """The weekly report of the run into OUT/report/, then the summary."""
    from dashboards.report import build_report
    from seedancectl._demo_summary import summarise

    try:
        paths = build_report(store_path=run.store_path, state_db_url=run.state_db_url,
                             since_ns=run.started_at_ns, until_ns=time.time_ns(),
                             out_dir=run.out / "report", price_per_gpu_hour=2.5)
        return summarise(run, report={"html": str(paths.html), "markdown": str(paths.markdown),
                                      "json": str(paths.json)})
    except SeedanceError as exc:
        raise DemoError(f"summarising the run failed: {exc}; logs in {run.logs}") from exc
    except Exception as exc:  # a bug, said in one line with where to look
        raise DemoError(f"summarising the run failed ({type(exc).__name__}: {exc}); "
                        f"logs in {run.logs}") from exc
