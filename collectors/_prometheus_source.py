"""Reading series from a Prometheus server that scrapes the sidecars' /metrics.

:class:`PrometheusSource` is a :class:`collectors.StoreReader`, like the embedded store, so the
detectors, the measurement, the guardrails and the report read a fleet's Prometheus through the
same call. Names are the sidecar's own exposition (:func:`collectors.prom_metric`): a
histogram's ``NAME.bucket`` is ``..._bucket``, a monotonic sum ``..._total``; labels are
translated back to attribute keys and the scrape's own ``job``/``instance`` labels dropped.

Time, as Prometheus has it:

- A sample is stamped when it is scraped and holds the job's last export before that. A scrape
  stamped T lands by T + its timeout <= T + one scrape interval, so an answer that reaches up to
  now may still lack its last scrape. A reader made with ``settle_s`` (the sidecar passes one
  scrape interval) answers nothing after ``now - settle_s``: a window it reads is complete.
- An open start (``since_ns`` None, as a config version's reader asks) reads ``lookback_s``
  back from the end; an open end is now (less ``settle_s``).

Resolution as the store understands it: ``raw`` is the samples as scraped (a range-vector
query: each scrape once, at its own time, no step); ``1m`` and ``1h`` sample every
``max(step, span / 11,000)`` (the range API's point limit) and, for gauges, average over that
step with ``avg_over_time`` (value = mean, as the store's rollups; time = bucket start);
min/max/count/last are that one value and 1 (Prometheus gives no per-bucket count). Cumulative
series keep the instant value.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from typing import Any

import httpx
import numpy as np
import pandas as pd

from collectors._catalogue import BY_NAME
from collectors._errors import ConfigError, SeedanceError
from collectors._points import MetricKind
from collectors._prometheus_names import PrometheusNameError, PromMetric, prom_metric
from collectors._store_reader import Resolution

_MAX_POINTS = 11_000
_STEP_S = {"1m": 60, "1h": 3600}
_AUTO_MIN_POINTS = 500
_SCRAPE_LABELS = frozenset({"job", "instance"})
_NS = 1_000_000_000
_MS = 1_000_000
_DURATION = re.compile(r"(\d+)(ms|y|w|d|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400,
           "y": 365 * 86400}


class PrometheusError(SeedanceError):
    """Prometheus could not answer: unreachable, an error reply, or no scrape targets."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def prometheus_duration_s(text: str) -> float:
    """Seconds of a Prometheus duration (``15s``, ``1m30s``, ``500ms``)."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise PrometheusError(f"{text!r} is not a Prometheus duration")
    return sum(int(n) * _UNIT_S[u] for n, u in parts)


class PrometheusSource:
    """A ``collectors.StoreReader`` over a Prometheus server; thread-safe.

    Every call is one HTTP request with a deadline of ``timeout_s``, over one pool of kept-alive
    connections (a policy pass makes hundreds) that :meth:`close` releases; a failure raises
    :class:`PrometheusError` (one line). See the module docstring for ``settle_s`` and
    ``lookback_s``.
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, settle_s: float = 0.0,
                 lookback_s: float = 3600.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"Prometheus URL must start with http:// or https://, got {url!r}")
        for field, value in (("timeout_s", timeout_s), ("lookback_s", lookback_s)):
            if not value > 0:
                raise ConfigError(f"{field} must be > 0, got {value}")
        if not settle_s >= 0:
            raise ConfigError(f"settle_s must be >= 0, got {settle_s}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self.lookback_s = lookback_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        """Release the connections; a second call is harmless."""
        self._http.close()

    def __enter__(self) -> PrometheusSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def scrape_interval_s(self) -> float:
        """The longest scrape interval of the server's active targets (``/api/v1/targets``):
        how late, at most, a sample a job exported shows up."""
        data = self._get("/api/v1/targets", {"state": "active"})
        targets = data.get("activeTargets") or []
        if not targets:
            raise PrometheusError(f"Prometheus at {self.url} scrapes no targets: add the "
                                  "sidecars' /metrics to its scrape_configs")
        try:
            return max(prometheus_duration_s(t["scrapeInterval"]) for t in targets)
        except KeyError:
            raise PrometheusError(f"Prometheus at {self.url} does not say its targets' scrape "
                                  "interval (a release too old for this sidecar)") from None

    def _series(self, name: str) -> tuple[str, PromMetric, dict[str, str], bool]:
        """(series name, its metric, label -> attribute, whether it is a gauge)."""
        base, role = name, ""
        if base not in BY_NAME:
            base, _, role = name.rpartition(".")
        if base not in BY_NAME or role not in ("", "bucket", "sum", "count"):
            raise PrometheusNameError(f"{name!r} is not in the metric catalogue")
        metric = prom_metric(base)
        gauge = metric.spec.kind is MetricKind.GAUGE and not role
        series = getattr(metric, role) if role else metric.gauge if gauge else metric.total
        to_attr = {label: attr for attr, label in metric.labels.items()}
        return str(series), metric, to_attr, gauge

    def query(self, name: str, *, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None,
              resolution: Resolution = "auto") -> pd.DataFrame:
        """Points of ``name`` whose attributes include ``where``, in [since_ns, until_ns]
        (open ends and what is answered: the module docstring)."""
        if resolution not in ("auto", "raw", *_STEP_S):
            raise PrometheusError(f"resolution must be auto, raw, 1m or 1h, got {resolution!r}")
        series, metric, to_attr, gauge = self._series(name)
        settled_ns = time.time_ns() - round(self.settle_s * _NS)
        until_ns = settled_ns if until_ns is None else min(until_ns, settled_ns)
        if since_ns is None:
            since_ns = until_ns - round(self.lookback_s * _NS)
        matchers = ",".join(f'{metric.label_of(k)}="{_escape(v)}"'
                            for k, v in sorted((where or {}).items()))
        selector = f"{series}{{{matchers}}}"
        span_s = max((until_ns - since_ns) / _NS, 1.0)
        if resolution == "auto":
            resolution = next((r for r in ("1h", "1m") if span_s / _STEP_S[r] >= _AUTO_MIN_POINTS),
                              "raw")
        # Prometheus takes times to the ms: round inwards, never outside [since_ns, until_ns]
        start_ms, end_ms = -(-since_ns // _MS), until_ns // _MS
        if start_ms > end_ms:
            return _frame([], to_attr, shift_ns=0, rollup=resolution != "raw")
        if resolution == "raw":
            # one ms more than the span: a range is left-open from Prometheus 3 on
            result = self._get("/api/v1/query", {
                "query": f"{selector}[{end_ms - start_ms + 1}ms]",
                "time": f"{end_ms / 1000:.3f}"})["result"]
            return _frame(result, to_attr, shift_ns=0, rollup=False, since_ns=since_ns)
        step_s = max(_STEP_S[resolution], math.ceil(span_s / _MAX_POINTS))
        expr = f"avg_over_time({selector}[{step_s}s])" if gauge else selector
        result = self._get("/api/v1/query_range", {
            "query": expr, "start": f"{start_ms / 1000:.3f}", "end": f"{end_ms / 1000:.3f}",
            "step": f"{step_s}s"})["result"]
        return _frame(result, to_attr, shift_ns=step_s * _NS if gauge else 0, rollup=True)

    def _get(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        """The ``data`` of one API answer."""
        try:
            reply = self._http.get(path, params=params)
            body = reply.json()
        except (httpx.HTTPError, ValueError) as e:
            raise PrometheusError(f"Prometheus at {self.url}: {_one_line(e)}") from e
        if reply.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"Prometheus at {self.url} answered {reply.status_code}: "
                                  f"{_one_line(body.get('error', body))}")
        return dict(body["data"])


def _frame(result: list[dict[str, Any]], to_attr: Mapping[str, str], *, shift_ns: int,
           rollup: bool, since_ns: int | None = None) -> pd.DataFrame:
    """Prometheus' matrix as the store's frame: time, value(, min, max, count, last), attrs;
    samples before ``since_ns`` left out."""
    parts = []
    for item in result:
        values = item.get("values", [])
        attrs = {to_attr.get(k, k): v for k, v in item["metric"].items()
                 if k != "__name__" and k not in _SCRAPE_LABELS}
        # seconds to the ms: exact in ms, where a float of ns would be off by up to 256 ns
        t = np.array([round(float(ts) * 1000) * _MS - shift_ns for ts, _ in values],
                     dtype=np.int64)
        v = np.array([float(x) for _, x in values], dtype=np.float64)
        if since_ns is not None:
            keep = t >= since_ns
            t, v = t[keep], v[keep]
        if t.size:
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
