"""autoplan: find, explain and run the fastest parallel plan for training a PyTorch model on a cluster.

    import autoplan
    plans = autoplan.autoplan("gpt3-175b", autoplan.Cluster.load("dgx-a100-80gb", num_nodes=128),
                              global_batch=1536, seq_len=2048)
    print(plans)          # ranked table; plans[0].explain() says why

Nothing heavy runs at import: the public names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "autoplan": "autoplan.search.api",
    "estimate": "autoplan.search.api",
    "Plans": "autoplan.search.api",
    "plan_components": "autoplan.search.api",
    "ComponentPlans": "autoplan.search.api",
    "execute_components": "autoplan.execute.component_worker",
    "capture_components": "autoplan.graph.capture",
    "ComponentGraph": "autoplan.graph.types",
    "ComponentPlan": "autoplan.plan.components",
    "execute": "autoplan.execute.launch",
    "Cluster": "autoplan.cluster.load",
    "ClusterSpec": "autoplan.cluster.types",
    "DeviceSpec": "autoplan.cluster.types",
    "LinkSpec": "autoplan.cluster.types",
    "capture": "autoplan.graph.capture",
    "LayerGraph": "autoplan.graph.types",
    "Layer": "autoplan.graph.types",
    "ParallelConfig": "autoplan.plan.types",
    "Plan": "autoplan.plan.types",
    "Estimate": "autoplan.plan.types",
    "Breakdown": "autoplan.plan.types",
    "Schedule": "autoplan.plan.types",
    "Recompute": "autoplan.plan.types",
    "Engine": "autoplan.plan.engine",
    "MeshAxis": "autoplan.plan.types",
    "serve_plan": "autoplan.serve.api",
    "serve_estimate": "autoplan.serve.api",
    "ServePlans": "autoplan.serve.api",
    "ServeConfig": "autoplan.serve.types",
    "ServeEstimate": "autoplan.serve.types",
}

__all__ = [
    "Breakdown",
    "Cluster",
    "ClusterSpec",
    "ComponentGraph",
    "ComponentPlan",
    "ComponentPlans",
    "DeviceSpec",
    "Engine",
    "Estimate",
    "Layer",
    "LayerGraph",
    "LinkSpec",
    "MeshAxis",
    "ParallelConfig",
    "Plan",
    "Plans",
    "Recompute",
    "Schedule",
    "ServeConfig",
    "ServeEstimate",
    "ServePlans",
    "__version__",
    "autoplan",
    "capture",
    "capture_components",
    "estimate",
    "execute",
    "execute_components",
    "plan_components",
    "serve_estimate",
    "serve_plan",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
