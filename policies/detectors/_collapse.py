"""Gradient collapse, the design article's rule (section 3.3), judged on the global gradient
norm exactly as the article writes it. Its ratio ``||g_t|| / ||g_{t-1}||`` is undefined after a
zero norm, so it never fires on gradients that flush to exactly zero: that is
``GradientUnderflowDetector``'s (``_underflow.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from collectors import CONFIG_VERSION_ATTR
from policies._detector import Detector
from policies._findings import Evidence, Finding, Measurement, SuggestedChange, Threshold
from policies._window import StoreWindow
from policies.detectors._gradient_parts import (
    COLLAPSE,
    check_config,
    value_at,
)
from policies.detectors._steps import (
    GRAD_NORM,
    RANK_ATTR,
    by,
    per_step,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollapseConfig:
    """The seed's collapse rule (section 3.3); the defaults are the seed's numbers.

    At step t the rule holds when ``||g_i|| / ||g_{i-1}|| < ratio_below`` for each of the
    ``consecutive`` steps i = t-consecutive+1 .. t (each ratio defined: the previous norm
    finite and > 0), AND the population variance (ddof 0) of the ``variance_window`` norms
    ``||g_{t-variance_window+1}|| .. ||g_t||`` is below ``variance_below``. "Gradient
    variance" is thus the variance of the per-step global L2 norms in the window, not of the
    gradient elements. The rule needs the full variance window, so it holds at t >= 4 at the
    earliest with the defaults.
    """

    ratio_below: float = 0.05
    consecutive: int = 3
    variance_below: float = 1e-8
    variance_window: int = 5

    def __post_init__(self) -> None:
        check_config(self.ratio_below > 0, f"ratio_below must be > 0, got {self.ratio_below}")
        check_config(self.consecutive >= 1, f"consecutive must be >= 1, got {self.consecutive}")
        check_config(self.variance_below > 0, f"variance_below must be > 0, got {self.variance_below}")
        check_config(self.variance_window >= 2,
               f"variance_window must be >= 2, got {self.variance_window}")


def _rule_holds(norms: np.ndarray, t: int, rule: CollapseConfig) -> bool:
    if t < max(rule.consecutive, rule.variance_window - 1):
        return False
    for i in range(t - rule.consecutive + 1, t + 1):
        prev = norms[i - 1]
        if not (math.isfinite(prev) and prev > 0 and norms[i] / prev < rule.ratio_below):
            return False
    window = norms[t - rule.variance_window + 1:t + 1]
    return bool(np.isfinite(window).all() and np.var(window) < rule.variance_below)


def article_collapse_step(norms: Sequence[float], rule: CollapseConfig | None = None) -> int | None:
    """The first index t of ``norms`` (per-step global gradient L2 norms) where the seed's
    collapse rule holds (see :class:`CollapseConfig`), or None if it never does."""
    rule = rule or CollapseConfig()
    values = np.asarray(norms, dtype=np.float64)
    return next((t for t in range(values.size) if _rule_holds(values, t, rule)), None)


class GradientCollapseDetector(Detector):
    """Flags a rank whose global gradient norm collapsed by the seed's rule (seed 3.3).

    Reads ``seedance.train.grad.norm`` one reading per step (see ``policies.detectors._steps``).
    Critical: collapse is a guardrail; the seed's remedy is a rollback to the checkpoint taken
    before precision was lowered, with mixed precision off for the offending layer.
    """

    def __init__(self, config: CollapseConfig | None = None, *,
                 name: str = COLLAPSE) -> None:
        self.config = config or CollapseConfig()
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def evaluate(self, window: StoreWindow) -> list[Finding]:
        findings = []
        rule = self.config
        for key, rows in by(per_step(window, GRAD_NORM), [RANK_ATTR]):
            norms = rows["value"].to_numpy(dtype=np.float64)
            t = article_collapse_step(norms, rule)
            if t is None:
                continue
            ratios = [norms[i] / norms[i - 1] for i in range(t - rule.consecutive + 1, t + 1)]
            span = norms[t - rule.variance_window + 1:t + 1]
            step = rows["step"].iloc[t]
            measurements = [
                Measurement(name="collapse_step", value=float(step), unit="{step}"),
                Measurement(name="max_norm_ratio", value=float(max(ratios))),
                Measurement(name="norm_variance", value=float(np.var(span))),
                *(Measurement(name=f"norm[t-{len(span) - 1 - i}]", value=float(v))
                  for i, v in enumerate(span)),
            ]
            version = value_at(rows, CONFIG_VERSION_ATTR, t)
            findings.append(Finding(
                detector=self.name, job=window.job, severity="critical", resource=key,
                evidence=Evidence(
                    summary=(f"the global gradient norm fell below {rule.ratio_below:g} of the "
                             f"step before {rule.consecutive} steps running, ending at step "
                             f"{step:.0f}" + (f" under config version {version}" if version
                                              else "")),
                    model=(f"seed 3.3 gradient collapse: ||g_t||/||g_t-1|| < {rule.ratio_below:g}"
                           f" for {rule.consecutive} consecutive steps and population variance "
                           f"of the last {rule.variance_window} per-step norms < "
                           f"{rule.variance_below:g}"),
                    measurements=tuple(measurements),
                    thresholds=(
                        Threshold(measurement="max_norm_ratio", comparison="<",
                                  value=rule.ratio_below),
                        Threshold(measurement="norm_variance", comparison="<",
                                  value=rule.variance_below))),
                suggested_changes=(
                    SuggestedChange(knob="checkpoint.restore", value="before_precision_change",
                                    expected_effect="weights from before the collapse; the "
                                    "optimizer's momentum for the affected parameters reset"),
                    SuggestedChange(knob="precision", value="fp32",
                                    expected_effect="gradients keep their magnitude; the seed "
                                    "prefers undoing only the offending layer when it is known"),
                ),
            ))
        return findings


