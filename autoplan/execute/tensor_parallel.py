"""Tensor and sequence parallelism (Megatron-LM style) with DTensor `parallelize_module`.

Per block: wq/wk/wv and fc1 (w1, w3) column-parallel, wo and fc2 (w2) row-parallel, so each rank holds
num_heads/tp heads and ffn/tp hidden units (Shoeybi et al. 2019). With sequence parallelism the norms
and the residual stream are sharded along the sequence between blocks (Korthikanti et al. 2022).
Embedding and head are vocab-parallel; the loss then runs under `loss_parallel()`.
MoE blocks: attention only; router and experts see the full (replicated) tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autoplan.graph.roles import BlockRoles, ModelRoles
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


# --- any model, from the roles the graph capture recognised (graph.roles) -------------------------------------

def _replicated_input(tensor: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """The full sequence from this rank's chunk [B, S/tp, ...] (an all-gather; its backward reduce-scatters)."""
    if not isinstance(tensor, DTensor):
        tensor = DTensor.from_local(tensor, tp_mesh, [Shard(1)], run_check=False)
    return tensor.redistribute(tp_mesh, [Replicate()]).to_local()


def gather_sequence_input(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Before `module` runs, gather its hidden-states input (the first positional argument, else the
    `hidden_states` keyword: Hugging Face layers pass it by name) from sequence chunks to the full sequence."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            return (_replicated_input(args[0], tp_mesh), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": _replicated_input(kwargs["hidden_states"], tp_mesh)}
        raise ValueError(f"{type(_module).__name__} got no hidden-states tensor to gather (sequence parallelism)")

    module.register_forward_pre_hook(hook, with_kwargs=True)


def scatter_sequence_output(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """After `module` runs on the full sequence (replicated over tp), keep this rank's sequence chunk of its
    output (the first element of a tuple output): a local slice whose backward all-gathers the gradient."""

    def split(tensor: torch.Tensor) -> torch.Tensor:
        replicated = DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False)
        return replicated.redistribute(tp_mesh, [Shard(1)]).to_local()

    def hook(_module: nn.Module, _args: tuple, output: object) -> object:
        if isinstance(output, tuple):
            return (split(output[0]), *output[1:])
        return split(output)  # type: ignore[arg-type]

    module.register_forward_hook(hook)


def vocab_parallel(roles: ModelRoles, model: nn.Module, tp: int) -> tuple[bool, bool]:
    """(embedding, head) split over the vocabulary? Needs tp | vocabulary; an embedding with a padding_idx stays
    replicated (the padding row is a global index), and a head tied to the embedding does what it does."""
    modules = dict(model.named_modules())
    if tp == 1 or not roles.vocab_size or roles.vocab_size % tp:  # no vocabulary (an image model): nothing to split
        return False, False
    embedding = modules.get(roles.embedding)
    embed = embedding is not None and getattr(embedding, "padding_idx", None) is None
    head = embed if roles.tied else True
    return embed, head


def apply_tensor_parallel_roles(model: nn.Module, roles: ModelRoles, *, tp_mesh: DeviceMesh, sp: bool,
                                vocab: tuple[bool, bool]) -> None:
    """Shard `model` (a whole model or a pipeline stage of it) over tp_mesh in place from its roles: per block
    q/k/v and gate/up column-parallel, o and down row-parallel, norms sequence-parallel with sp (attention and
    MLP inputs gathered); MoE layers: attention only, router and experts on the gathered tokens; embedding and
    head vocab-parallel where `vocab` says so (vocab_parallel), the loss then under loss_parallel()."""
    if tp_mesh.size() == 1:
        return
    seq = Shard(1) if sp else Replicate()
    present = dict(model.named_modules())
    plan: dict[str, object] = {}
    embed = present.get(roles.embedding)
    if embed is not None and vocab[0]:
        plan[roles.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    for path, block in roles.blocks:
        if path in present:
            plan.update(_block_plan(block, seq, sp))
    if sp and roles.final_norm in present:
        plan[roles.final_norm] = SequenceParallel()
    head = present.get(roles.head)
    if head is not None and vocab[1]:
        plan[roles.head] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, plan)
    _sequence_hooks(model, roles, present, tp_mesh, sp=sp, vocab=vocab)
    if roles.tied and embed is not None and head is not None:
        head.weight = embed.weight  # one parameter again (both sharded alike, or both replicated)


def _block_plan(block: BlockRoles, seq: object, sp: bool) -> dict[str, object]:
    plan: dict[str, object] = {path: ColwiseParallel() for path in block.column}
    plan.update({path: RowwiseParallel(output_layouts=seq) for path in block.row})
    if sp:
        plan.update({path: SequenceParallel() for path in block.norms})
    return plan


def _sequence_hooks(model: nn.Module, roles: ModelRoles, present: dict[str, nn.Module], tp_mesh: DeviceMesh, *,
                    sp: bool, vocab: tuple[bool, bool]) -> None:
    if not sp:
        return
    if roles.embedding in present and not vocab[0]:
        scatter_sequence_output(present[roles.embedding], tp_mesh)
    for path, block in roles.blocks:
        if path not in present:
            continue
        for owner in (block.attention, block.mlp):
            if owner:
                gather_sequence_input(present[owner], tp_mesh)
        if block.experts and block.mlp:
            scatter_sequence_output(present[block.mlp], tp_mesh)
    if roles.head in present and not vocab[1]:
        gather_sequence_input(present[roles.head], tp_mesh)
