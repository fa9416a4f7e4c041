"""Meta-device stand-ins of a model's tensors for capture (graph/capture.py): parameters as empty meta tensors
of the capture dtype, buffers as meta tensors of their own dtype; no weight is read, copied or moved.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn

from autoplan.graph.errors import CaptureError


def meta_tensors(model: nn.Module, dtype: torch.dtype) -> dict[int, Any]:
    """id of each parameter and buffer -> its meta stand-in: parameters meta tensors of `dtype` (floating
    ones), buffers meta tensors of their own dtype (tied tensors once)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) in memo:
            continue
        if isinstance(t, nn.Parameter):
            target = dtype if t.is_floating_point() else t.dtype
            memo[id(t)] = nn.Parameter(
                torch.empty(t.shape, dtype=target, device="meta"), requires_grad=t.requires_grad
            )
        else:
            memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return memo


def to_meta_in_place(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with every parameter and buffer replaced by meta_copy's stand-in, without copying the rest."""
    memo = meta_tensors(model, dtype)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = memo[id(t)]
    return model


def meta_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy whose parameters are meta tensors of `dtype` (floating ones) and buffers meta tensors
    of their own dtype: no weight is read, copied or moved."""
    memo = meta_tensors(model, dtype)
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise CaptureError(
            f"cannot copy {type(model).__name__} to the meta device (deepcopy failed: "
            f"{type(exc).__name__}: {exc}); build the model under `with torch.device('meta'):` and pass that"
        ) from exc
