"""The A/B comparison: each candidate window against its neighbouring baselines, an
anytime-valid confidence sequence of the gain, and the loss, latency and quality checks that
ride along (docs/measurement.md derives them)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import chdtri, stdtrit  # scipy.stats costs a sidecar 47 MiB more

from tuner._windows import Comparison, MeasureConfig, Window


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


def compare(windows: Sequence[Window], config: MeasureConfig,
            earlier: Sequence[float] = ()) -> Comparison:
    """Paired gains of candidate windows over their neighbouring baseline windows; the gain
    and its interval pool ``earlier`` pair ratios (an undecided trial of the same candidate
    against the same baseline: the confidence sequence may be continued at any time), the
    guardrails' numbers are this trial's own."""
    pairs = _neighbour_baselines(windows)
    if not pairs:
        return Comparison(pairs=0, gain=math.nan, ci_low=math.nan, ci_high=math.nan,
                          confidence=config.confidence, loss_excess=math.nan, loss_ok=True)
    log_gains = np.array([math.log(c.tokens_per_s / np.mean([b.tokens_per_s for b in bs]))
                          for c, bs in pairs])
    pooled = np.concatenate([np.log(np.asarray(earlier, dtype=float)), log_gains])
    low, high = _interval(pooled, config)
    excess = _loss_excess([c for c, _ in pairs], windows)
    worst = float(np.mean(excess)) if excess else math.nan
    nonfinite = any(c.nonfinite_loss for c, _ in pairs)
    loss_ok = not nonfinite and (not excess or worst <= config.loss_tolerance)
    latency = _latency_excess(pairs)
    quality, quality_tokens = _pooled_quality([c for c, _ in pairs])
    bound = config.min_token_agreement
    return Comparison(pairs=len(pairs), gain=math.expm1(float(pooled.mean())),
                      ci_low=math.expm1(low), ci_high=math.expm1(high),
                      confidence=config.confidence, loss_excess=float(worst), loss_ok=loss_ok,
                      latency_excess=latency,
                      latency_ok=not latency > config.latency_tolerance,
                      pair_ratios=tuple(float(r) for r in np.exp(log_gains)),
                      quality=quality, quality_tokens=quality_tokens,
                      quality_ok=bound is None or not quality < bound,
                      earlier_pairs=len(earlier))


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
    """How much higher the candidates' latency quantile is than their baselines' (relative),
    the median over the pairs; NaN without serving windows. Tokens/s is what the search
    maximises, so without this a change that trades tail latency for throughput could be
    kept. The median: a change's tail shows in most of its pairs, while a neighbour's burst
    doubles one window's p99 (its few slowest requests), which the mean carried to the end."""
    ratios = []
    for c, bs in pairs:
        base = [b.p99_s for b in bs if math.isfinite(b.p99_s) and b.p99_s > 0]
        if math.isfinite(c.p99_s) and base:
            ratios.append(c.p99_s / float(np.mean(base)))
    return float(np.median(ratios)) - 1 if ratios else math.nan


def _mid_s(window: Window) -> float:
    return (window.start_ns + window.end_ns) / 2e9


def _loss_excess(candidates: Sequence[Window], windows: Sequence[Window]) -> list[float]:
    """Each candidate's relative loss above the baseline's trajectory at its mid-time, for
    the candidates that baseline windows bracket in time. The trajectory is the line between
    the baseline windows just before and just after it: early in training the loss falls
    fast and bends, and a line through all baseline windows lies below the curve at the
    first candidate (which runs before any baseline window) and above it between them. In
    ``bench/loss_guard.py`` the first ended A/A trials of a ViT at +8.6%, and the second hid
    10% of an LSTM's loss; between neighbours it errs by the bend of one gap."""
    points = sorted((_mid_s(w), w.loss) for w in windows
                    if w.arm == "baseline" and math.isfinite(w.loss))
    if len(points) < 2:
        return []
    at = np.array([p[0] for p in points])
    loss = np.array([p[1] for p in points])
    excess = []
    for c in candidates:
        mid = _mid_s(c)
        if at[0] <= mid <= at[-1] and math.isfinite(c.loss):
            base = float(np.interp(mid, at, loss))
            excess.append((c.loss - base) / abs(base) if base else c.loss - base)
    return excess


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
    half = (float(stdtrit(log_gains.size - 1, 1 - alpha / 2))  # Student's t quantile
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
        # chdtri(k, 0.8): the chi-square quantile at 0.2 (its inverse survival function)
        upper = float(x.std(ddof=1)) * math.sqrt((t - 1) / float(chdtri(t - 1, 0.8)))
        s = max(upper, noise_floor)
    c = -2 * math.log(alpha) + math.log(1 - 2 * math.log(alpha))
    rho2 = c / (planned * s * s)
    v = t * s * s * rho2
    half = math.sqrt(2 * (v + 1) / (t * t * rho2) * math.log(math.sqrt(v + 1) / alpha))
    mean = float(x.mean())
    return mean - half, mean + half
