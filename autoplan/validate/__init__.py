"""Predicted against measured: run a spread of plans with the executor (`autoplan validate`), score the
cost model's ranking and error on them, and plot both.

select.py picks the plans, measure.py runs them and writes the JSON, metrics.py scores, plots.py draws.
"""

from __future__ import annotations

from autoplan.validate.metrics import best_gap, mape, spearman
from autoplan.validate.select import select_plans

__all__ = ["best_gap", "mape", "select_plans", "spearman"]
