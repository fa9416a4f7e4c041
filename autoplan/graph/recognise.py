"""Recognise transformer shapes (hidden, heads, kv heads, FFN width) and mixture-of-experts structure
(routed experts, top-k, shared experts) in one layer's graph nodes and parameters.

Routed experts are either stacked 3-D parameters [E, ., .] (our `Experts`, transformers 5's
`gate_up_proj` / `down_proj`) or a ModuleList of E expert MLPs. Their forward FLOPs are set
analytically to T * top_k expert applications, 2 * (per-expert weight parameters) each, whatever the
traced implementation did (dense, padded or balanced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from autoplan.graph import ops
from autoplan.graph.layers import Hint, Taint, node_path

_LINEAR = {"linear"}
_TRACE_THROUGH = {
    "mul",
    "add",
    "sub",
    "neg",
    "cat",
    "to",
    "_to_copy",
    "contiguous",
    "clone",
    "repeat_interleave",
    "repeat",
}


@dataclass(frozen=True, slots=True)
class Experts:
    paths: tuple[str, ...]  # module paths of the routed experts
    num_experts: int
    expert_params: int
    weight_params_per_expert: int  # matrix parameters of one expert (2 FLOPs each per token)
    ffn_hidden_size: int


def find_experts(model: nn.Module, paths: list[str], hidden: int) -> Experts | None:
    modules = dict(model.named_modules())
    found: list[tuple[str, nn.Module, int]] = []
    for root in paths:
        for sub, module in modules[root].named_modules(prefix=root):
            stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3]
            if stacked and len({p.shape[0] for p in stacked}) == 1 and stacked[0].shape[0] >= 2:
                found.append((sub, module, int(stacked[0].shape[0])))
            elif (
                isinstance(module, (nn.ModuleList, nn.ModuleDict))
                and sub.endswith("experts")
                and len(module) >= 2
            ):
                found.append((sub, module, len(module)))
    if not found:
        return None
    num = found[0][2]
    params = [p for _, m, _ in found for p in m.parameters()]
    matrices = [p for p in params if p.dim() >= 2]
    weight = sum(p.numel() for p in matrices) // num
    ffn = 0
    for p in matrices:
        shape = p.shape[-2:]
        if shape[0] == hidden:  # the down projection [.., h, f]
            ffn = int(shape[1])
    return Experts(
        paths=tuple(s for s, _, _ in found),
        num_experts=num,
        expert_params=sum(p.numel() for p in params),
        weight_params_per_expert=weight,
        ffn_hidden_size=ffn,
    )


def router_tokens_and_topk(nodes: list[fx.Node], experts: Experts, hint: Hint) -> tuple[int, int]:
    """(tokens entering the router, k of the router's topk over the experts dimension)."""
    tokens = top_k = 0
    for node in nodes:
        name = ops.op_name(node.target)
        val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
        if val is None or in_paths(node, experts.paths):
            continue
        if name == "topk" and hint(val.shape[-1]) == experts.num_experts and not top_k:
            top_k = int(node.args[1])
        if name in _LINEAR and not tokens:
            weight = node.args[1].meta.get("val")
            if weight is not None and hint(weight.shape[0]) == experts.num_experts:
                tokens = ops.numel(val, hint) // hint(val.shape[-1])
    return tokens, top_k


def in_paths(node: fx.Node, paths: tuple[str, ...]) -> bool:
    path = node_path(node)
    return any(path == p or path.startswith(p + ".") for p in paths)


@dataclass(frozen=True, slots=True)
class Shape:
    hidden_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    ffn_hidden_size: int = 0


def layer_hidden(nodes: list[fx.Node], taint: Taint, hint: Hint) -> int:
    """Last dim of the largest floating activation entering the layer (its hidden size)."""
    inside = set(nodes)
    vals = [
        a.meta.get("val")
        for n in nodes
        for a in n.all_input_nodes
        if a not in inside and a in taint.activation
    ]
    floats = [
        v
        for v in vals
        if v is not None and hasattr(v, "is_floating_point") and v.is_floating_point() and v.dim() > 0
    ]
    return hint(max(floats, key=lambda t: ops.numel(t, hint)).shape[-1]) if floats else 0


def shared_experts(model: nn.Module, experts: Experts, hidden: int) -> int:
    """Shared experts beside the routed ones (a sibling module named *shared*), in units of the routed
    expert's FFN width (DeepSeekMoE, Dai et al. 2024, fuses them into one MLP of the summed width)."""
    modules = dict(model.named_modules())
    parent = experts.paths[0].rpartition(".")[0]
    for name, module in modules[parent].named_children() if parent in modules else ():
        if "shared" not in name or "gate" in name:
            continue
        downs = [m for m in module.modules() if isinstance(m, nn.Linear) and m.out_features == hidden]
        width = max((m.in_features for m in downs), default=0)  # the down projection f -> h
        if experts.ffn_hidden_size and width:
            return max(1, round(width / experts.ffn_hidden_size))
        return 1
    return 0


def transformer_shape(
    nodes: list[fx.Node], taint: Taint, hint: Hint, microbatch: int, hidden: int, experts: Experts | None
) -> Shape:
    """Heads from the attention op's q [b, heads, s, d] (or [b heads, s, d]); kv heads from the
    projection feeding k; FFN width from the down projection (the linear from f back to hidden)."""
    inside = set(nodes)
    core = _attention_core(nodes, taint)
    if core is None or not hidden:
        return Shape()
    q = core.args[0].meta["val"]
    head_dim = hint(q.shape[-1])
    heads = hint(q.shape[-3]) if q.dim() >= 4 else hint(q.shape[0]) // microbatch
    kv_proj = _source_linear(core.args[1], inside)
    kv_heads = heads
    if kv_proj is not None and kv_proj is not _source_linear(core.args[0], inside):
        kv_heads = hint(kv_proj.args[1].meta["val"].shape[0]) // head_dim
    if not kv_heads or kv_heads > heads or heads % kv_heads:  # a fused qkv projection, or unknown
        kv_heads = heads
    ffn = experts.ffn_hidden_size if experts is not None else 0
    if not ffn:
        for node in nodes:
            if ops.op_name(node.target) in _LINEAR and node in taint.activation:
                weight = node.args[1].meta["val"]
                out_f, in_f = hint(weight.shape[0]), hint(weight.shape[-1])
                if out_f == hidden and in_f != hidden:
                    ffn = in_f
    return Shape(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, ffn_hidden_size=ffn)


def _attention_core(nodes: list[fx.Node], taint: Taint) -> fx.Node | None:
    for node in nodes:
        name = ops.op_name(node.target)
        if ops.is_attention(node.target):
            return node
        if name in {"matmul", "bmm", "einsum"} and not any(n in taint.param for n in node.all_input_nodes):
            return node if name != "einsum" else None
    return None


def _source_linear(start: fx.Node, inside: set[fx.Node]) -> fx.Node | None:
    """Walk back from k through views, RoPE arithmetic and kv-head repeats to its projection."""
    node = start
    for _ in range(64):
        if node not in inside or node.op != "call_function":
            return None
        name = ops.op_name(node.target)
        if name in _LINEAR:
            return node
        if not (ops.is_view(node.target) or name in _TRACE_THROUGH):
            return None
        inputs = [n for n in node.all_input_nodes if n in inside]
        if not inputs:
            return None
        node = inputs[0]
    return None


# A mask is evaluated only up to this many elements (s = 8192 for a square mask): larger ones are left
# unchecked and the layer is taken as non-causal.
_MASK_EVAL_MAX_NUMEL = 1 << 26


def causal_attention(nodes: list[fx.Node], hint: Hint) -> bool:
    """Whether every fused attention op in `nodes` is causal: called with is_causal=True and no mask
    (autoplan.models), or given a mask that equals the lower triangle, recognised by evaluating the
    mask's subgraph when it is built from constants alone (Hugging Face transformers 5 under
    torch.export passes a boolean mask from arange comparisons). A mask fed by an input, a buffer or a
    parameter, or of more than _MASK_EVAL_MAX_NUMEL elements, is not recognised: False."""
    cores = [node for node in nodes if ops.is_attention(node.target)]
    with torch.device("cpu"):  # the caller may be inside `with torch.device("meta")`
        return bool(cores) and all(_core_is_causal(node, hint) for node in cores)


def _core_is_causal(node: fx.Node, hint: Hint) -> bool:
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    mask = bound.get("attn_mask", bound.get("attn_bias"))
    if mask is None:
        return bool(bound.get("is_causal", False))
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    s_q, s_k = hint(q.shape[-2]), hint(k.shape[-2])
    if not isinstance(mask, fx.Node) or s_q != s_k:
        return False
    if "autoplan_lower_triangular" not in mask.meta:  # blocks share one mask: evaluate it once
        mask.meta["autoplan_lower_triangular"] = _is_lower_triangular(mask, s_q, s_k)
    return mask.meta["autoplan_lower_triangular"]


def _is_lower_triangular(mask: fx.Node, s_q: int, s_k: int) -> bool:
    value = _evaluate_constant(mask)
    if value is None or value.dim() < 2 or value.shape[-2:] not in {(s_q, s_k), (1, s_k), (s_q, 1)}:
        return False
    allowed = value if value.dtype == torch.bool else value == 0
    if value.dtype != torch.bool and not bool((value[~allowed] <= -1e4).all()):
        return False  # a bias (ALiBi, relative positions), not a mask
    lower = torch.ones(s_q, s_k, dtype=torch.bool).tril()
    return bool((allowed.expand(*allowed.shape[:-2], s_q, s_k) == lower).all())


def _evaluate_constant(out: fx.Node) -> torch.Tensor | None:
    """Run the subgraph that computes `out` on the CPU, if it reads no input, parameter or buffer and
    every tensor in it has at most _MASK_EVAL_MAX_NUMEL elements; else None."""
    seen: set[fx.Node] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op != "call_function":
            return None
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape):
            return None
        if isinstance(val, torch.Tensor) and val.numel() > _MASK_EVAL_MAX_NUMEL:
            return None
        seen.add(node)
        stack.extend(node.all_input_nodes)
    values: dict[fx.Node, object] = {}
    try:
        for node in (n for n in out.graph.nodes if n in seen):
            args = fx.node.map_arg(node.args, values.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
            if "device" in kwargs:
                kwargs = {**kwargs, "device": torch.device("cpu")}
            values[node] = node.target(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    result = values[out]
    return result if isinstance(result, torch.Tensor) else None
