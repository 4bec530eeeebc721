"""Honest live measurement: throughput and loss of one config version, and A/B comparisons.

Every point a job emits carries the config version in force (``seedance.config.version``), and
every apply gets a fresh version, so a window is selected by version alone and never straddles
a switch.

Throughput of a window (``measure_window``): read the version's cumulative step-duration
histogram (``seedance.train.step.duration.count`` / ``.sum``) and token counter, one series
per rank. Warm-up is
excluded exactly so: on each rank, the export point at which the version's cumulative step
count first reaches ``warmup_steps`` is the window's start; every step counted up to and
including that export (at least ``warmup_steps``, a few more when exports are sparser than
steps) is dropped, and the window is (count_end - count_start) steps taking
(sum_end - sum_start) seconds of step time. The job's step time is the slowest rank's mean
(ranks wait for each other), and tokens/s = ``tokens_per_step / step_s``. When the job's
tokens per step is unknown, tokens/s is the sum over ranks of the harmonic mean of the
``seedance.train.tokens_per_second`` gauge points after the start (each point is one step's
tokens / wall time, so their harmonic mean is tokens over time). Loss: the mean of the
``seedance.train.loss`` points after the start; any non-finite loss of the version (warm-up
included) is reported.

Serving (``measure_window(..., kind="serve")``): the version's cumulative request-duration
histogram (``gen_ai.server.request.duration``) and generated-token counter
(``seedance.serve.generation_tokens``), one series per replica. Warm-up is excluded the same
way, in requests: the export at which the version's finished requests first reach
``warmup_requests`` starts the window (a prefix cache refills after a switch, so the default
warm-up is longer than a training one). Throughput is generated tokens/s, (tokens_end -
tokens_start) / (export time_end - time_start) summed over replicas; the latency quantile
(``latency_quantile``, p99) is ``histogram_quantile`` over the bucket counts finished inside the
window, merged over replicas; quality is the token agreement of the whole version (config
does not warm up in quality): agreeing over checked tokens from the job's token counters
(``seedance.serve.quality.checked_tokens`` / ``.agreeing_tokens``), or, from senders with only
the gauge, the mean ``seedance.serve.quality.token_agreement`` after the start. A serving window has no loss (NaN): ``compare`` judges tokens/s, and a
candidate whose mean p99 is more than ``latency_tolerance`` above its baselines' is not kept
(tokens/s bought with tail latency is no gain). The absolute p99 SLO and the quality bound are
guardrails (``tuner.serving_guardrails``); the quality bound is on by default. The guardrail
ends a trial early on agreement measured below the bound; the keep rule
(``min_token_agreement``) holds the candidate's agreement over all its windows' checked tokens
to the bound, so what is kept is within it on the most evidence the trial has.

Tokens/s is exact and needs no configuration: the job counts the tokens of every step
(``seedance.train.tokens``, cumulative per version, from ``session.step(tokens=...)``), so a
window's tokens/s is its tokens over its step seconds. Older senders without the counter fall
back to ``tokens_per_step`` or the per-step gauge. A window is ready once it has
``min_steps`` steps AND ``min_window_s`` seconds of them after warm-up; the controller sizes
``min_steps`` to the job (``window_config``): from the step-time noise the windows measured
(each export is a block of steps, so the blocks' spread estimates one step's), enough steps
that a window's mean has a coefficient of variation near ``window_cv``, at most
``max_window_s``.

Comparison (``compare``): windows alternate C B C B ... (the controller sends the candidate
first, so an approved change reaches the job at once), each a fresh version. Each candidate
window is paired with the mean of its neighbouring baseline windows (drift cancels), giving
log gains d_i = log(C_i / B_i). The interval of mean(d) is an anytime-valid confidence
sequence (``confidence_sequence``): the controller looks at it after every pair and stops as
soon as it decides, so looking often does not inflate errors the way a t interval re-tested
after each pair would (Student's t and the bootstrap stay as options for comparison). Gains
are reported as exp(.) - 1. A change is kept only when the interval excludes zero from above.
Loss guardrail: a training job's loss falls while it is measured, so each candidate's
mean loss is judged against the baseline's trajectory, the least-squares line through the
baseline windows' (mid-time, mean loss), at the candidate window's mid-time; the candidates'
mean excess over it may be at most ``loss_tolerance`` (relative; a mean, since one short
window's loss is noisy). It is judged once two baseline windows give a line (a
single later baseline window would make the first candidate look worse by the fall between
them); a non-finite loss fails at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import pandas as pd
from scipy import stats

from collectors import CONFIG_VERSION_ATTR, ConfigError, StoreReader
from policies import histogram_quantile

STEP_DURATION = "seedance.train.step.duration"
TOKENS_PER_SECOND = "seedance.train.tokens_per_second"
TOKENS = "seedance.train.tokens"
LOSS = "seedance.train.loss"
NONFINITE_STEPS = "seedance.train.nonfinite_steps"
NONFINITE_WHAT = "seedance.nonfinite.what"
REQUEST_DURATION = "gen_ai.server.request.duration"
GENERATION_TOKENS = "seedance.serve.generation_tokens"
TOKEN_AGREEMENT = "seedance.serve.quality.token_agreement"
CHECKED_TOKENS = "seedance.serve.quality.checked_tokens"
AGREEING_TOKENS = "seedance.serve.quality.agreeing_tokens"
JOB_ATTR = "service.name"
RANK_ATTR = "seedance.rank"

Arm = Literal["baseline", "candidate"]
JobKind = Literal["train", "serve"]


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    """How windows are measured and compared."""

    warmup_steps: int = 1
    min_steps: int = 3
    min_window_s: float = 2.0
    max_window_s: float = 30.0
    window_cv: float = 0.05
    tokens_per_step: float | None = None
    confidence: float = 0.95
    interval: Literal["sequential", "t", "bootstrap"] = "sequential"
    planned_pairs: int = 8
    noise_floor: float = 0.02
    n_bootstrap: int = 4000
    loss_tolerance: float = 0.05
    latency_tolerance: float = 0.10
    seed: int = 0
    warmup_requests: int = 30
    min_requests: int = 60
    latency_quantile: float = 0.99
    min_token_agreement: float | None = None
    """A serving candidate is kept only with its agreement over all its windows at least this."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"MeasureConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.min_steps < 1:
            raise ConfigError(f"MeasureConfig.min_steps must be >= 1, got {self.min_steps}")
        if not 0 < self.min_window_s <= self.max_window_s:
            raise ConfigError(f"MeasureConfig.min_window_s must be > 0 and <= max_window_s, "
                             f"got {self.min_window_s} and {self.max_window_s}")
        if not self.window_cv > 0:
            raise ConfigError(f"MeasureConfig.window_cv must be > 0, got {self.window_cv}")
        if self.planned_pairs < 1:
            raise ConfigError(f"MeasureConfig.planned_pairs must be >= 1, "
                             f"got {self.planned_pairs}")
        if not self.noise_floor > 0:
            raise ConfigError(f"MeasureConfig.noise_floor must be > 0, got {self.noise_floor}")
        if self.tokens_per_step is not None and not self.tokens_per_step > 0:
            raise ConfigError("MeasureConfig.tokens_per_step must be > 0")
        if not 0.5 < self.confidence < 1:
            raise ConfigError(f"MeasureConfig.confidence must be in (0.5, 1), "
                             f"got {self.confidence}")
        if self.interval not in ("sequential", "t", "bootstrap"):
            raise ConfigError(f"MeasureConfig.interval must be sequential, t or bootstrap, "
                             f"got {self.interval!r}")
        if self.n_bootstrap < 100:
            raise ConfigError("MeasureConfig.n_bootstrap must be >= 100")
        if self.loss_tolerance < 0:
            raise ConfigError("MeasureConfig.loss_tolerance must be >= 0")
        if self.latency_tolerance < 0:
            raise ConfigError("MeasureConfig.latency_tolerance must be >= 0")
        if self.warmup_requests < 0:
            raise ConfigError(f"MeasureConfig.warmup_requests must be >= 0, "
                             f"got {self.warmup_requests}")
        if self.min_requests < 1:
            raise ConfigError(f"MeasureConfig.min_requests must be >= 1, got {self.min_requests}")
        if not 0 < self.latency_quantile < 1:
            raise ConfigError(f"MeasureConfig.latency_quantile must be in (0, 1), "
                             f"got {self.latency_quantile}")
        if self.min_token_agreement is not None and not 0 <= self.min_token_agreement <= 1:
            raise ConfigError(f"MeasureConfig.min_token_agreement must be in [0, 1], "
                             f"got {self.min_token_agreement}")


