"""Load imbalance among data-parallel ranks (seed 2.3): a slow rank makes every rank wait.

The load L of a rank is its busy fraction: the share of its step time not spent
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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import pandas as pd

from collectors import ConfigError
from collectors.names import ATTR_SEEDANCE_RANK, TRAIN_STEP_DURATION_COUNT, TRAIN_STEP_DURATION_SUM
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._collective_parts import collective_intervals
from policies.detectors._series import increase, latest_version

ARTICLE_IMBALANCE_FRACTION = 0.15
ARTICLE_REBALANCE_ALPHA = 0.82
ARTICLE_COOLDOWN_TAU_S = 45.0
STEP_COUNT = TRAIN_STEP_DURATION_COUNT
STEP_SUM = TRAIN_STEP_DURATION_SUM
RANK = ATTR_SEEDANCE_RANK


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
