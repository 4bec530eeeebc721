"""The ROI matrix as a heatmap PNG (the seed's table 2.5, drawn)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def roi_heatmap(matrix: pd.DataFrame, path: Path, *, title: str = "ROI of repairing utilisation"
                ) -> Path:
    """Write `matrix` (scale-out rows x utilisation columns, ROI fractions) as a PNG."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    values = matrix.to_numpy() * 100
    image = ax.imshow(values, cmap="RdYlGn", aspect="auto", origin="lower")
    ax.set_xticks(range(matrix.shape[1]), [f"{u:.0%}" for u in matrix.columns])
    ax.set_yticks(range(matrix.shape[0]), [f"{s:.2f}x" for s in matrix.index])
    ax.set_xlabel("current utilisation")
    ax.set_ylabel("planned scale-out")
    for (row, col), value in pd.DataFrame(values).stack().items():
        ax.text(col, row, f"{value:.0f}%", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="ROI over the horizon (%)")
    ax.set_title(title)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
