"""The report's panels: series read from the store at the report's resolution, one line per
host, GPU, rank or part, thinned to what a plot can show."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from collectors import (
    CONFIG_VERSION_ATTR,
    REPLAYED_ATTR,
    Resolution,
    StoreReader,
)
from collectors.names import (
    ATTR_GEN_AI_REQUEST_MODEL,
    ATTR_GPU_INDEX,
    ATTR_SEEDANCE_KV_PART,
    COMM_ALLREDUCE_DURATION_SUM,
    GEN_AI_SERVER_REQUEST_DURATION_BUCKET,
    GPU_DRAM_ACTIVE,
    HW_GPU_MEMORY_UTILIZATION,
    HW_GPU_UTILIZATION,
    SERVE_KV_CACHE_BITS,
    SERVE_PREFIX_CACHE_HIT_RATIO,
    SERVE_PREFIX_CACHE_HITS,
    SERVE_PREFIX_CACHE_QUERIES,
    SERVE_TOKENS_PER_SECOND,
    TRAIN_GRAD_NORM,
    TRAIN_STEP_DURATION_BUCKET,
    TRAIN_STEP_DURATION_SUM,
    TRAIN_TOKENS_PER_SECOND,
)
from dashboards.report._values import (
    HOST_ATTR,
    JOB_ATTR,
    MAX_INTERVALS,
    NS,
    RANK_ATTR,
    VALUE_COLUMNS,
    Panel,
)
from policies.detectors import interval_increases, p99_per_interval

# ---- panels ---------------------------------------------------------------------------------


def _attr_columns(frame: pd.DataFrame, drop: Sequence[str] = ()) -> list[str]:
    return [c for c in frame.columns if c not in VALUE_COLUMNS and c not in drop]


def _cumulative(frame: pd.DataFrame) -> pd.DataFrame:
    """A cumulative series' value per row: the bucket's last value for rollups."""
    return frame.assign(value=frame["last"]) if "last" in frame.columns else frame


_SHORT = {HOST_ATTR: "host", ATTR_GPU_INDEX: "gpu", RANK_ATTR: "rank", ATTR_SEEDANCE_KV_PART: "part"}


def _label(frame: pd.DataFrame, keys: Sequence[str]) -> pd.Series:
    """One legend label per series ("rank=0 gpu=1"), built once per distinct attribute set."""
    present = [k for k in keys if k in frame.columns]
    if not present:
        return pd.Series(["all"] * len(frame), index=frame.index, dtype="str")
    codes, uniques = pd.MultiIndex.from_frame(frame[present].astype(str)).factorize()
    names = [" ".join(f"{_SHORT.get(k, k.rsplit('.', 1)[-1])}={v}"
                      for k, v in zip(present, u, strict=True)) for u in uniques]
    return pd.Series(np.asarray(names, dtype=object)[codes], index=frame.index, dtype="str")


def _lines(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    if frame.empty:
        return pd.DataFrame({"time": frame["time"], "value": frame["value"],
                             "series": pd.Series([], dtype="str")})
    return pd.DataFrame({"time": frame["time"], "value": frame["value"].astype(float),
                         "series": _label(frame, keys)}).reset_index(drop=True)


def _per_group(frame: pd.DataFrame, ignore: Sequence[str],
               fn: Callable[[pd.DataFrame], pd.DataFrame]) -> pd.DataFrame:
    """Apply ``fn`` to each series group (attributes but ``ignore``) and stack the results."""
    if frame.empty:
        return pd.DataFrame({"time": frame["time"], "value": frame["value"]})
    keys = _attr_columns(frame, ignore)
    groups = frame.groupby(keys, dropna=False, sort=False) if keys else [((), frame)]
    parts = [fn(g.sort_values("time")) for _, g in groups]
    parts = [p for p in parts if not p.empty]
    if not parts:
        return pd.DataFrame({"time": frame["time"].iloc[0:0], "value": np.empty(0)})
    return pd.concat(parts, ignore_index=True).sort_values("time", kind="stable")


def _thin(frame: pd.DataFrame, max_times: int) -> pd.DataFrame:
    """Keep every k-th timestamp of a cumulative series so at most ``max_times`` remain: the
    increases between kept points are exact over k times longer intervals."""
    times = frame["time"].unique()
    if len(times) <= max_times:
        return frame
    step = -(-len(times) // max_times)
    return frame[frame["time"].isin(times[::step])]


def _p99(frame: pd.DataFrame) -> pd.DataFrame:
    """p99 per export interval (per rollup bucket; fewer, longer intervals past
    ``MAX_INTERVALS``) of each cumulative histogram series."""
    def one(group: pd.DataFrame) -> pd.DataFrame:
        thin = _thin(_cumulative(group), MAX_INTERVALS)
        series = p99_per_interval(thin[["time", "value", "le"]])
        return pd.DataFrame({"time": pd.to_datetime(series.index, utc=True),
                             "value": series.to_numpy(dtype=np.float64)})
    return _per_group(frame, ("le",), one)


def _ratio_of_increases(num: pd.DataFrame, den: pd.DataFrame) -> pd.DataFrame:
    """Per interval: increase of ``num`` / increase of ``den`` (cumulative series, same attrs)."""
    if num.empty or den.empty:
        return pd.DataFrame({"time": pd.Series([], dtype="datetime64[ns, UTC]"),
                             "value": np.empty(0)})
    keys = [k for k in _attr_columns(num) if k in den.columns]

    def deltas(frame: pd.DataFrame) -> pd.DataFrame:
        out = _per_group(frame, (), lambda g: interval_increases(
            _cumulative(g)[["time", "value"]]).rename(columns={"delta": "value"}).assign(
            **{k: g[k].iloc[0] for k in keys}))
        return out
    merged = pd.merge(deltas(num), deltas(den), on=["time", *keys], suffixes=("_n", "_d"))
    merged = merged[merged["value_d"] > 0]
    return pd.DataFrame({"time": merged["time"],
                         "value": merged["value_n"] / merged["value_d"]}).reset_index(drop=True)


@dataclass(frozen=True, kw_only=True)
class _PanelSpec:
    key: str
    title: str
    unit: str
    metrics: tuple[str, ...]
    host_level: bool = False
    line_keys: tuple[str, ...] = (RANK_ATTR,)
    kinds: tuple[str, ...] = ("train", "serve")
    """The job kinds the panel means something for."""


PANELS: tuple[_PanelSpec, ...] = (
    _PanelSpec(key="throughput", title="Throughput", unit="tokens/s",
               metrics=(TRAIN_TOKENS_PER_SECOND, SERVE_TOKENS_PER_SECOND)),
    _PanelSpec(key="p99_latency", title="p99 latency (step / request)", unit="s",
               metrics=(TRAIN_STEP_DURATION_BUCKET,
                        GEN_AI_SERVER_REQUEST_DURATION_BUCKET)),
    _PanelSpec(key="gpu_utilization", title="GPU utilisation", unit="fraction",
               metrics=(HW_GPU_UTILIZATION,), host_level=True,
               line_keys=(HOST_ATTR, ATTR_GPU_INDEX)),
    _PanelSpec(key="memory_bandwidth", title="Memory-bandwidth utilisation", unit="fraction",
               metrics=(HW_GPU_MEMORY_UTILIZATION, GPU_DRAM_ACTIVE),
               host_level=True, line_keys=(HOST_ATTR, ATTR_GPU_INDEX)),
    _PanelSpec(key="comm_share", title="Communication share of step time", unit="fraction",
               metrics=(COMM_ALLREDUCE_DURATION_SUM,
                        TRAIN_STEP_DURATION_SUM), kinds=("train",)),
    _PanelSpec(key="grad_norm", title="Gradient norm", unit="1",
               metrics=(TRAIN_GRAD_NORM,), kinds=("train",)),
    _PanelSpec(key="kv_bits", title="KV-cache bits", unit="bit",
               metrics=(SERVE_KV_CACHE_BITS,),
               line_keys=(RANK_ATTR, ATTR_SEEDANCE_KV_PART), kinds=("serve",)),
    _PanelSpec(key="cache_hit_rate", title="Prefix-cache hit rate", unit="fraction",
               metrics=(SERVE_PREFIX_CACHE_HITS, SERVE_PREFIX_CACHE_QUERIES,
                        SERVE_PREFIX_CACHE_HIT_RATIO), kinds=("serve",)),
)


class PanelReader:
    """Reads one job's series from the source over the range."""

    def __init__(self, source: StoreReader, job: str, since_ns: int, until_ns: int,
                 resolution: Resolution) -> None:
        self.source, self.job = source, job
        self.since_ns, self.until_ns, self.resolution = since_ns, until_ns, resolution
        self.hosts: list[str] | None = None

    def job_series(self, name: str) -> pd.DataFrame:
        return self.source.query(name, where={JOB_ATTR: self.job}, since_ns=self.since_ns,
                                 until_ns=self.until_ns, resolution=self.resolution)

    def host_series(self, name: str) -> pd.DataFrame:
        """A host-level series (GPUs) on the hosts the job's points name (all if none do)."""
        if not self.hosts:
            return self.source.query(name, since_ns=self.since_ns, until_ns=self.until_ns,
                                     resolution=self.resolution)
        frames = [self.source.query(name, where={HOST_ATTR: h}, since_ns=self.since_ns,
                                    until_ns=self.until_ns, resolution=self.resolution)
                  for h in self.hosts]
        return pd.concat(frames, ignore_index=True).sort_values("time", kind="stable")

    def panel(self, spec: _PanelSpec) -> Panel:
        read = self.host_series if spec.host_level else self.job_series
        frames = {name: read(name) for name in spec.metrics}
        if spec.key == "p99_latency":
            parts = [_p99(f).assign(of=name.split(".")[1])
                     for name, f in frames.items() if not f.empty]
            lines = (pd.concat([_lines(p, ("of",)) for p in parts], ignore_index=True)
                     if parts else _lines(next(iter(frames.values())), ()))
        elif spec.key == "comm_share":
            lines = _lines(_ratio_of_increases(*frames.values()), ())
        elif spec.key == "cache_hit_rate":
            hits, queries, ratio = frames.values()
            lines = _lines(_ratio_of_increases(hits, queries), ())
            if lines.empty:
                lines = _lines(ratio, (ATTR_GEN_AI_REQUEST_MODEL,))
        else:
            lines = pd.concat([_lines(f, spec.line_keys) for f in frames.values()],
                              ignore_index=True)
        replayed = not lines.empty and any(
            REPLAYED_ATTR in f.columns and (f[REPLAYED_ATTR] == "true").any()
            for f in frames.values())
        return Panel(key=spec.key, title=spec.title, unit=spec.unit, metrics=spec.metrics,
                     frame=lines, replayed=replayed)


