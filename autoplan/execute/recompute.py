"""Activation recompute per block, as the plan says (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"): none; selective (only the attention core `attn.core`,
whose activations grow with S^2, is re-run in backward); full (only each block's input is kept).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)

from autoplan.models import Transformer
from autoplan.plan.types import Recompute


def apply_recompute(model: Transformer, *, recompute_for: Callable[[str], Recompute]) -> None:
    """Wrap, in place, each block of `model` (or of a pipeline stage) by its mode, looked up by the
    block's path ("layers.3"). Full recompute inserts `_checkpoint_wrapped_module` into parameter
    names; `original_fqn` removes it (torch.distributed.checkpoint.state_dict does the same)."""
    for name in list(model.layers.keys()):
        mode = recompute_for(f"layers.{name}")
        block = model.layers[name]
        if mode is Recompute.FULL:
            model.layers[name] = checkpoint_wrapper(block)
        elif mode is Recompute.SELECTIVE:
            block.attn.core = checkpoint_wrapper(block.attn.core)


def original_fqn(name: str) -> str:
    """A parameter's name in the unwrapped model: drops the activation-checkpoint wrapper's prefix."""
    return name.replace(_CHECKPOINT_PREFIX, "")
