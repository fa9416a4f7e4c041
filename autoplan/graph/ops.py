"""Per-op conventions: forward FLOPs (matmul / attention / elementwise) and bytes moved of one ATen node.

Matmuls count 2 m n k (Narayanan et al., SC'21, appendix). Elementwise ops count one FLOP per output
element, except: reductions one per input element; softmax 5 (max, sub, exp, sum, div); layer_norm 5
and rms_norm 4 per element; gelu 8 (tanh form); silu / sigmoid / tanh 4. Views, copies, casts,
indexing and creation ops count no FLOPs; a fused bias add one per output element. Bytes moved: inputs read plus outputs written, views free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

_ATTENTION_OPS = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
}
_MATMUL_OPS = {
    "mm",
    "bmm",
    "matmul",
    "addmm",
    "baddbmm",
    "addbmm",
    "einsum",
    "linear",
    "_grouped_mm",
    "grouped_mm",
    "grouped_mm_fallback",
    "convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "_convolution",
}
# ops that alias their input: no FLOPs and no memory traffic
VIEW_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "t",
    "permute",
    "expand",
    "expand_as",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "alias",
    "detach",
    "getitem",
    "view_as",
    "unflatten",
    "flatten",
    "narrow",
    "as_strided",
    "_assert_tensor_metadata",
    "_assert_scalar",
    "sym_size",
    "sym_numel",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "lift_fresh_copy",
    "dropout_",
    "movedim",
    "diagonal",
    "real",
    "set_grad_enabled",
    "_set_grad_enabled",
    "item",
    "_local_scalar_dense",
    "contiguous_format",
}
# ops that move or create data but compute nothing
_ZERO_FLOP_OPS = {
    "to",
    "_to_copy",
    "clone",
    "contiguous",
    "copy",
    "copy_",
    "cat",
    "stack",
    "index",
    "index_select",
    "gather",
    "embedding",
    "arange",
    "full",
    "zeros",
    "ones",
    "empty",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "scalar_tensor",
    "repeat",
    "repeat_interleave",
    "tril",
    "triu",
    "one_hot",
    "index_put",
    "index_put_",
    "scatter",
    "scatter_",
    "masked_select",
    "nonzero",
    "type_as",
    "fill",
    "fill_",
    "zero_",
    "pad",
    "constant_pad_nd",
    "roll",
    "flip",
    "lift_fresh",
    "_unsafe_index",
    "sort",
    "argsort",
    "bernoulli",
    "rand",
    "randn",
    "rand_like",
    "randn_like",
    "native_dropout",
    "dropout",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "logical_not",
    "bitwise_and",
    "bitwise_or",
    "__and__",
    "__or__",
    "histc",
    "bincount",
    "diff",
    "floor_divide",
    "topk",
    "argmax",
    "argmin",
    "where_self_out",
}
_PER_ELEMENT = {
    "softmax": 5,
    "_softmax": 5,
    "log_softmax": 5,
    "_log_softmax": 5,
    "layer_norm": 5,
    "native_layer_norm": 5,
    "rms_norm": 4,
    "_fused_rms_norm": 4,
    "group_norm": 5,
    "native_group_norm": 5,
    "batch_norm": 5,
    "native_batch_norm": 5,
    "_native_batch_norm_legit_functional": 5,
    "_native_batch_norm_legit_no_training": 5,
    "gelu": 8,
    "silu": 4,
    "sigmoid": 4,
    "tanh": 4,
    "mish": 6,
    "softplus": 4,
    "erf": 4,
}
_REDUCTIONS = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "std",
    "var_mean",
    "norm",
    "linalg_vector_norm",
    "cumsum",
    "logsumexp",
    "prod",
    "all",
    "any",
}


def op_name(target: Any) -> str:
    """'aten.linear.default' -> 'linear'; operator.getitem -> 'getitem'; custom ops by their name."""
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def is_view(target: Any) -> bool:
    return op_name(target) in VIEW_OPS


def is_attention(target: Any) -> bool:
    return op_name(target) in _ATTENTION_OPS


def tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Tensors (fake or meta) in a node's meta['val'] or args structure."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors(item)


def numel(t: torch.Tensor, hint: Callable[[Any], int]) -> int:
    return math.prod(hint(d) for d in t.shape)


def nbytes(t: torch.Tensor, hint: Callable[[Any], int]) -> int:
    return numel(t, hint) * t.element_size()


def matmul_flops(name: str, args: tuple, out: torch.Tensor, hint: Callable[[Any], int]) -> float:
    """2 m n k for one matmul-like op; `args` holds the input tensors' meta values (or None)."""
    out_numel = numel(out, hint)
    if name == "einsum":
        return 2.0 * out_numel * _einsum_contracted(args, hint)
    if name in {"addmm", "baddbmm", "addbmm"}:
        a = args[1]
    elif name in {"convolution", "_convolution", "conv1d", "conv2d", "conv3d"}:
        weight = args[1]
        per_out = math.prod(hint(d) for d in weight.shape[1:])  # in_channels / groups * kernel
        return 2.0 * out_numel * per_out
    else:
        a = args[0]
    if name == "addbmm":
        return 2.0 * out_numel * hint(a.shape[0]) * hint(a.shape[-1])
    return 2.0 * out_numel * hint(a.shape[-1])


