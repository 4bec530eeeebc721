"""Showing it: weekly report, Grafana dashboards, approval pages."""
