"""Context parallelism and selective recompute for Hugging Face models, through transformers' AttentionInterface.

The model's attention implementation becomes "autoplan", registered here once per process: per attention
module it runs SDPA as transformers' "sdpa" does, or, under context parallelism, autoplan's load-balanced
("zig-zag") all-gather core (execute.context.ContextParallelCore: K/V exchanged with kv heads only), and wraps
that core in activation checkpointing where the plan recomputes it (selective recompute, Korthikanti et al.
2022). Positions come from the stage runner (execute.runner: zig-zag global positions for RoPE).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from autoplan.execute.context import ContextParallelCore

IMPLEMENTATION = "autoplan"
_CP_MESH, _RECOMPUTE = "autoplan_cp_mesh", "autoplan_recompute_core"


def _core(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
    """[B, S, H, d] attention output of one module (transformers' layout)."""
    cp_mesh = getattr(module, _CP_MESH, None)
    if cp_mesh is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0]
    group = query.shape[1] // key.shape[1]
    if group > 1:  # the core gathers every group-th head only (the kv heads), then repeats
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    return ContextParallelCore(cp_mesh, kv_group=group)(query, key, value).transpose(1, 2).contiguous()


def autoplan_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention function: (output [B, S, H, d], no attention weights)."""
    if getattr(module, _RECOMPUTE, False):
        out = checkpoint(lambda q, k, v: _core(module, q, k, v, attention_mask, **kwargs), query, key, value,
                         use_reentrant=False)
    else:
        out = _core(module, query, key, value, attention_mask, **kwargs)
    return out, None


def use_autoplan_attention(model: nn.Module) -> None:
    """Register the function (transformers >= 4.48) and select it in the model's config (the config object its
    attention modules share)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, autoplan_attention)  # idempotent: the same name, the same function
    model.config._attn_implementation = IMPLEMENTATION


def set_context_parallel(attention: nn.Module, cp_mesh: DeviceMesh) -> None:
    object.__setattr__(attention, _CP_MESH, cp_mesh)  # a plain attribute: no submodule, nothing in state dicts


def set_core_recompute(attention: nn.Module) -> None:
    object.__setattr__(attention, _RECOMPUTE, True)


__all__ = ["IMPLEMENTATION", "autoplan_attention", "set_context_parallel", "set_core_recompute",
           "use_autoplan_attention"]