@dataclass(frozen=True, kw_only=True)
class Window:
    """What one version measured after its warm-up. Training: ``steps`` optimizer steps of
    ``step_s``. Serving: ``steps`` finished requests, ``step_s`` seconds per finished request,
    ``p99_s`` the latency quantile and ``quality`` the token agreement (NaN without points)
    over ``quality_tokens`` checked tokens (0: from the gauge, count unknown);
    ``loss`` is NaN."""

    version: int
    arm: Arm
    steps: int
    step_s: float
    tokens_per_s: float
    loss: float
    nonfinite_loss: bool
    start_ns: int
    end_ns: int
    p99_s: float = math.nan
    quality: float = math.nan
    quality_tokens: int = 0
    step_cv: float = math.nan

    def to_json(self) -> dict[str, Any]:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                for k, v in self.__dict__.items()}


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Candidate against baseline over paired windows; gains are relative (0.1 = +10%)."""

    pairs: int
    gain: float
    ci_low: float
    ci_high: float
    confidence: float
    loss_excess: float
    loss_ok: bool
    latency_excess: float = math.nan
    latency_ok: bool = True
    pair_ratios: tuple[float, ...] = ()
    """Each pair's candidate/baseline tokens/s (what a harm bound reads, not a test)."""
    quality: float = math.nan
    """The candidate's token agreement pooled over its windows (NaN: not measured)."""
    quality_tokens: int = 0
    quality_ok: bool = True

    @property
    def improves(self) -> bool:
        """The interval excludes zero from above: a measured gain."""
        return self.pairs > 0 and self.ci_low > 0

    @property
    def regresses(self) -> bool:
        """The interval excludes zero from below: a measured loss of throughput."""
        return self.pairs > 0 and self.ci_high < 0

    def to_json(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "gain": self.gain, "ci_low": self.ci_low,
                "ci_high": self.ci_high, "width": self.ci_high - self.ci_low,
                "confidence": self.confidence,
                "loss_excess": self.loss_excess, "loss_ok": self.loss_ok,
                "latency_excess": self.latency_excess, "latency_ok": self.latency_ok,
                "quality": self.quality, "quality_tokens": self.quality_tokens,
                "quality_ok": self.quality_ok, "pair_ratios": list(self.pair_ratios)}


