"""Balance detectors: load imbalance among ranks (seed 2.3) and autoscaler thrash (seed 2.4).

Load imbalance. The load L of a rank is its busy fraction: the share of its step time not spent
waiting in all-reduce (``seedance.train.step.duration`` minus the DDP hook's all-reduce time,
per step). In synchronous data parallelism every rank's step lasts as long as the slowest
one's, so a slow rank shows as the one that waits least. Any gauge can be used instead
(``load_metric``, grouped by ``group_by``: e.g. GPU utilisation per replica).

Seed 2.3: a pair (i, j) is rebalanced when |L_i - L_j| >= 0.15 max(L) and its cooldown has
expired; it moves ``min(Cap_i, Cap_j) x alpha x (1 - exp(-dL / tau))`` of weight, alpha = 0.82,
tau = 45 s. dL / tau mixes units as the seed writes it. We read L as busy seconds within one
tau-long window, so dL / tau is the difference of busy fractions (dimensionless) and the formula
is used with dL = |u_i - u_j|. The cooldown is tau seconds of data under the config in force:
a rebalance is a config change, so a pair is judged again only once the new config has run tau.
The weight moved is capped at the amount that would equalise the pair, which the seed's formula
can overshoot. Cap_i is the rank's current share of the work (equal shares unless given).

Autoscaler thrash. The replica count (``seedance.serve.replicas``, a gauge the serving job or
its autoscaler reports; not yet in the catalogue) changing often while the p99 request latency
(from the ``gen_ai.server.request.duration`` histogram buckets) spikes right after each change:
cold starts and rebalance jitter. Seed 2.4's fix was static sharding, one shard per GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from collectors import ConfigError
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._quantile import histogram_quantile
from policies._window import StoreWindow
from policies.detectors._communication import collective_intervals
from policies.detectors._series import increase, interval_increases, latest_version

ARTICLE_IMBALANCE_FRACTION = 0.15
ARTICLE_REBALANCE_ALPHA = 0.82
ARTICLE_COOLDOWN_TAU_S = 45.0
STEP_COUNT = "seedance.train.step.duration.count"
STEP_SUM = "seedance.train.step.duration.sum"
RANK = "seedance.rank"
REPLICAS = "seedance.serve.replicas"
REQUEST_BUCKETS = "gen_ai.server.request.duration.bucket"


def rebalance_weight(cap_i: float, cap_j: float, d_load: float, *,
                     alpha: float = ARTICLE_REBALANCE_ALPHA, tau: float = 1.0) -> float:
    """Seed 2.3: min(Cap_i, Cap_j) x alpha x (1 - exp(-dL / tau)); see the module doc on units."""
    if tau <= 0 or d_load < 0:
        raise ValueError(f"tau must be > 0 and d_load >= 0, got {tau}, {d_load}")
    return min(cap_i, cap_j) * alpha * (1 - math.exp(-d_load / tau))


@dataclass(frozen=True, slots=True, kw_only=True)
class ImbalanceConfig:
    """Seed 2.3's constants and what load is read from."""

    fraction: float = ARTICLE_IMBALANCE_FRACTION
    alpha: float = ARTICLE_REBALANCE_ALPHA
    cooldown_s: float = ARTICLE_COOLDOWN_TAU_S
    load_metric: str | None = None
    group_by: str = RANK
    capacities: Mapping[str, float] = field(default_factory=dict)
    min_steps: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.fraction < 1:
            raise ConfigError(f"fraction must be in (0, 1), got {self.fraction}")
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.cooldown_s < 0:
            raise ConfigError(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        if self.min_steps < 1:
            raise ConfigError(f"min_steps must be >= 1, got {self.min_steps}")


class LoadImbalanceDetector(Detector):
    """Flags the most and least loaded ranks when their gap passes 15% of the largest load."""

    def __init__(self, config: ImbalanceConfig | None = None, *,
                 name: str = "load_imbalance") -> None:
        self.config = config or ImbalanceConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def _loads(self, window: StoreWindow) -> tuple[dict[str, float], float, str]:
        """Load per group, seconds of data under the newest config, and how load was read."""
        cfg = self.config
        if cfg.load_metric is not None:
            frame = latest_version(window.query(cfg.load_metric))
            if frame.empty or cfg.group_by not in frame.columns:
                return {}, 0.0, cfg.load_metric
            loads = {str(g): float(rows["value"].mean()) for g, rows in frame.groupby(cfg.group_by)
                     if len(rows) >= cfg.min_steps}
            return loads, _span_s(frame), f"mean {cfg.load_metric}"
        counts, sums = (latest_version(window.query(n)) for n in (STEP_COUNT, STEP_SUM))
        if counts.empty or sums.empty or RANK not in counts.columns:
            return {}, 0.0, ""
        comm = collective_intervals(window)
        loads = {}
        for rank, rows in counts.groupby(RANK):
            steps = increase(rows)
            step_s = increase(sums[sums[RANK] == rank])
            if steps < cfg.min_steps or step_s <= 0:
                continue
            mine = comm[comm["rank"] == str(rank)] if not comm.empty else comm
            waited_s = float((mine["calls"] * mine["latency_s"]).sum()) if not mine.empty else 0
            loads[str(rank)] = max(0.0, 1 - waited_s / step_s)
        return loads, _span_s(counts), "busy fraction: 1 - all-reduce time / step time"

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        loads, span_s, how = self._loads(window)
        if len(loads) < 2 or span_s < cfg.cooldown_s:
            return []  # one rank, or the config in force has not run a cooldown yet
        busiest = max(loads, key=loads.__getitem__)
        idlest = min(loads, key=loads.__getitem__)
        top = loads[busiest]
        gap = top - loads[idlest]
        if top <= 0 or gap < cfg.fraction * top:
            return []
        equal = 1 / len(loads)
        caps = {g: float(cfg.capacities.get(g, equal)) for g in loads}
        seed_move = rebalance_weight(caps[busiest], caps[idlest], gap, alpha=cfg.alpha)
        # the move that equalises the pair if load scales with the share of work
        equalising = caps[busiest] - (caps[busiest] + caps[idlest]) * top / (top + loads[idlest])
        moved = min(seed_move, abs(equalising))
        weights = dict(caps)
        weights[busiest] -= moved
        weights[idlest] += moved
        measurements = [Measurement(name=f"load.{g}", value=v) for g, v in sorted(loads.items())]
        measurements += [Measurement(name="gap", value=gap),
                         Measurement(name="max_load", value=top),
                         Measurement(name="gap_over_max", value=gap / top),
                         Measurement(name="config_age", value=span_s, unit="s"),
                         Measurement(name="weight_moved", value=moved)]
        return [Finding(
            detector=self.name, job=window.job,
            severity="critical" if gap >= 2 * cfg.fraction * top else "warning",
            resource={"rank": busiest} if cfg.group_by == RANK else {"replica": busiest},
            evidence=Evidence(
                summary=(f"{cfg.group_by} {busiest} is loaded {top:.0%} against {loads[idlest]:.0%}"
                         f" on {idlest}, a gap of {gap / top:.0%} of the largest load ({how})"),
                model=(f"seed 2.3: |L_i - L_j| >= {cfg.fraction} max(L) after a {cfg.cooldown_s:g}"
                       f" s cooldown; weight = min(Cap_i, Cap_j) x {cfg.alpha} x "
                       "(1 - exp(-dL/tau)), dL/tau = busy-fraction gap, capped at equalising"),
                measurements=tuple(measurements),
                thresholds=(Threshold(measurement="gap_over_max", comparison=">=",
                                      value=cfg.fraction),
                            Threshold(measurement="config_age", comparison=">=",
                                      value=cfg.cooldown_s, unit="s"))),
            suggested_changes=(SuggestedChange(
                knob="data.rank_weights",
                value={g: round(w, 4) for g, w in sorted(weights.items())},
                expected_effect=(f"moves {moved:.3f} of the work from {busiest} to {idlest}; the "
                                 "fast ranks stop waiting in all-reduce for the slow one")),),
        )]


def _span_s(frame: pd.DataFrame) -> float:
    if frame.empty:
        return 0.0
    times = frame["time"]
    return float((times.max() - times.min()).total_seconds())


def p99_per_interval(frame: pd.DataFrame) -> pd.Series:
    """p99 per export interval from cumulative histogram bucket series (column ``le``)."""
    if frame.empty or "le" not in frame.columns:
        return pd.Series(dtype=np.float64)
    per_bound = {}
    for le, rows in frame.groupby("le"):
        deltas = interval_increases(rows.groupby("time", as_index=False)["value"].sum())
        per_bound[float(le)] = deltas.set_index("time")["delta"]
    table = pd.DataFrame(per_bound).sort_index(axis=1).dropna()
    bounds = table.columns.to_numpy(dtype=np.float64)
    if len(bounds) < 2:
        return pd.Series(dtype=np.float64)
    # a p99 past the last bound counts as the last bound, as Prometheus reads it: replicas
    # are compared with each other, and an infinite p99 would compare with nothing
    last = float(bounds[-2])
    return pd.Series({t: min(histogram_quantile(0.99, dict(zip(bounds, row.to_numpy(),
                                                                strict=True))), last)
                      for t, row in table.iterrows()}, dtype=np.float64).dropna()


@dataclass(frozen=True, slots=True, kw_only=True)
class ThrashConfig:
    """Thresholds of :class:`AutoscalerThrashDetector`."""

    min_changes: int = 3
    settle_s: float = 60.0
    spike_ratio: float = 1.5

    def __post_init__(self) -> None:
        if self.min_changes < 1:
            raise ConfigError(f"min_changes must be >= 1, got {self.min_changes}")
        if self.settle_s <= 0:
            raise ConfigError(f"settle_s must be > 0, got {self.settle_s}")
        if self.spike_ratio <= 1:
            raise ConfigError(f"spike_ratio must be > 1, got {self.spike_ratio}")


class AutoscalerThrashDetector(Detector):
    """Flags a serving job whose replica count keeps changing with a p99 spike after changes."""

    def __init__(self, config: ThrashConfig | None = None, *,
                 name: str = "autoscaler_thrash") -> None:
        self.config = config or ThrashConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        cfg = self.config
        replicas = window.query(REPLICAS)
        if len(replicas) < 2:
            return []
        series = replicas.groupby("time", sort=True)["value"].sum()
        changed = series.index[1:][np.diff(series.to_numpy()) != 0]
        if len(changed) < cfg.min_changes:
            return []
        p99 = p99_per_interval(window.query(REQUEST_BUCKETS))
        if p99.empty:
            return []
        settle = pd.Timedelta(seconds=cfg.settle_s)
        after = np.zeros(len(p99), dtype=bool)
        for t in changed:
            after |= (p99.index >= t) & (p99.index <= t + settle)
        if after.all() or not after.any():
            return []  # nothing to compare against
        spiked = float(p99[after].median())
        steady = float(p99[~after].median())
        ratio = spiked / steady if steady > 0 else math.inf
        if ratio < cfg.spike_ratio:
            return []
        span_min = max((series.index[-1] - series.index[0]).total_seconds() / 60, 1e-9)
        peak = int(series.max())
        return [Finding(
            detector=self.name, job=window.job,
            severity="critical" if ratio >= 2 * cfg.spike_ratio else "warning", resource={},
            evidence=Evidence(
                summary=(f"replica count changed {len(changed)} times "
                         f"({series.min():g}..{peak}) and p99 latency within "
                         f"{cfg.settle_s:g} s of a change was {ratio:.1f}x the steady p99"),
                model="replica changes per window with p99 (histogram_quantile over request "
                      "duration buckets) after a change vs steady; seed 2.4",
                measurements=(Measurement(name="replica_changes", value=float(len(changed))),
                              Measurement(name="changes_per_minute",
                                          value=len(changed) / span_min),
                              Measurement(name="p99_after_change", value=spiked, unit="s"),
                              Measurement(name="p99_steady", value=steady, unit="s"),
                              Measurement(name="p99_ratio", value=ratio)),
                thresholds=(Threshold(measurement="replica_changes", comparison=">=",
                                      value=cfg.min_changes),
                            Threshold(measurement="p99_ratio", comparison=">=",
                                      value=cfg.spike_ratio))),
            suggested_changes=(
                SuggestedChange(knob="serve.autoscaling.enabled", value=False,
                                expected_effect="no cold starts or rebalance jitter (seed 2.4: "
                                "p99 1842 -> 621 ms, QPS 12.3 -> 38.7 on Llama-3-70B)"),
                SuggestedChange(knob="serve.static_replicas", value=peak,
                                expected_effect="one pre-allocated shard per GPU at the peak "
                                "count the autoscaler reached"),
            ),
        )]
