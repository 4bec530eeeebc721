"""Grafana dashboards generated from the metric catalogue, and their provisioning files."""

from dashboards.grafana._dashboards import DASHBOARDS
from dashboards.grafana._write import DATASOURCE_UID, dashboard_json, write_grafana

__all__ = ["DASHBOARDS", "DATASOURCE_UID", "dashboard_json", "write_grafana"]
