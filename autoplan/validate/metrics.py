"""How good a ranking and its times are: Spearman rank correlation, mean absolute percentage error, and
how much slower the plan predicted best runs than the plan measured best. Pure; numpy and scipy only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _pairs(predicted: Sequence[float], measured: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if p.shape != m.shape or p.ndim != 1 or len(p) == 0:
        raise ValueError(f"need equally many predicted and measured values, got {p.shape} and {m.shape}")
    if not (np.all(p > 0) and np.all(m > 0)):
        raise ValueError("predicted and measured times must be positive")
    return p, m


def spearman(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman's rho (Pearson correlation of the ranks, ties given their mean rank: scipy.stats.spearmanr)."""
    from scipy.stats import spearmanr

    p, m = _pairs(predicted, measured)
    if len(p) < 2:
        raise ValueError("a rank correlation needs at least 2 plans")
    return float(spearmanr(p, m).statistic)


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean of |predicted - measured| / measured, as a fraction (0.1 = 10 %)."""
    p, m = _pairs(predicted, measured)
    return float(np.mean(np.abs(p - m) / m))


def best_gap(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """measured time of the plan predicted fastest / the fastest measured time - 1 (0 = it is the best)."""
    p, m = _pairs(predicted, measured)
    return float(m[int(np.argmin(p))] / m.min() - 1.0)
