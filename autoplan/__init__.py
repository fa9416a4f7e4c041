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
}

__all__ = [
    "Breakdown",
    "Cluster",
    "ClusterSpec",
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
    "__version__",
    "autoplan",
    "capture",
    "estimate",
    "execute",
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
