"""Where the executor cannot parallelise part of a model the way a plan asks: the module and the reason, in one
line, before launch (preflight). Presets are checked by their own executor's rules (divisibility and the
stage layout); these are the limits for other models, each following from how execute/ applies the plan.
"""

from __future__ import annotations

import torch
from torch import nn

from autoplan.execute.source import ModelSpec
from autoplan.graph.types import LayerRole
from autoplan.plan.types import ParallelConfig


def unsupported(spec: ModelSpec, meta: nn.Module, config: ParallelConfig, *, seq_len: int) -> str | None:
    """The first thing about `meta` the executor cannot do for `config`, or None."""
    checks = (_length, _tensor_parallel, _sequence_parallel, _pipeline, _context_parallel, _experts, _weights)
    for check in checks:
        problem = check(spec, meta, config, seq_len)
        if problem:
            return problem
    return None


def _length(spec: ModelSpec, meta: nn.Module, config: ParallelConfig, seq_len: int) -> str | None:
    c = getattr(meta, "config", None)
    if spec.is_preset:
        limit = c.max_seq_len
        return None if seq_len <= limit else f"seq_len {seq_len} exceeds {spec.name}'s max_seq_len {limit}: use " \
                                             f"--seq-len <= {limit}"
    if spec.family == "gpt2" and seq_len > c.n_positions:
        return f"seq_len {seq_len} exceeds {spec.name}'s {c.n_positions} learned positions: use --seq-len <= " \
               f"{c.n_positions}"
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
    if spec.family == "hf-decoder" and isinstance(window, int) and 0 < window < seq_len:
        return (f"{spec.name} uses sliding-window attention (window {window}) and autoplan's runner runs full causal "
                f"attention: use --seq-len <= {window}")
    return None


def _tensor_parallel(spec: ModelSpec, meta: nn.Module, config: ParallelConfig, seq_len: int) -> str | None:
    if config.tp == 1 or spec.is_preset:
        return None
    for path, block in spec.roles.blocks:
        if block.unsupported:
            return f"tp={config.tp}: {block.unsupported[0]}; use tp=1 for this model"
        if not block.column or not block.row:
            return (f"tp={config.tp}: no attention or MLP projections recognised in {path} (separate nn.Linear q/k/v/o, "
                    f"gate/up/down): use tp=1 for this model")
    return None


def _sequence_parallel(spec: ModelSpec, meta: nn.Module, config: ParallelConfig, seq_len: int) -> str | None:
    if not config.sp or spec.is_preset:
        return None
    roles = spec.roles
    embedding = [p for u in roles.layers if u.role is LayerRole.EMBEDDING for p in u.paths
                 if next(meta.get_submodule(p).parameters(), None) is not None]
    if embedding != [roles.embedding]:
        return (f"sp: the embedding layer holds {', '.join(embedding)} and the forward combines their outputs, but "
                f"sequence parallelism splits the sequence at the output of {roles.embedding or 'a token embedding'} "
                f"alone: use sp=False")
    for path, block in roles.blocks:
        mlp_projections = len(block.column) + len(block.row) > (4 if block.attention else 0)
        if (block.attention_op and not block.attention) or (mlp_projections and not block.mlp and not block.experts):
            what = "attention" if block.attention_op and not block.attention else "MLP"
            return (f"sp: the {what} projections of {path} are not inside one submodule, so their input cannot be "
                    f"gathered from the sequence chunks: use sp=False")
    return None


def _pipeline(spec: ModelSpec, meta: nn.Module, config: ParallelConfig, seq_len: int) -> str | None:
    if config.pp == 1 or spec.is_preset:
        return None
    roles = spec.roles
    if roles.tied:
        return (f"pp={config.pp}: {roles.head}.weight is tied to {roles.embedding}.weight, but the head runs on the "
                f"last pipeline stage and the embedding on the first, which cannot share one weight: use pp=1")
    if spec.family == "module":
        from autoplan.execute.runner import check_chain

        example = (torch.zeros(1, *spec.input_shape, device="meta") if spec.input_shape else
                   torch.zeros(1, min(seq_len, 16), dtype=torch.long, device="meta"))
        reason = check_chain(meta, roles, example)
        if reason:
            return (f"pp={config.pp}: pipeline stages run {spec.name}'s layers one after another, but {reason}: "
                    f"use pp=1 for this model")
    return None


def _context_parallel(spec: ModelSpec, meta: nn.Module, config: ParallelConfig, seq_len: int) -> str | None:
    if config.cp == 1 or spec.is_preset:
        return None
    if spec.family == "module":
        return (f"cp={config.cp}: context parallelism needs the model's attention and positions in autoplan's hands "
                f"(presets, Hugging Face decoders through transformers' AttentionInterface); {spec.name} computes "
                f"them in its own forward: use cp=1")
    c = getattr(meta, "config", None)
    dropout = float(getattr(c, "attention_dropout", getattr(c, "attn_pdrop", 0.0)) or 0.0)
    if dropout:
        return f"cp={config.cp}: attention dropout {dropout} is not supported by the context-parallel core: use cp=1"
    for path, block in spec.roles.blocks:
        attention = meta.get_submodule(block.attention_op) if block.attention_op else None
        scaling = getattr(attention, "scaling", None)
        if attention is None or (scaling is not None and block.head_dim and
                                 abs(scaling - block.head_dim ** -0.5) > 1e-12):
            return (f"cp={config.cp}: {block.attention_op or path} scales attention by {scaling}, not "
                    f"1/sqrt(head_dim), which the context-parallel core assumes: use cp=1")
    return None


def _experts(spec: ModelSpec, meta: nn.Module, config: ParallelConfig, seq_len: int) -> str | None:
    if config.folded:  # MoE folding (execute.experts): autoplan's presets, etp = 1
        from autoplan.execute.experts import check_expert_layout

        try:
            check_expert_layout(config)
        except ValueError as exc:
            return str(exc)
        if not spec.is_preset:
            return (f"etp={config.expert_tp}, eep={config.expert_ep}: folded expert layouts run on autoplan's presets "
                    f"only; for {spec.name} leave etp / eep unset (experts on the ep axis)")
    if config.ep == 1 or spec.is_preset:
        return None
    from autoplan.execute.experts import is_hf_experts

    for _, block in spec.roles.blocks:
        if block.experts and not is_hf_experts(meta.get_submodule(block.experts)):
            module = meta.get_submodule(block.experts)
            return (f"ep={config.ep}: {block.experts} ({type(module).__name__}) is not a stacked-experts module "
                    f"(transformers 5's gate_up_proj / down_proj with act_fn), which expert parallelism splits: "
                    f"use ep=1")
    return None


def _weights(spec: ModelSpec, meta: nn.Module, config: ParallelConfig, seq_len: int) -> str | None:
    if spec.weights:
        from autoplan.execute.weights import WeightFiles

        try:
            WeightFiles(spec.weights, base_prefix=spec.base_prefix).check(meta)
        except ValueError as exc:
            return str(exc)
    return None


__all__ = ["unsupported"]
