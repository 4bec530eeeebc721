"""Reading the report's series from Prometheus instead of the embedded store.

:class:`PrometheusSource` answers the store's ``query(name, where, since_ns, until_ns,
resolution)`` with Prometheus' HTTP API (``/api/v1/query_range``), so a fleet whose sidecars
export to Prometheus gets the same report. Store names are translated with the sidecar's own
Prometheus naming (``dashboards.grafana.prom``): a histogram's ``NAME.bucket`` is
``..._bucket``, a monotonic sum ``..._total``; labels are translated back to attribute keys, and
the scrape's own ``job``/``instance`` labels are dropped.

Resolution as the store understands it: ``raw`` samples every ``max(1 s, span / 11,000)`` (the
API's point limit); ``1m`` and ``1h`` use that step and, for gauges, ``avg_over_time`` over it
(value = mean, as the store's rollups), time = bucket start; min/max/count/last are that one
value and 1 (Prometheus gives no per-bucket count). Cumulative series keep the instant value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import httpx
import numpy as np
import pandas as pd

from collectors import BY_NAME, MetricKind, Resolution
from dashboards.grafana import DashboardNameError, prom
from dashboards.report._values import ReportError

_MAX_POINTS = 11_000
_STEP_S = {"raw": 1, "1m": 60, "1h": 3600}
_AUTO_MIN_POINTS = 500
_SCRAPE_LABELS = frozenset({"job", "instance"})
_NS = 1_000_000_000


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class PrometheusSource:
    """A ``collectors.StoreReader`` over a Prometheus server; stateless, thread-safe."""

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ReportError(f"Prometheus URL must start with http:// or https://, got {url!r}")
        if not timeout_s > 0:
            raise ReportError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _series(self, name: str) -> tuple[str, dict[str, str], bool]:
        """(Prometheus series name, label -> attribute, whether it is a gauge)."""
        base, role = name, ""
        if base not in BY_NAME:
            base, _, role = name.rpartition(".")
        spec = BY_NAME.get(base)
        if spec is None:
            raise ReportError(f"{name!r} is not in the metric catalogue")
        try:
            metric = prom(base)
            if role:
                series = {"bucket": lambda: metric.bucket, "sum": lambda: metric.sum,
                          "count": lambda: metric.count}[role]()
            else:
                series = metric.gauge if spec.kind is MetricKind.GAUGE else metric.total
        except (DashboardNameError, KeyError) as e:
            raise ReportError(f"{name!r} has no Prometheus series: {e}") from e
        labels = {label: attr for attr, label in metric.labels.items()}
        labels.setdefault("le", "le")
        return series, labels, spec.kind is MetricKind.GAUGE and not role

    def query(self, name: str, *, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None,
              resolution: Resolution = "auto") -> pd.DataFrame:
        """Points of ``name`` whose attributes include ``where``, in [since_ns, until_ns]."""
        if since_ns is None or until_ns is None:
            raise ReportError("a Prometheus query needs both since_ns and until_ns")
        series, labels, gauge = self._series(name)
        to_label = {attr: label for label, attr in labels.items()}
        matchers = ",".join(f'{to_label.get(k, k)}="{_escape(v)}"'
                            for k, v in sorted((where or {}).items()))
        selector = f"{series}{{{matchers}}}"
        span_s = max((until_ns - since_ns) / _NS, 1.0)
        if resolution == "auto":
            resolution = next((r for r in ("1h", "1m") if span_s / _STEP_S[r] >= _AUTO_MIN_POINTS),
                              "raw")
        if resolution not in _STEP_S:
            raise ReportError(f"resolution must be auto, raw, 1m or 1h, got {resolution!r}")
        step_s = max(_STEP_S[resolution], math.ceil(span_s / _MAX_POINTS))
        rollup = resolution != "raw"
        expr = f"avg_over_time({selector}[{step_s}s])" if rollup and gauge else selector
        # Prometheus takes seconds to the ms: round inwards, never outside [since_ns, until_ns]
        start_ms, end_ms = -(-since_ns // 1_000_000), until_ns // 1_000_000
        result = self._get({"query": expr, "start": f"{start_ms / 1000:.3f}",
                            "end": f"{end_ms / 1000:.3f}", "step": f"{step_s}s"})
        return _frame(result, labels, shift_ns=step_s * _NS if rollup and gauge else 0,
                      rollup=rollup)

    def _get(self, params: Mapping[str, str]) -> list[dict[str, Any]]:
        try:
            reply = httpx.get(f"{self.url}/api/v1/query_range", params=params,
                              timeout=self.timeout_s)
            body = reply.json()
        except (httpx.HTTPError, ValueError) as e:
            raise ReportError(f"Prometheus at {self.url}: {e}") from e
        if reply.status_code != 200 or body.get("status") != "success":
            raise ReportError(f"Prometheus at {self.url} answered {reply.status_code}: "
                              f"{body.get('error', body)}")
        return list(body["data"]["result"])


def _frame(result: list[dict[str, Any]], labels: Mapping[str, str], *, shift_ns: int,
           rollup: bool) -> pd.DataFrame:
    """Prometheus' matrix as the store's frame: time, value(, min, max, count, last), attrs."""
    parts = []
    for item in result:
        values = item.get("values", [])
        attrs = {labels.get(k, k): v for k, v in item["metric"].items()
                 if k != "__name__" and k not in _SCRAPE_LABELS}
        t = np.array([round(float(ts) * _NS) - shift_ns for ts, _ in values], dtype=np.int64)
        v = np.array([float(x) for _, x in values], dtype=np.float64)
        parts.append((attrs, t, v))
    keys = sorted({k for attrs, _, _ in parts for k in attrs})
    t = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, dtype=np.int64)
    v = np.concatenate([p[2] for p in parts]) if parts else np.empty(0)
    order = np.argsort(t, kind="stable")
    out: dict[str, Any] = {"time": pd.to_datetime(t[order], unit="ns", utc=True),
                           "value": v[order]}
    if rollup:
        out.update({"min": v[order], "max": v[order],
                    "count": np.ones(t.shape[0], dtype=np.int64), "last": v[order]})
    counts = [p[1].shape[0] for p in parts]
    for key in keys:
        per = np.array([attrs.get(key) for attrs, _, _ in parts], dtype=object)
        out[key] = pd.array(np.repeat(per, counts)[order], dtype="str")
    return pd.DataFrame(out)