def _by_rank(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    if frame.empty:
        return {}
    if RANK_ATTR not in frame.columns:
        return {"0": frame}
    return {str(r): f for r, f in frame.groupby(frame[RANK_ATTR].astype(str))}


def _ns(frame: pd.DataFrame) -> np.ndarray:
    return pd.DatetimeIndex(frame["time"]).asi8


def version_points(reader: StoreReader, name: str, job: str, version: int) -> pd.DataFrame:
    """Raw points of ``name`` the job emitted under ``version``."""
    return reader.query(name, where={JOB_ATTR: job, CONFIG_VERSION_ATTR: str(version)},
                        resolution="raw")


def measure_window(reader: StoreReader, job: str, version: int, arm: Arm,
                   config: MeasureConfig, kind: JobKind = "train") -> Window | None:
    """The version's window after warm-up, or None while it is not long enough yet: less than
    ``min_window_s`` of steps, or fewer than ``min_steps`` steps and less than
    ``max_window_s`` of them (a config much slower than the one the window was sized by still
    ends in bounded time); a serving job's: fewer than ``min_requests``."""
    if kind == "serve":
        return measure_serving_window(reader, job, version, arm, config)
    counts = _by_rank(version_points(reader, STEP_DURATION + ".count", job, version))
    sums = _by_rank(version_points(reader, STEP_DURATION + ".sum", job, version))
    tokens = _by_rank(version_points(reader, TOKENS, job, version))
    if not counts or set(counts) != set(sums):
        return None
    step_s, steps, starts, ends, cvs, rates = [], [], [], [], [], []
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
        step_s.append(seconds / n)
        steps.append(int(n))
        starts.append(int(times[w]))
        ends.append(int(times[-1]))
        cvs.append(_step_cv(np.diff(count[w:]), np.diff(total[w:])))
        if "value_tokens" in both.columns:
            counted = both["value_tokens"].to_numpy()
            if np.isfinite(counted[w]) and np.isfinite(counted[-1]):
                rates.append((counted[-1] - counted[w]) / seconds)
    start_ns, end_ns = max(starts), min(ends)
    if len(rates) == len(counts):
        tokens_per_s = float(sum(rates))  # exact: the job's own tokens over its own seconds
    elif config.tokens_per_step is not None:
        tokens_per_s = config.tokens_per_step / max(step_s)
    else:
        tokens_per_s = 0.0
        for frame in _by_rank(version_points(reader, TOKENS_PER_SECOND, job, version)).values():
            values = frame["value"].to_numpy()[_ns(frame) > start_ns]
            values = values[values > 0]
            if values.size == 0:
                return None
            tokens_per_s += float(values.size / np.sum(1.0 / values))
    loss_frame = version_points(reader, LOSS, job, version)
    loss_values = loss_frame["value"].to_numpy()
    after = loss_values[_ns(loss_frame) > start_ns] if len(loss_frame) else loss_values
    finite = after[np.isfinite(after)]
    return Window(version=version, arm=arm, steps=min(steps), step_s=float(max(step_s)),
                  tokens_per_s=float(tokens_per_s),
                  loss=float(finite.mean()) if finite.size else math.nan,
                  nonfinite_loss=bool(np.any(~np.isfinite(loss_values))),
                  start_ns=start_ns, end_ns=end_ns, step_cv=float(max(cvs)))


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
    counts = _by_rank(version_points(reader, REQUEST_DURATION + ".count", job, version))
    tokens = _by_rank(version_points(reader, GENERATION_TOKENS, job, version))
    buckets = _by_rank(version_points(reader, REQUEST_DURATION + ".bucket", job, version))
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
    quality, quality_tokens = _version_agreement(reader, job, version, start_ns)
    return Window(version=version, arm=arm, steps=requests, step_s=1.0 / requests_per_s,
                  tokens_per_s=tokens_per_s, loss=math.nan, nonfinite_loss=False,
                  start_ns=start_ns, end_ns=end_ns,
                  p99_s=histogram_quantile(config.latency_quantile, merged),
                  quality=quality, quality_tokens=quality_tokens)


def _version_agreement(reader: StoreReader, job: str, version: int, start_ns: int
                       ) -> tuple[float, int]:
    """(token agreement, checked tokens) of the version: its token counters' last values
    summed over replicas (a version's series start with it); without them the gauge's mean
    after ``start_ns`` and 0 tokens; NaN without either."""
    checked = _by_rank(version_points(reader, CHECKED_TOKENS, job, version))
    if checked:
        agreeing = _by_rank(version_points(reader, AGREEING_TOKENS, job, version))
        n = sum(int(f.sort_values("time")["value"].iloc[-1]) for f in checked.values())
        k = sum(int(f.sort_values("time")["value"].iloc[-1]) for f in agreeing.values())
        if n > 0:
            return min(k, n) / n, n
    gauge = version_points(reader, TOKEN_AGREEMENT, job, version)
    after = gauge["value"].to_numpy()[_ns(gauge) > start_ns] if len(gauge) else np.array([])
    return (float(after.mean()) if after.size else math.nan), 0


def nonfinite_loss(reader: StoreReader, job: str, version: int) -> bool:
    """Whether the version saw a NaN or infinite loss (a guardrail).

    The job's counter of non-finite steps is the signal that reaches the store (OpenTelemetry
    drops non-finite gauge values); a non-finite loss point is honoured too, for other senders.
    """
    steps = version_points(reader, NONFINITE_STEPS, job, version)
    if not steps.empty and NONFINITE_WHAT in steps.columns:
        if bool((steps.loc[steps[NONFINITE_WHAT] == "loss", "value"] > 0).any()):
            return True
    values = version_points(reader, LOSS, job, version)["value"].to_numpy()
    return bool(np.any(~np.isfinite(values)))


def _neighbour_baselines(windows: Sequence[Window]) -> list[tuple[Window, list[Window]]]:
    pairs = []
    for i, w in enumerate(windows):
        if w.arm != "candidate":
            continue
        around = [windows[j] for j in (i - 1, i + 1)
                  if 0 <= j < len(windows) and windows[j].arm == "baseline"]
        if around:
            pairs.append((w, around))
    return pairs


def compare(windows: Sequence[Window], config: MeasureConfig) -> Comparison:
    """Paired gains of candidate windows over their neighbouring baseline windows."""
    pairs = _neighbour_baselines(windows)
    if not pairs:
        return Comparison(pairs=0, gain=math.nan, ci_low=math.nan, ci_high=math.nan,
                          confidence=config.confidence, loss_excess=math.nan, loss_ok=True)
    log_gains = np.array([math.log(c.tokens_per_s / np.mean([b.tokens_per_s for b in bs]))
                          for c, bs in pairs])
    low, high = _interval(log_gains, config)
    trajectory = _baseline_loss_trajectory(windows)
    excess = []
    for c, _ in pairs:
        base = trajectory(_mid_s(c)) if trajectory is not None else math.nan
        if math.isfinite(c.loss) and math.isfinite(base):
            excess.append((c.loss - base) / abs(base) if base else c.loss - base)
    worst = float(np.mean(excess)) if excess else math.nan
    nonfinite = any(c.nonfinite_loss for c, _ in pairs)
    loss_ok = not nonfinite and (not excess or worst <= config.loss_tolerance)
    latency = _latency_excess(pairs)
    quality, quality_tokens = _pooled_quality([c for c, _ in pairs])
    bound = config.min_token_agreement
    return Comparison(pairs=len(pairs), gain=math.expm1(float(log_gains.mean())),
                      ci_low=math.expm1(low), ci_high=math.expm1(high),
                      confidence=config.confidence, loss_excess=float(worst), loss_ok=loss_ok,
                      latency_excess=latency,
                      latency_ok=not latency > config.latency_tolerance,
                      pair_ratios=tuple(float(r) for r in np.exp(log_gains)),
                      quality=quality, quality_tokens=quality_tokens,
                      quality_ok=bound is None or not quality < bound)


def _pooled_quality(candidates: Sequence[Window]) -> tuple[float, int]:
    """(agreement, checked tokens) over the candidate windows: agreeing over checked tokens
    where the windows counted them, else the mean of the windows' gauge readings; NaN
    without any."""
    counted = [w for w in candidates if w.quality_tokens > 0 and math.isfinite(w.quality)]
    if counted:
        tokens = sum(w.quality_tokens for w in counted)
        return sum(w.quality * w.quality_tokens for w in counted) / tokens, tokens
    read = [w.quality for w in candidates if math.isfinite(w.quality)]
    return (float(np.mean(read)) if read else math.nan), 0


def _latency_excess(pairs: Sequence[tuple[Window, list[Window]]]) -> float:
    """How much higher the candidates' mean latency quantile is than their baselines'
    (relative); NaN without serving windows. Tokens/s is what the search maximises, so
    without this a change that trades tail latency for throughput could be kept."""
    ratios = []
    for c, bs in pairs:
        base = [b.p99_s for b in bs if math.isfinite(b.p99_s) and b.p99_s > 0]
        if math.isfinite(c.p99_s) and base:
            ratios.append(c.p99_s / float(np.mean(base)))
    return float(np.mean(ratios)) - 1 if ratios else math.nan


def _mid_s(window: Window) -> float:
    return (window.start_ns + window.end_ns) / 2e9


def _baseline_loss_trajectory(windows: Sequence[Window]) -> Callable[[float], float] | None:
    """The baseline's loss as a line in time through its windows' means; None with fewer than
    two baseline windows of finite loss."""
    points = [(_mid_s(w), w.loss) for w in windows
              if w.arm == "baseline" and math.isfinite(w.loss)]
    if len(points) < 2:
        return None
    t = np.array([p[0] for p in points])
    t0 = float(t.mean())
    slope, intercept = np.polyfit(t - t0, [p[1] for p in points], 1)
    return lambda at_s: float(intercept + slope * (at_s - t0))


def _interval(log_gains: np.ndarray, config: MeasureConfig) -> tuple[float, float]:
    """Two-sided interval of the mean log gain (module docstring): the anytime-valid
    sequence (default), Student's t or the percentile bootstrap (fixed-sample, for
    comparison in the bench)."""
    alpha = 1 - config.confidence
    if config.interval == "sequential":
        return confidence_sequence(log_gains, alpha=alpha, planned=config.planned_pairs,
                                   noise_floor=config.noise_floor)
    if config.interval == "bootstrap":
        rng = np.random.default_rng(config.seed)
        means = rng.choice(log_gains, size=(config.n_bootstrap, log_gains.size)).mean(axis=1)
        low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
        return float(low), float(high)
    if log_gains.size < 2:
        return -math.inf, math.inf
    half = (float(stats.t.ppf(1 - alpha / 2, log_gains.size - 1))
            * float(log_gains.std(ddof=1)) / math.sqrt(log_gains.size))
    return float(log_gains.mean()) - half, float(log_gains.mean()) + half


def confidence_sequence(x: np.ndarray, *, alpha: float, planned: int,
                        noise_floor: float) -> tuple[float, float]:
    """A (1 - alpha) confidence sequence for the mean of ``x`` at its current length.

    The Gaussian-mixture boundary of the asymptotic confidence sequence (Waudby-Smith,
    Arbour, Sinha, Kennedy and Ramdas, "Time-uniform central limit theory and asymptotic
    confidence sequences", 2021, Theorem 2.2): mean +- sqrt(2 (t s^2 rho^2 + 1) / (t^2 rho^2)
    * log(sqrt(t s^2 rho^2 + 1) / alpha)), with rho^2 = c / (planned s^2) so the sequence is
    tightest near ``planned`` samples (c = -2 log alpha + log(1 - 2 log alpha)). It may be
    looked at after every sample and stopped at any time. The theorem's plug-in standard
    deviation is only right for many samples; with a handful of pairs the sample one is often
    far too small and a run of lucky pairs would decide. So s is the upper 80% confidence bound
    of the standard deviation (chi-square, t - 1 degrees of freedom), never below
    ``noise_floor``. Simulated with drift and heavy-tailed noise (tests/tuner/test_measure.py),
    this keeps a null change in about 2-3% of trials.
    """
    t = x.size
    if t == 0:
        return -math.inf, math.inf
    s = noise_floor
    if t > 1:
        upper = float(x.std(ddof=1)) * math.sqrt((t - 1) / float(stats.chi2.ppf(0.2, t - 1)))
        s = max(upper, noise_floor)
    c = -2 * math.log(alpha) + math.log(1 - 2 * math.log(alpha))
    rho2 = c / (planned * s * s)
    v = t * s * s * rho2
    half = math.sqrt(2 * (v + 1) / (t * t * rho2) * math.log(math.sqrt(v + 1) / alpha))
    mean = float(x.mean())
    return mean - half, mean + half


def windows_from_json(rows: Sequence[Mapping[str, Any]]) -> list[Window]:
    """Windows as ``Window.to_json`` wrote them (the rollout journal stores them so)."""
    return [Window(version=int(r["version"]), arm=r["arm"], steps=int(r["steps"]),
                   step_s=float(r["step_s"]), tokens_per_s=float(r["tokens_per_s"]),
                   loss=float(r["loss"]), nonfinite_loss=bool(r["nonfinite_loss"]),
                   start_ns=int(r["start_ns"]), end_ns=int(r["end_ns"]),
                   p99_s=float(r.get("p99_s", math.nan)),
                   quality=float(r.get("quality", math.nan)),
                   quality_tokens=int(r.get("quality_tokens", 0)),
                   step_cv=float(r.get("step_cv", math.nan))) for r in rows]
