"""Graph capture: a PyTorch model -> LayerGraph (per-layer FLOPs, parameters, activations, MoE shape).

`from autoplan.graph import capture` gives the function; torch is imported only on first use, so the
pure cost model can import autoplan.graph.types without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from autoplan.graph.types import Layer, LayerGraph, LayerRole

__all__ = ["CaptureError", "Layer", "LayerGraph", "LayerRole", "capture"]


def __getattr__(name: str) -> Any:
    if name in ("capture", "CaptureError"):
        module = importlib.import_module("autoplan.graph.capture")
        # importing the submodule binds the package attribute `capture` to it: rebind to the function
        globals().update(capture=module.capture, CaptureError=module.CaptureError)
        return globals()[name]
    raise AttributeError(f"module 'autoplan.graph' has no attribute {name!r}")
