"""Reading one config version's window from the store: steps, tokens/s and loss after
warm-up for a training job; requests, tokens/s, latency quantile and token agreement for a
serving one (docs/measurement.md derives them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pandas as pd

from collectors import StoreReader
from collectors.names import (
    ATTR_SEEDANCE_RANK,
    ATTR_SERVICE_NAME,
    GEN_AI_SERVER_REQUEST_DURATION,
    SERVE_GENERATION_TOKENS,
    TRAIN_LOSS,
    TRAIN_STEP_DURATION,
    TRAIN_STEP_LOSS_COUNT,
    TRAIN_STEP_LOSS_SUM,
    TRAIN_TOKENS,
    TRAIN_TOKENS_PER_SECOND,
)
from policies import histogram_quantile
from tuner._version_reader import VersionReader
from tuner._windows import Arm, JobKind, MeasureConfig, Window
from tuner.serving_guardrails import ServingGuardrailConfig, window_agreement

STEP_DURATION = TRAIN_STEP_DURATION
TOKENS_PER_SECOND = TRAIN_TOKENS_PER_SECOND
TOKENS = TRAIN_TOKENS
LOSS = TRAIN_LOSS
REQUEST_DURATION = GEN_AI_SERVER_REQUEST_DURATION
GENERATION_TOKENS = SERVE_GENERATION_TOKENS
JOB_ATTR = ATTR_SERVICE_NAME
RANK_ATTR = ATTR_SEEDANCE_RANK

_WHOLE_VERSION = ServingGuardrailConfig(series_start_in_window=True)
"""Token agreement as the keep rule reads it: a version's counters start with it."""


