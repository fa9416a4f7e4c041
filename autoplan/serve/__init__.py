"""Serving plans: how to lay a model out on devices to serve requests (tp / pp / ep, replicas, the
batch cap, aggregated or disaggregated prefill and decode), ranked by goodput under TTFT / TPOT SLOs.

Pure like autoplan.cost (no torch): types.py (the vocabulary, TTFT / TPOT definitions), model.py
(LayerGraph -> ServeModel), engine.py (engines/serve/*.yaml), memory.py, physics.py, queueing.py,
estimate.py, search.py, plan.py (launch arguments), plot.py; api.py is the entry point (it captures
the model through autoplan.search.api, which imports torch lazily).
"""

from __future__ import annotations

from autoplan.serve.types import ServeConfig, ServeEngine, ServeEstimate, ServeModel, Workload

__all__ = ["ServeConfig", "ServeEngine", "ServeEstimate", "ServeModel", "Workload"]
