"""Tensor and sequence parallelism (Megatron-LM style) with DTensor `parallelize_module`.

Per block: wq/wk/wv and fc1 (w1, w3) column-parallel, wo and fc2 (w2) row-parallel, so each rank holds
num_heads/tp heads and ffn/tp hidden units (Shoeybi et al. 2019). With sequence parallelism the norms
and the residual stream are sharded along the sequence between blocks (Korthikanti et al. 2022).
Embedding and head are vocab-parallel; the loss then runs under `loss_parallel()`.
MoE blocks: attention only; router and experts see the full (replicated) tokens.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autoplan.models import MoE, Transformer
from autoplan.plan.layout import divisibility_errors
from autoplan.plan.types import ParallelConfig


def check_tensor_parallel(model: Transformer, tp: int) -> None:
    """Raise ValueError when heads, kv heads, ffn width or vocabulary do not divide by tp (the rules of
    plan.layout.divisibility_errors, which the search and the cost model use too)."""
    c = model.config
    errors = divisibility_errors(ParallelConfig(tp=tp), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                 ffn_hidden_size=c.ffn_hidden_size, vocab_size=c.vocab_size)
    if errors:
        raise ValueError(f"{c.name}: {errors[0]}")


def apply_tensor_parallel(model: Transformer, *, tp_mesh: DeviceMesh, sp: bool) -> None:
    """Shard `model` (a whole model or a pipeline stage) over tp_mesh in place; no-op when tp is 1.

    Between blocks the residual stream is a plain tensor: [B, S/tp, h] (this rank's sequence chunk)
    with sp, the full [B, S, h] without. The head's output is a DTensor sharded on the vocabulary."""
    tp = tp_mesh.size()
    if tp == 1:
        return
    check_tensor_parallel(model, tp)
    seq = Shard(1) if sp else Replicate()
    if model.embed is not None:
        _parallelize_embedding(model.embed, tp_mesh, sp=sp)
    for block in model.layers.values():
        _parallelize_block(block, tp_mesh, sp=sp)
    if model.norm is not None and sp:
        parallelize_module(model.norm, tp_mesh, SequenceParallel())
    if model.head is not None:
        # vocab-parallel logits, kept as a DTensor for loss_parallel()
        parallelize_module(model.head, tp_mesh, ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False))


def _parallelize_embedding(embed: nn.Module, tp_mesh: DeviceMesh, *, sp: bool) -> None:
    """Vocab-parallel token embedding. Learned positions (gpt) stay replicated and are added to the
    full sequence, so the sequence is split after the sum: a local slice, no communication."""
    if embed.pos is None and sp:
        parallelize_module(embed.tok, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
        return
    parallelize_module(embed.tok, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if sp:
        parallelize_module(embed, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))


def _parallelize_block(block: nn.Module, tp_mesh: DeviceMesh, *, sp: bool) -> None:
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {
        "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        plan["attn_norm"] = SequenceParallel()
        plan["mlp_norm"] = SequenceParallel()
    plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                     use_local_output=True)
    moe = isinstance(block.mlp, MoE)
    if not moe:
        names = ("fc1", "fc2") if hasattr(block.mlp, "fc1") else ("w1", "w2")
        plan[f"mlp.{names[0]}"] = ColwiseParallel()
        plan[f"mlp.{names[1]}"] = RowwiseParallel(output_layouts=seq)
        if hasattr(block.mlp, "w3"):
            plan["mlp.w3"] = ColwiseParallel()
    parallelize_module(block, tp_mesh, plan)
    if moe and sp:
        # router and experts (expert parallelism's) run on the full, replicated tokens of the tp group;
        # their output goes back to this rank's sequence chunk (a local slice)
        parallelize_module(block.mlp, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))