def _einsum_contracted(args: tuple, hint: Callable[[Any], int]) -> int:
    """Product of the sizes of the summed-over letters (those absent from the output)."""
    equation, operands = args[0].replace(" ", ""), args[1]
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    if not _:
        letters = [c for c in lhs if c.isalpha()]
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    sizes: dict[str, int] = {}
    for term, t in zip(terms, operands):
        explicit = term.replace("...", "")
        if "..." in term:  # letters after the ellipsis align with the trailing dims
            head, tail = term.split("...")
            dims = list(t.shape[: len(head)]) + (list(t.shape[-len(tail) :]) if tail else [])
        else:
            dims = list(t.shape)
        for letter, dim in zip(explicit, dims):
            sizes[letter] = hint(dim)
    return math.prod(size for letter, size in sizes.items() if letter not in rhs)


def bias_flops(name: str, args: tuple, out: torch.Tensor, hint: Callable[[Any], int]) -> float:
    """The bias add fused into linear / addmm / convolution: one FLOP per output element."""
    if name in {"addmm", "baddbmm", "addbmm"}:
        return float(numel(out, hint))
    if name in {"linear", "convolution", "_convolution", "conv1d", "conv2d", "conv3d"}:
        return float(numel(out, hint)) if len(args) > 2 and args[2] is not None else 0.0
    return 0.0


def attention_flops(args: tuple, hint: Callable[[Any], int]) -> float:
    """Q K^T plus scores x V of a fused attention op: 2 b h s_q s_k (d + d_v), causal counted in full
    as Megatron-LM does (Narayanan et al., SC'21)."""
    q, k, v = args[0], args[1], args[2]
    batch_heads = math.prod(hint(d) for d in q.shape[:-2])
    s_q, d = hint(q.shape[-2]), hint(q.shape[-1])
    s_k, d_v = hint(k.shape[-2]), hint(v.shape[-1])
    return 2.0 * batch_heads * s_q * s_k * (d + d_v)


def elementwise_flops(name: str, args: tuple, out: Any, hint: Callable[[Any], int]) -> float:
    if name in VIEW_OPS or name in _ZERO_FLOP_OPS or name.startswith("_assert"):
        return 0.0
    outs = list(tensors(out))
    if not outs:
        return 0.0
    if name in _REDUCTIONS:
        ins = list(tensors(args))
        return float(numel(ins[0], hint)) if ins else 0.0
    per = _PER_ELEMENT.get(name, 1)
    return float(per * numel(outs[0], hint))


def classify(name: str) -> str:
    """'attention', 'matmul', 'view' or 'elementwise'."""
    if name in _ATTENTION_OPS:
        return "attention"
    if name in _MATMUL_OPS:
        return "matmul"
    if name in VIEW_OPS:
        return "view"
    return "elementwise"
