"""Graph capture: a PyTorch model -> LayerGraph (per-layer FLOPs, parameters, activations, MoE shape)."""

from __future__ import annotations

from autoplan.graph.types import Layer, LayerGraph, LayerRole

__all__ = ["CaptureError", "Layer", "LayerGraph", "LayerRole", "capture"]


def __getattr__(name: str):  # torch is imported only when capture is first used
    if name in ("capture", "CaptureError"):
        from autoplan.graph import capture as _capture

        return getattr(_capture, name)
    raise AttributeError(f"module 'autoplan.graph' has no attribute {name!r}")
