"""The seed's ROI of repairing utilisation instead of scaling out (section 2.5).

Section numbers are the seed article's (its digest is kept outside this repository); where the
seed's printed number does not follow from its own formula, the formula wins and the
docstring says so.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

ARTICLE_GAMMA = 0.78
"""The seed's cross-elasticity gamma, "fitted on 23 clusters" (section 2.5)."""


def _check_gamma(gamma: float) -> None:
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")


def equivalent_scale_out_nodes(
    n_nodes: float, utilisation_gain: float, *, gamma: float = ARTICLE_GAMMA
) -> float:
    """Nodes one would have to add to match a utilisation repair (seed 2.5 "等效扩容节省").

    Model: delivered throughput T = u x n^gamma (u mean utilisation, fraction; n nodes; gamma
    the elasticity of throughput to node count, < 1 because scale-out adds communication,
    truth 1). Raising u by the relative ``utilisation_gain`` g (0.18 = +18%) delivers what
    n' = n (1 + g)^(1/gamma) nodes deliver at the old u, so it saves n' - n nodes.
    With gamma = 0.78 one cluster of n = 7.2 nodes reproduces both seed examples (+18% -> 1.7,
    +32% -> 3.1); the seed does not state n.
    """
    _check_gamma(gamma)
    if n_nodes < 0 or utilisation_gain <= -1:
        raise ValueError(f"n_nodes must be >= 0 and utilisation_gain > -1, got "
                         f"{n_nodes}, {utilisation_gain}")
    return n_nodes * ((1 + utilisation_gain) ** (1 / gamma) - 1)


def payback_months(fix_cost: float, nodes_saved: float, node_cost_per_month: float) -> float:
    """Months until a fix costing ``fix_cost`` pays for itself (inf when it saves nothing).

    ``fix_cost`` and ``node_cost_per_month`` in the same currency; savings accrue from month 0.
    The seed's months (4.2 for 1.7 nodes, 2.8 for 3.1 nodes) imply fix costs of 7.1 and 8.7
    node-months; it states neither, so they cannot be reproduced independently.
    """
    if fix_cost < 0 or node_cost_per_month <= 0:
        raise ValueError(f"fix_cost must be >= 0 and node_cost_per_month > 0, got "
                         f"{fix_cost}, {node_cost_per_month}")
    savings = nodes_saved * node_cost_per_month
    return fix_cost / savings if savings > 0 else math.inf


def roi_delta(
    utilisation: float, scale_out: float, *, n_nodes: float, target_utilisation: float,
    node_cost_per_month: float, fix_cost: float, horizon_months: float,
    gamma: float = ARTICLE_GAMMA,
) -> float:
    """ROI of repairing utilisation instead of running a planned scale-out, over a horizon.

    The plan is ``n_nodes x scale_out`` nodes at mean ``utilisation`` (fraction). Repairing
    utilisation to ``target_utilisation`` (ratio r = target / utilisation, at least 1) delivers
    the plan's throughput (T = u n^gamma, :func:`equivalent_scale_out_nodes`) with
    n s r^(-1/gamma) nodes, saving n s (1 - r^(-1/gamma)) nodes a month at
    ``node_cost_per_month`` each. ROI = (savings x ``horizon_months`` - ``fix_cost``) /
    ``fix_cost`` (fraction; -1 = the fix is wasted). It rises with the scale-out avoided and
    falls as the current utilisation nears the target.
    """
    _check_gamma(gamma)
    if not 0 < utilisation <= 1 or not 0 < target_utilisation <= 1:
        raise ValueError(f"utilisation and target_utilisation must be in (0, 1], got "
                         f"{utilisation}, {target_utilisation}")
    if scale_out < 1 or fix_cost <= 0 or horizon_months <= 0:
        raise ValueError(f"scale_out must be >= 1, fix_cost and horizon_months > 0, got "
                         f"{scale_out}, {fix_cost}, {horizon_months}")
    if n_nodes <= 0 or node_cost_per_month <= 0:
        raise ValueError(f"n_nodes and node_cost_per_month must be > 0, got "
                         f"{n_nodes}, {node_cost_per_month}")
    repair = max(target_utilisation / utilisation, 1.0)
    nodes_saved = n_nodes * scale_out * (1 - repair ** (-1 / gamma))
    return (nodes_saved * node_cost_per_month * horizon_months - fix_cost) / fix_cost


ARTICLE_UTILISATION_GRID: tuple[float, ...] = tuple(np.linspace(0.4, 0.9, 6).tolist())
ARTICLE_SCALE_OUT_GRID: tuple[float, ...] = tuple(np.linspace(1.0, 2.5, 5).tolist())


def roi_matrix(
    *, utilisation_grid: tuple[float, ...] = ARTICLE_UTILISATION_GRID,
    scale_out_grid: tuple[float, ...] = ARTICLE_SCALE_OUT_GRID, **roi_params: float,
) -> pd.DataFrame:
    """The seed's ROI table (2.5): :func:`roi_delta` over scale-out (rows) x utilisation (cols).

    Defaults are the seed's grids (6 utilisations 0.4..0.9, 5 scale-outs 1.0..2.5);
    ``roi_params`` are :func:`roi_delta`'s keyword parameters.
    """
    values = [[roi_delta(u, s, **roi_params) for u in utilisation_grid] for s in scale_out_grid]
    return pd.DataFrame(
        values,
        index=pd.Index(scale_out_grid, name="scale_out"),
        columns=pd.Index(utilisation_grid, name="utilisation"),
    )
