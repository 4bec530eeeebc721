"""Showing it: weekly report, Grafana dashboards, approval pages, the fleet view, plots."""

from dashboards._fleet_view import FleetJobView, FleetView, fleet_view
from dashboards._roi_plot import roi_heatmap

__all__ = ["FleetJobView", "FleetView", "fleet_view", "roi_heatmap"]