def _by_rank(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    if frame.empty:
        return {}
    if RANK_ATTR not in frame.columns:
        return {"0": frame}
    return {str(r): f for r, f in frame.groupby(frame[RANK_ATTR].astype(str))}


def _ns(frame: pd.DataFrame) -> np.ndarray:
    return pd.DatetimeIndex(frame["time"]).asi8


def measure_window(reader: StoreReader, job: str, version: int, arm: Arm,
                   config: MeasureConfig, kind: JobKind = "train") -> Window | None:
    """The version's window after warm-up, or None while it is not long enough yet: less than
    ``min_window_s`` of steps, or fewer than ``min_steps`` steps and less than
    ``max_window_s`` of them (a config much slower than the one the window was sized by still
    ends in bounded time); a serving job's: fewer than ``min_requests``."""
    if kind == "serve":
        return measure_serving_window(reader, job, version, arm, config)
    points = VersionReader(reader, job, version)
    counts = _by_rank(points.query(STEP_DURATION + ".count"))
    sums = _by_rank(points.query(STEP_DURATION + ".sum"))
    tokens = _by_rank(points.query(TOKENS))
    if not counts or set(counts) != set(sums):
        return None
    step_s, steps, cvs, rates = [], [], [], []
    spans: dict[str, tuple[int, int]] = {}  # rank -> (warm-up boundary, last export)
    for rank, c in counts.items():
        both = pd.merge(c[["time", "value"]], sums[rank][["time", "value"]], on="time",
                        suffixes=("_count", "_sum")).sort_values("time")
        if rank in tokens:
            both = pd.merge(both, tokens[rank][["time", "value"]].rename(
                columns={"value": "value_tokens"}), on="time", how="left")
        count = both["value_count"].to_numpy()
        total = both["value_sum"].to_numpy()
        reached = np.flatnonzero(count >= config.warmup_steps)
        if reached.size == 0:
            return None
        w = int(reached[0])
        n = count[-1] - count[w]
        seconds = total[-1] - total[w]
        if n < 1 or seconds < config.min_window_s or (n < config.min_steps
                                                      and seconds < config.max_window_s):
            return None
        times = _ns(both)
        spans[rank] = (int(times[w]), int(times[-1]))
        step_s.append(seconds / n)
        steps.append(int(n))
        cvs.append(_step_cv(np.diff(count[w:]), np.diff(total[w:])))
        if "value_tokens" in both.columns:
            counted = both["value_tokens"].to_numpy()
            if np.isfinite(counted[w]) and np.isfinite(counted[-1]):
                rates.append((counted[-1] - counted[w]) / seconds)
    start_ns = max(start for start, _ in spans.values())
    end_ns = min(end for _, end in spans.values())
    if len(rates) == len(counts):
        tokens_per_s = float(sum(rates))  # exact: the job's own tokens over its own seconds
    elif config.tokens_per_step is not None:
        tokens_per_s = config.tokens_per_step / max(step_s)
    else:
        tokens_per_s = 0.0
        for frame in _by_rank(points.query(TOKENS_PER_SECOND)).values():
            values = frame["value"].to_numpy()[_ns(frame) > start_ns]
            values = values[values > 0]
            if values.size == 0:
                return None
            tokens_per_s += float(values.size / np.sum(1.0 / values))
    loss_frame = points.query(LOSS)
    loss_values = loss_frame["value"].to_numpy()
    loss = _steps_loss(points, spans)
    if loss is None:  # a client without the step_loss histogram: the gauge's readings
        after = loss_values[_ns(loss_frame) > start_ns] if len(loss_frame) else loss_values
        finite = after[np.isfinite(after)]
        loss = float(finite.mean()) if finite.size else math.nan
    return Window(version=version, arm=arm, steps=min(steps), step_s=float(max(step_s)),
                  tokens_per_s=float(tokens_per_s), loss=loss,
                  nonfinite_loss=bool(np.any(~np.isfinite(loss_values))),
                  start_ns=start_ns, end_ns=end_ns, step_cv=float(max(cvs)))


def _steps_loss(points: VersionReader, spans: dict[str, tuple[int, int]]) -> float | None:
    """The mean loss of the window's steps, over every rank: the step_loss histogram's sum
    over its count between each rank's warm-up boundary and last export (``spans``); None
    where a rank has none in the window (a client from before it).

    The loss gauge holds the last step's loss at each export: two or three single steps for
    a 2-s window, each as noisy as its mini-batch, and early in training that noise ended
    trials of harmless changes on the loss guardrail (``bench/loss_guard.py``)."""
    counts = _by_rank(points.query(TRAIN_STEP_LOSS_COUNT))
    sums = _by_rank(points.query(TRAIN_STEP_LOSS_SUM))
    total = n = 0.0
    for rank, (start, end) in spans.items():
        if rank not in counts or rank not in sums:
            return None
        both = pd.merge(counts[rank][["time", "value"]], sums[rank][["time", "value"]],
                        on="time", suffixes=("_count", "_sum")).sort_values("time")
        at = _ns(both)
        before = np.flatnonzero(at <= start)  # the version's counters start at 0
        last = np.flatnonzero(at <= end)
        if last.size == 0:
            return None
        first_count, first_sum = ((both["value_count"].iloc[before[-1]],
                                   both["value_sum"].iloc[before[-1]]) if before.size
                                  else (0.0, 0.0))
        n += float(both["value_count"].iloc[last[-1]] - first_count)
        total += float(both["value_sum"].iloc[last[-1]] - first_sum)
    return total / n if n > 0 else None


def _step_cv(steps: np.ndarray, seconds: np.ndarray) -> float:
    """Coefficient of variation of one step's time, from export blocks of ``steps`` steps
    taking ``seconds``: a block of n steps has variance n sigma^2, so sigma^2 is estimated by
    sum((t_i - n_i mu)^2 / n_i) / (blocks - 1). NaN with fewer than two blocks."""
    keep = steps > 0
    steps, seconds = steps[keep], seconds[keep]
    if steps.size < 2 or seconds.sum() <= 0:
        return math.nan
    mu = seconds.sum() / steps.sum()
    var = float(np.sum((seconds - steps * mu) ** 2 / steps) / (steps.size - 1))
    return math.sqrt(var) / mu


def window_config(windows: Sequence[Window], config: MeasureConfig) -> MeasureConfig:
    """``config`` with ``min_steps`` sized to the job: enough steps that a window's mean step
    time has a coefficient of variation near ``window_cv`` given the step-time noise the
    windows so far measured, at most ``max_window_s`` of them at the measured step time (and
    ``measure_window`` ends a window at ``max_window_s`` whatever its steps)."""
    measured = [w for w in windows if math.isfinite(w.step_cv) and w.step_s > 0]
    if not measured:
        return config
    cv = float(np.median([w.step_cv for w in measured]))
    step_s = float(np.median([w.step_s for w in measured]))
    wanted = math.ceil((cv / config.window_cv) ** 2)
    most = max(config.min_steps, math.floor(config.max_window_s / step_s))
    return replace(config, min_steps=int(min(max(config.min_steps, wanted), most)))


def measure_serving_window(reader: StoreReader, job: str, version: int, arm: Arm,
                           config: MeasureConfig) -> Window | None:
    """A serving version's window after ``warmup_requests`` (module docstring), or None while
    it has fewer than ``min_requests`` or a replica has no export after its warm-up."""
    points = VersionReader(reader, job, version)
    counts = _by_rank(points.query(REQUEST_DURATION + ".count"))
    tokens = _by_rank(points.query(GENERATION_TOKENS))
    buckets = _by_rank(points.query(REQUEST_DURATION + ".bucket"))
    if not counts or not set(counts) <= set(tokens) or not set(counts) <= set(buckets):
        return None
    requests, requests_per_s, tokens_per_s, starts, ends = 0, 0.0, 0.0, [], []
    merged: dict[float, float] = {}
    for rank, c in counts.items():
        both = pd.merge(c[["time", "value"]], tokens[rank][["time", "value"]], on="time",
                        suffixes=("_count", "_tokens")).sort_values("time")
        count = both["value_count"].to_numpy()
        reached = np.flatnonzero(count >= config.warmup_requests)
        if reached.size == 0 or reached[0] == len(count) - 1:
            return None
        w, times = int(reached[0]), _ns(both)
        generated = both["value_tokens"].to_numpy()
        elapsed_s = (times[-1] - times[w]) / 1e9
        requests += int(count[-1] - count[w])
        requests_per_s += float(count[-1] - count[w]) / elapsed_s
        tokens_per_s += float(generated[-1] - generated[w]) / elapsed_s
        starts.append(int(times[w]))
        ends.append(int(times[-1]))
        for le, by_le in buckets[rank].groupby("le"):
            values, stamps = by_le["value"].to_numpy(), _ns(by_le)
            start = values[stamps == times[w]]
            end = values[stamps == times[-1]]
            if start.size and end.size:
                merged[float(le)] = merged.get(float(le), 0.0) + float(end[-1] - start[-1])
    if requests < config.min_requests:
        return None
    start_ns, end_ns = max(starts), min(ends)
    # quality does not warm up: the whole version's (its series start with it)
    quality = window_agreement(points, _WHOLE_VERSION)
    return Window(version=version, arm=arm, steps=requests, step_s=1.0 / requests_per_s,
                  tokens_per_s=tokens_per_s, loss=math.nan, nonfinite_loss=False,
                  start_ns=start_ns, end_ns=end_ns,
                  p99_s=histogram_quantile(config.latency_quantile, merged),
                  quality=math.nan if quality is None else quality.agreement,
                  quality_tokens=0 if quality is None else quality.tokens)
