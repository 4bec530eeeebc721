"""Showing it: weekly report, Grafana dashboards, approval pages, plots."""

from dashboards._roi_plot import roi_heatmap

__all__ = ["roi_heatmap"]
