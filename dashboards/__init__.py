"""Showing it: weekly report, Grafana dashboards, approval pages, the fleet view, plots.

Public names load their module on first use (``collectors.lazy_exports``): the sidecar serves
the fleet view, and importing the plots' matplotlib with it cost each sidecar 31 MiB.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collectors import lazy_exports

if TYPE_CHECKING:
    from dashboards._fleet_view import FleetJobView as FleetJobView
    from dashboards._fleet_view import FleetView as FleetView
    from dashboards._fleet_view import fleet_view as fleet_view
    from dashboards._roi_plot import roi_heatmap as roi_heatmap

if not TYPE_CHECKING:  # a __getattr__ that mypy saw would type every misspelt name as Any
    __all__, __getattr__, __dir__ = lazy_exports(globals())