def has_data(panel: Panel) -> bool:
    """A panel worth a plot: some finite value other than zero (all zeros say nothing)."""
    values = panel.frame["value"].to_numpy(dtype=np.float64)
    return bool((np.isfinite(values) & (values != 0)).any())


def weighted_by_version(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean of a gauge per config version, weighted by points (exact from rollups too)."""
    if frame.empty or CONFIG_VERSION_ATTR not in frame.columns:
        return pd.DataFrame({"version": pd.Series([], dtype="int64"),
                             "mean": np.empty(0), "points": pd.Series([], dtype="int64")})
    count = frame["count"] if "count" in frame.columns else pd.Series(1, index=frame.index)
    table = pd.DataFrame({"version": pd.to_numeric(frame[CONFIG_VERSION_ATTR]).astype("int64"),
                          "sum": frame["value"] * count, "points": count.astype("int64")})
    out = table.groupby("version", as_index=False)[["sum", "points"]].sum()
    out["mean"] = out["sum"] / out["points"]
    return out[["version", "mean", "points"]]


def active_hours(frame: pd.DataFrame, start_ns: int, end_ns: int) -> float:
    """Hours in [start, end) with at least one throughput point, counted in whole minutes."""
    if frame.empty or end_ns <= start_ns:
        return 0.0
    t = pd.DatetimeIndex(frame["time"]).asi8
    t = t[(t >= start_ns // (60 * NS) * 60 * NS) & (t < end_ns)]
    return float(np.unique(t // (60 * NS)).size) / 60.0


