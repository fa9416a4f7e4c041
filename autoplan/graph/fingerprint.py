"""A short, stable identity of a model's structure: what a plan was made for, checked before a run.

The hash covers every parameter's name and shape (tied parameters once), not dtypes or values: the same
architecture built on the meta device, on the CPU in float32 or loaded in bf16 has one fingerprint, and a plan
made for it runs on any of them; another model (other layers, widths, vocabulary or names) has another.
"""

from __future__ import annotations

import hashlib

from torch import nn


def model_fingerprint(model: nn.Module) -> str:
    """16 hex digits of sha256 over the sorted "name:shape" of the model's parameters."""
    digest = hashlib.sha256()
    for name, shape in sorted((n, tuple(p.shape)) for n, p in model.named_parameters()):
        digest.update(f"{name}:{','.join(map(str, shape))};".encode())
    return digest.hexdigest()[:16]


__all__ = ["model_fingerprint"]
