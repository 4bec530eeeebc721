"""The report's time-series plots: one PNG per panel, changes marked as vertical lines."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from dashboards.report._values import Marker, Panel  # noqa: E402

MARKER_STYLE: dict[str, tuple[str, Literal["-", "--"]]] = {
    "apply": ("tab:gray", "--"), "kept": ("tab:green", "-"), "rolled_back": ("tab:red", "-")}
_MAX_LINES = 8
_MAX_POINTS = 2000


def _decimate(line: pd.DataFrame) -> pd.DataFrame:
    """At most ``_MAX_POINTS`` per line: means of consecutive runs (the plot is 900 px wide)."""
    if len(line) <= _MAX_POINTS:
        return line
    run = np.arange(len(line)) // -(-len(line) // _MAX_POINTS)
    return pd.DataFrame({"time": line["time"].groupby(run).first(),
                         "value": line["value"].groupby(run).mean()})


def _break_gaps(line: pd.DataFrame) -> pd.DataFrame:
    """NaN rows inside gaps (over 2 min and 5x the usual spacing): no line across idle days."""
    line = line.sort_values("time")
    gaps = line["time"].diff()
    limit = max(pd.Timedelta(minutes=2), 5 * gaps.median()) if len(line) > 2 else None
    if limit is None:
        return line
    breaks = line.loc[gaps > limit, "time"] - pd.Timedelta(seconds=1)
    filler = pd.DataFrame({"time": breaks, "value": float("nan")})
    return pd.concat([line[["time", "value"]], filler]).sort_values("time", kind="stable")


def panel_png(panel: Panel, markers: Sequence[Marker], since_ns: int, until_ns: int,
              path: Path) -> Path:
    """Draw ``panel`` over [since, until] with every marker; write it atomically to ``path``."""
    fig, ax = plt.subplots(figsize=(9.0, 2.6), dpi=100)
    frame = panel.frame
    labels = list(dict.fromkeys(frame["series"])) if not frame.empty else []
    for label in labels[:_MAX_LINES]:
        line = _break_gaps(_decimate(frame[frame["series"] == label].sort_values("time")))
        ax.plot(line["time"], line["value"], linewidth=0.9, marker=".", markersize=1.5,
                label=str(label))
    if not labels:
        ax.text(0.5, 0.5, "no data in this range", transform=ax.transAxes, ha="center",
                va="center", color="0.4")
    for m in markers:
        color, style = MARKER_STYLE[m.kind]
        ax.axvline(pd.Timestamp(m.at_ns, unit="ns", tz="UTC"), color=color, linestyle=style,
                   linewidth=0.8, alpha=0.8)
    ax.set_xlim(pd.Timestamp(since_ns, unit="ns", tz="UTC"),
                pd.Timestamp(until_ns, unit="ns", tz="UTC"))
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
    ax.set_title(panel.title + (" (replayed, times shifted)" if panel.replayed else ""),
                 fontsize=10, loc="left")
    ax.set_ylabel(panel.unit, fontsize=8)
    ax.tick_params(labelsize=7)
    handles = ax.get_legend_handles_labels()[0]
    handles += [Line2D([], [], color=c, linestyle=s, label=k.replace("_", " "))
                for k, (c, s) in MARKER_STYLE.items() if any(m.kind == k for m in markers)]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
