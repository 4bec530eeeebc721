"""What `metrics query NAME` reads from the store: a plain metric's points, or an OTel
histogram's count, sum and buckets, which the receiver stores as three metrics (``NAME.count``,
``NAME.sum``, ``NAME.bucket`` with an ``le`` attribute) that a person asks for by one name.

A name or attribute value the store does not hold is an ``UnknownNameError`` with the near
matches, so that a typo is not mistaken for a quiet metric."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from collectors import Resolution, TimeSeriesStore
from seedancectl._unknown import check_known

_VALUE_COLUMNS = frozenset({"value", "mean", "min", "max", "count", "last"})


@dataclass(frozen=True, kw_only=True)
class MetricPoints:
    """The answer: ``histogram`` says which shape ``frame`` has.

    Plain: the store's frame (``TimeSeriesStore.query``). Histogram: columns time, count, sum
    (NaN when not sent), buckets (a dict from each ``le`` bound to its cumulative count, in
    bound order), then one str column per attribute; rollups read each bucket's last value.
    """

    name: str
    histogram: bool
    frame: pd.DataFrame

    @property
    def attributes(self) -> list[str]:
        skip = {"time", "sum", "buckets", *_VALUE_COLUMNS}
        return [c for c in self.frame.columns if c not in skip]


def query_metric(ts: TimeSeriesStore, name: str, *, where: Mapping[str, str], where_from: str,
                 since_ns: int, until_ns: int | None, resolution: Resolution) -> MetricPoints:
    """The points of ``name`` in the range; ``where_from`` names the store in errors."""
    names = set(ts.metrics()["name"])
    histograms = {n.removesuffix(".count") for n in names
                  if n.endswith(".count") and n.removesuffix(".count") + ".bucket" in names}
    check_known("metric", name, names | histograms, where=where_from)
    histogram = name not in names
    stored = name + ".count" if histogram else name
    series = ts.series(stored)
    for key, value in where.items():
        check_known(key, value, (s[key] for s in series if key in s),
                    where=f"{name} of {where_from}")

    def read(metric: str) -> pd.DataFrame:
        return ts.query(metric, where=where, since_ns=since_ns, until_ns=until_ns,
                        resolution=resolution)

    if not histogram:
        return MetricPoints(name=name, histogram=False, frame=read(name))
    return MetricPoints(name=name, histogram=True, frame=_histogram_frame(
        read(name + ".count"), read(name + ".sum"), read(name + ".bucket")))


def _histogram_frame(count: pd.DataFrame, total: pd.DataFrame,
                     bucket: pd.DataFrame) -> pd.DataFrame:
    """One row per time and series (the three frames share both: one export writes them)."""
    value = "value" if "value" in count.columns else "last"
    attributes = [c for c in count.columns if c != "time" and c not in _VALUE_COLUMNS]
    keys = ["time", *attributes]

    def keyed(frame: pd.DataFrame) -> pd.DataFrame:
        return frame.assign(**{a: frame[a].fillna("") for a in attributes if a in frame})

    out = keyed(count)[keys].assign(count=count[value].to_numpy())
    if not total.empty:
        out = out.merge(keyed(total)[keys].assign(sum=total[value].to_numpy()), on=keys,
                        how="left")
    else:
        out = out.assign(sum=float("nan"))
    buckets: dict[tuple[Any, ...], dict[str, float]] = {}
    if not bucket.empty:
        ordered = keyed(bucket).assign(_bound=pd.to_numeric(bucket["le"]))
        for fields in ordered.sort_values("_bound", kind="stable").to_dict(orient="records"):
            key = tuple(fields[k] for k in keys)
            buckets.setdefault(key, {})[str(fields["le"])] = float(fields[value])
    out["buckets"] = [buckets.get(tuple(row), {}) for row in out[keys].itertuples(index=False)]
    return out[["time", "count", "sum", "buckets", *attributes]]
