"""Rendering a gathered report: self-contained HTML, Markdown with PNGs beside it, and JSON.

HTML and Markdown come from two Jinja templates over one context, so they say the same things;
the HTML embeds each plot as a base64 PNG (one file to mail or attach), the Markdown links the
PNG files. JSON holds every number the two show.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from dashboards.report import _words as words
from dashboards.report._values import ReportData

FORMULA = (
    "How the saving is counted: a kept change with throughput gain g (0.10 = +10%) makes the "
    "work done in H GPU-hours after it worth H x (1 + g) GPU-hours at the old throughput, so it "
    "saved H x g GPU-hours; H = GPUs (one per rank) x hours with throughput points from the keep "
    "to the end of the range (or its rollback). The gain's interval gives the saving's. Money "
    "saved = GPU-hours saved x the price per GPU-hour.")
PAYBACK_FORMULA = (
    "How payback is counted: trying changes costs the GPU-hours of every trial window at the "
    "price (counted whole, although the job kept working in them). A kept gain is worth the "
    "extra GPUs that would deliver the same throughput by scaling out, which adds "
    "communication, so it takes more GPUs than the gain alone (scaling efficiency 0.78), each "
    "at the price x 730 hours a month.")
KINDS = {"train": "training", "serve": "serving"}
HOURS_PER_MONTH_S = 730 * 3600


def _versions(versions: Sequence[int]) -> str:
    """"v2, v4, v6" for a few versions, "v2 ... v40 (12 versions)" for many."""
    if len(versions) <= 4:
        return ", ".join(f"v{v}" for v in versions)
    return f"v{min(versions)} ... v{max(versions)} ({len(versions)} versions)"


def _env(autoescape: bool, currency: str) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("dashboards.report", "templates"),
                             autoescape=autoescape, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(time=words.when, duration=words.duration, pct=words.pct, num=words.num,
                       money=lambda v: words.money(v, currency), values=words.values,
                       diff=words.diff, versions=_versions,
                       months=lambda m: words.duration(m * HOURS_PER_MONTH_S))
    return env


def context(data: ReportData, plots: Mapping[str, Mapping[str, Path]],
            generated_at_ns: int) -> dict[str, Any]:
    """What both templates show; ``plots`` maps job -> panel key -> PNG path."""
    return {"data": data, "plots": plots, "formula": FORMULA, "payback_formula": PAYBACK_FORMULA,
            "generated_at_ns": generated_at_ns, "kinds": KINDS,
            "active": [j for j in data.jobs if not j.quiet],
            "quiet": [j for j in data.jobs if j.quiet],
            "total_saved": sum(s.gpu_hours_saved for j in data.jobs for s in j.savings),
            "total_cost_saved": sum(s.cost_saved for j in data.jobs for s in j.savings)}


def render_html(ctx: Mapping[str, Any]) -> str:
    """Self-contained HTML: plots as base64 PNG data URIs."""
    embedded = {job: {key: "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode()
                      for key, p in panels.items()}
                for job, panels in ctx["plots"].items()}
    return _env(True, ctx["data"].currency).get_template("report.html.j2").render(**ctx, images=embedded)


def render_markdown(ctx: Mapping[str, Any], base: Path) -> str:
    """Markdown that links the PNGs by paths relative to ``base`` (the Markdown's folder)."""
    linked = {job: {key: p.relative_to(base).as_posix() for key, p in panels.items()}
              for job, panels in ctx["plots"].items()}
    return _env(False, ctx["data"].currency).get_template("report.md.j2").render(**ctx, images=linked)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def to_json(data: ReportData, plots: Mapping[str, Mapping[str, Path]], base: Path,
            generated_at_ns: int) -> str:
    """Every number of the report as JSON (non-finite numbers become null / "inf")."""
    def row(obj: Any) -> dict[str, Any]:
        return {k: _finite(v) if not isinstance(v, Mapping) else dict(v)
                for k, v in obj.__dict__.items()}

    jobs = []
    for job in data.jobs:
        jobs.append({
            "job": job.job, "kind": job.kind, "gpus": job.gpus,
            "state_counts": dict(job.state_counts),
            "findings": [row(f) for f in job.findings],
            "changes": [{**row(c), "states_entered": list(c.states_entered)}
                        for c in job.changes],
            "headline": list(job.headline), "gpu_hours": job.gpu_hours,
            "by_config": [{**row(r), "versions": list(r.versions)} for r in job.by_config],
            "savings": [row(s) for s in job.savings],
            "payback": None if job.payback is None else row(job.payback),
            "throughput_by_version": [
                {"version": int(r.version), "mean": _finite(float(r.mean)),
                 "points": int(r.points)} for r in job.throughput_by_version.itertuples()],
            "markers": [row(m) for m in job.markers],
            "panels": [{"key": p.key, "title": p.title, "unit": p.unit,
                        "metrics": list(p.metrics), "points": int(len(p.frame)),
                        "replayed": p.replayed,
                        "mean": _finite(float(p.frame["value"].mean()))
                        if len(p.frame) else None,
                        "png": plots[job.job][p.key].relative_to(base).as_posix()}
                       for p in job.panels],
        })
    body = {"schema_version": 1, "since_ns": data.since_ns, "until_ns": data.until_ns,
            "generated_at_ns": generated_at_ns, "source": data.source,
            "price_per_gpu_hour": data.price_per_gpu_hour, "currency": data.currency,
            "formula": FORMULA,
            "payback_formula": PAYBACK_FORMULA, "replayed_panels": list(data.replayed_panels),
            "jobs": jobs}
    return json.dumps(body, indent=2, sort_keys=True, allow_nan=False, default=str)
