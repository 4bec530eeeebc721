"""The weekly tuning report: HTML (self-contained), Markdown with PNG plots, and JSON.

``build_report`` reads the time-series store (or Prometheus), the findings and the rollout
journal for a range and writes ``report.html``, ``report.md``, ``report.json`` and
``plots/*.png`` into ``out_dir``.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from dashboards.report._data import gather
from dashboards.report._panels import PANELS
from dashboards.report._values import (
    ChangeRow,
    ConfigRow,
    FindingRow,
    JobReport,
    Marker,
    Panel,
    Payback,
    ReportData,
    ReportError,
    Savings,
)

__all__ = ["PANELS", "ChangeRow", "ConfigRow", "FindingRow", "JobReport", "Marker", "Panel", "Payback",
           "ReportData", "ReportError", "ReportPaths", "Savings", "build_report", "gather",
           "write_report"]


@dataclass(frozen=True, kw_only=True)
class ReportPaths:
    """Where a report was written."""

    html: Path
    markdown: Path
    json: Path
    plots: tuple[Path, ...]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text) or "_"


def write_report(data: ReportData, out_dir: str | os.PathLike[str], *,
                 generated_at_ns: int | None = None) -> ReportPaths:
    """Render ``data`` into ``out_dir`` (created if missing); each file is written atomically."""
    from dashboards.report._plots import panel_png
    from dashboards.report._render import context, render_html, render_markdown, to_json

    out = Path(out_dir)
    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    now_ns = time.time_ns() if generated_at_ns is None else generated_at_ns
    plots = {job.job: {panel.key: panel_png(panel, job.markers, data.since_ns, data.until_ns,
                                            plot_dir / f"{_slug(job.job)}-{panel.key}.png")
                       for panel in job.panels}
             for job in data.jobs}
    ctx = context(data, plots, now_ns)
    paths = ReportPaths(html=out / "report.html", markdown=out / "report.md",
                        json=out / "report.json",
                        plots=tuple(p for panels in plots.values() for p in panels.values()))
    for path, text in ((paths.html, render_html(ctx)),
                       (paths.markdown, render_markdown(ctx, out)),
                       (paths.json, to_json(data, plots, out, now_ns))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return paths


def build_report(*, store_path: str | os.PathLike[str], state_db_url: str, since_ns: int,
                 until_ns: int, job: str | None = None, out_dir: str | os.PathLike[str],
                 price_per_gpu_hour: float, currency: str = "USD",
                 prometheus_url: str | None = None) -> ReportPaths:
    """Gather [since_ns, until_ns] and write the report; series come from Prometheus when
    ``prometheus_url`` is given, else from the embedded store (opened read-only)."""
    if prometheus_url is not None:
        from collectors import PrometheusSource

        with PrometheusSource(prometheus_url) as source:
            data = gather(source=source, source_name=f"Prometheus at {prometheus_url}",
                          state_db_url=state_db_url, since_ns=since_ns, until_ns=until_ns,
                          job=job, price_per_gpu_hour=price_per_gpu_hour, currency=currency)
        return write_report(data, out_dir)
    from collectors import StoreError, TimeSeriesStore

    try:
        store = TimeSeriesStore(store_path, readonly=True)
    except StoreError as e:
        raise ReportError(str(e)) from e
    with store:
        data = gather(source=store, source_name=f"embedded store {store_path}",
                      state_db_url=state_db_url, since_ns=since_ns, until_ns=until_ns, job=job,
                      price_per_gpu_hour=price_per_gpu_hour, currency=currency)
    return write_report(data, out_dir)
