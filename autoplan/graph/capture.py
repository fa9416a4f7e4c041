"""capture(model, seq_len=..., microbatch=...) -> LayerGraph: trace a model with no memory and measure
each layer. The only torch.export / fx user in autoplan.

The model is copied onto the meta device (parameters as empty meta tensors of `dtype`; real weights are
never read or moved), traced with torch.export (strict=False), or torch.fx.symbolic_trace + export as a
fallback. Repeated blocks with identical modules are traced once and reused (`reuse_blocks=True`); the
result equals a full capture (tests check it).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from autoplan.graph import activations, components, layers, recognise
from autoplan.graph.errors import CaptureError, describe_failure
from autoplan.graph.meta import meta_copy as _meta_copy
from autoplan.graph.meta import to_meta_in_place as _to_meta_in_place
from autoplan.graph.types import ComponentGraph, Layer, LayerGraph, LayerRole

__all__ = ["CaptureError", "capture", "capture_components"]


def capture(
    model: nn.Module,
    *,
    seq_len: int,
    microbatch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    model_name: str | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    reuse_blocks: bool = True,
    copy_model: bool = True,
) -> LayerGraph:
    """The layer graph of `model` for one microbatch of `microbatch` sequences of `seq_len` tokens.

    Models with an nn.Embedding get token ids [microbatch, seq_len] (Hugging Face models as
    `input_ids=..., use_cache=False`); others a float input [microbatch, seq_len, in_features] for a
    leading Linear, [microbatch, C, side*stride, side*stride] with side = sqrt(seq_len) patches for a
    leading Conv2d; or pass `example_inputs` (tensors on any device; only shapes and dtypes are used).
    `copy_model=False` traces `model` itself, its tensors swapped in place for the same meta tensors (faster,
    the same graph; for a model built only to be captured: it is left on meta, in train mode).
    """
    _check_size("seq_len", seq_len)
    _check_size("microbatch", microbatch)
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture needs an nn.Module, got {type(model).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    shadow = _meta_copy(model, dtype) if copy_model else _to_meta_in_place(model, dtype)
    shadow.train()
    args, kwargs = _inputs(shadow, seq_len, microbatch, example_inputs)
    units = layers.find_units(shadow)
    full_blocks = units.blocks
    rep_of = _representatives(shadow, units) if reuse_blocks else {}
    if rep_of:
        _keep_only(shadow, units.container, sorted(set(rep_of.values()), key=full_blocks.index))
    ep, method = _trace(shadow, args, kwargs)
    if rep_of:
        _keep_only(shadow, units.container, list(full_blocks))
    built, note = _measure(ep, shadow, units, microbatch, seq_len)
    built = _expand(built, full_blocks, rep_of)
    notes = [note] if note else []
    if rep_of:
        notes.append(f"{len(set(rep_of.values()))} distinct blocks traced, reused for {len(rep_of)}")
    vocab = max((m.num_embeddings for m in shadow.modules() if isinstance(m, nn.Embedding)), default=0)
    return LayerGraph(
        model_name=model_name or _name_of(model),
        layers=tuple(built),
        seq_len=seq_len,
        microbatch=microbatch,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        vocab_size=vocab,
        tied_embedding_params=layers.tied_embedding_params(shadow),
        num_nodes=sum(layer.num_nodes for layer in built),
        capture_method=method,
        notes=tuple(notes),
        input_shape=_sample_shape(args, kwargs),
    )


def capture_components(
    model: nn.Module,
    *,
    seq_len: int,
    microbatch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    model_name: str | None = None,
    example_inputs: tuple[Any, ...] | None = None,
) -> ComponentGraph:
    """The model as a DAG of components (graph/components.py), each with its own LayerGraph, from one
    trace; the inputs are those of `capture` (LLaVA-style models get pixel_values and input_ids of
    seq_len tokens, the image's tokens first). A single-chain model gives one component holding
    `capture`'s graph. Blocks are all traced (no reuse across identical blocks)."""
    _check_size("seq_len", seq_len)
    _check_size("microbatch", microbatch)
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture needs an nn.Module, got {type(model).__name__}")
    name = model_name or _name_of(model)
    shadow = _meta_copy(model, dtype)
    roots = components.find_roots(shadow)
    if not roots:
        return components.single(capture(model, seq_len=seq_len, microbatch=microbatch, dtype=dtype,
                                         model_name=name, example_inputs=example_inputs))
    shadow.train()
    args, kwargs = _inputs(shadow, seq_len, microbatch, example_inputs)
    ep, method = _trace(shadow, args, kwargs)
    taint = _taint(ep)
    split = components.split_graph(ep.graph, shadow, roots, taint, layers.Hint(), seq_len)
    saved, note = activations.saved_for_backward(ep, taint, min(split.seq_lens.values()), microbatch)
    measured = {spec.name: _measure_groups(ep, shadow, split.groups[spec.name], taint, saved, microbatch)
                for spec in split.specs}
    return components.assemble(split, measured, model_name=name, microbatch=microbatch,
                               dtype_bytes=torch.empty((), dtype=dtype).element_size(), method=method,
                               notes=(note,) if note else (), input_shapes=components.input_shapes(ep))


def _sample_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """One sample's shape of the first tensor input (its batch dimension dropped)."""
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
    return tuple(int(d) for d in first.shape[1:]) if first is not None and first.dim() > 0 else ()


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{name} must be a positive integer, got {value!r}; pass e.g. {name}=2048"
            if name == "seq_len"
            else f"{name} must be a positive integer, got {value!r}; pass e.g. {name}=1"
        )


def _inputs(
    model: nn.Module, seq_len: int, microbatch: int, example: tuple[Any, ...] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if example is not None:
        # floating inputs take the capture dtype (the parameters'), integer ones (token ids) keep theirs
        floating = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        metas = tuple(
            torch.empty(x.shape, dtype=floating if x.is_floating_point() else x.dtype, device="meta")
            if isinstance(x, torch.Tensor) else x
            for x in example
        )
        return metas, {}
    multimodal = components.multimodal_inputs(model, seq_len, microbatch)
    if multimodal is not None:
        return (), multimodal
    if any(isinstance(m, nn.Embedding) for m in model.modules()):
        ids = torch.zeros(microbatch, seq_len, dtype=torch.long, device="meta")
        if hasattr(model, "config") and hasattr(model, "can_generate"):  # a transformers PreTrainedModel
            return (), {"input_ids": ids, "use_cache": False}
        return (ids,), {}
    first = next((m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))), None)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if isinstance(first, nn.Linear):
        shape: tuple[int, ...] = (microbatch, seq_len, first.in_features)
    elif isinstance(first, nn.Conv1d):
        shape = (microbatch, first.in_channels, seq_len * first.stride[0])
    elif isinstance(first, nn.Conv2d):
        side = math.isqrt(seq_len)
        if side * side != seq_len:
            raise ValueError(
                f"a model starting with Conv2d takes seq_len = patches = side^2, got "
                f"{seq_len}; pass a square seq_len or example_inputs=(images,)"
            )
        shape = (microbatch, first.in_channels, side * first.stride[0], side * first.stride[1])
    else:
        raise ValueError(
            f"cannot infer the input of {type(model).__name__} (no Embedding, Linear or "
            f"Conv first); pass example_inputs=(tensor, ...)"
        )
    return (torch.empty(shape, dtype=dtype, device="meta"),), {}


def _representatives(model: nn.Module, units: layers.Units) -> dict[str, str]:
    """Block path -> the first block with an identical module signature; empty when reuse saves nothing
    or does not apply (a parameterless block)."""
    modules = dict(model.named_modules())
    container = modules[units.container]
    if len(units.blocks) < 2 or not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return {}
    if not all(layers.has_params(modules[b]) for b in units.blocks):
        return {}
    firsts: dict[str, str] = {}
    rep_of = {b: firsts.setdefault(_signature(modules[b]), b) for b in units.blocks}
    return rep_of if len(firsts) < len(units.blocks) else {}


def _signature(module: nn.Module) -> str:
    parts: list[Any] = []
    for name, sub in module.named_modules():
        attrs = sorted(
            (k, v)
            for k, v in vars(sub).items()
            if not k.startswith("_")
            and k not in {"training", "layer_idx", "layer_id", "layer_number", "index"}
            and isinstance(v, (int, float, str, bool, type(None)))
        )
        parts.append((name, type(sub).__qualname__, attrs))
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        parts.append((name, tuple(t.shape), str(t.dtype), t.requires_grad))
    return repr(parts)


def _keep_only(model: nn.Module, container_path: str, children: list[str]) -> None:
    container = model.get_submodule(container_path)
    every = {**container._modules, **getattr(container, "_autoplan_all", {})}
    container._autoplan_all = every  # type: ignore[attr-defined]
    names = [c.rpartition(".")[2] if container_path else c for c in children]
    container._modules = OrderedDict((n, every[n]) for n in names)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export prints the partial graph and guard warnings of a failed trace to stderr; the
    CaptureError says what failed in one line."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def _trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[ExportedProgram, str]:
    with _quiet_torch_logs():
        return _trace_loud(model, args, kwargs)


def _trace_loud(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[ExportedProgram, str]:
    try:
        return torch.export.export(model, args, kwargs, strict=False), "export"
    except Exception as exc:  # noqa: BLE001 - every tracing failure becomes one CaptureError line
        first = exc
    with contextlib.suppress(Exception):  # the fallback failing too: report the first failure
        traced = torch.fx.symbolic_trace(model)
        return torch.export.export(traced, args, kwargs, strict=False), "symbolic_trace"
    raise CaptureError(describe_failure(first, model)) from first


def _measure(
    ep: ExportedProgram, model: nn.Module, units: layers.Units, microbatch: int, seq_len: int
) -> tuple[list[Layer], str]:
    """The measured layers of the traced graph, and a note on how activations were measured."""
    taint = _taint(ep)
    groups = layers.group_nodes(ep.graph, units, model)
    saved, note = activations.saved_for_backward(ep, taint, seq_len, microbatch)
    return _measure_groups(ep, model, groups, taint, saved, microbatch), note


def _taint(ep: ExportedProgram) -> layers.Taint:
    specs = ep.graph_signature.input_specs
    user = {s.arg.name for s in specs if s.kind is InputKind.USER_INPUT}
    params = {
        s.arg.name
        for s in specs
        if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    }
    return layers.taint(ep.graph, user, params)


def _measure_groups(ep: ExportedProgram, model: nn.Module, groups: list[layers.Group], taint: layers.Taint,
                    saved: dict, microbatch: int) -> list[Layer]:
    owner = _param_owners(ep, model, groups)
    hint = layers.Hint()
    return [_layer(group, index, model, owner, taint, hint, saved, microbatch) for index, group in enumerate(groups)]


def _param_owners(ep: ExportedProgram, model: nn.Module, groups: list[layers.Group]) -> dict[str, int]:
    """Parameter FQN -> index of the group that owns it (by module path, else its first user)."""
    paths = {p: i for i, g in enumerate(groups) for p in g.paths}
    node_group = {n: i for i, g in enumerate(groups) for n in g.nodes}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    by_target = {
        s.target: placeholders.get(s.arg.name)
        for s in ep.graph_signature.input_specs
        if s.kind is InputKind.PARAMETER
    }
    owner: dict[str, int] = {}
    for fqn, _ in model.named_parameters():
        unit = layers.unit_of(fqn.rpartition(".")[0], set(paths))
        if unit is not None:
            owner[fqn] = paths[unit]
            continue
        node = by_target.get(fqn)
        users = [node_group[u] for u in node.users if u in node_group] if node is not None else []
        if users:
            owner[fqn] = min(users)
    return owner


def _layer(
    group: layers.Group,
    index: int,
    model: nn.Module,
    owner: dict[str, int],
    taint: layers.Taint,
    hint: layers.Hint,
    saved: dict,
    microbatch: int,
) -> Layer:
    nodes = group.nodes
    own = [(fqn, p) for fqn, p in model.named_parameters() if owner.get(fqn) == index]
    hidden = recognise.layer_hidden(nodes, taint, hint)
    experts = recognise.find_experts(model, group.paths, hidden)
    moe: dict[str, Any] = {}
    hint.unbacked = 1
    if experts is not None:
        tokens, top_k = recognise.router_tokens_and_topk(nodes, experts, hint)
        top_k = top_k or layers.module_topk(model, group.paths)
        hint.unbacked = max(1, tokens * top_k // experts.num_experts)
        moe = {
            "num_experts": experts.num_experts,
            "top_k": top_k,
            "expert_params": experts.expert_params,
            "num_shared_experts": recognise.shared_experts(model, experts, hidden),
            # T * top_k expert applications, 2 FLOPs per expert weight each
            "fwd_expert_flops": 2.0 * tokens * top_k * experts.weight_params_per_expert,
        }
    m = layers.measure(nodes, taint, hint, experts.paths if experts else ())
    shape = recognise.transformer_shape(nodes, taint, hint, microbatch, hidden, experts)
    act, attn_act = layers.saved_bytes(nodes, saved)
    in_bytes, out_bytes = layers.boundary_bytes(nodes, taint, hint)
    relative = sorted((_relative(fqn, group.paths), tuple(p.shape), str(p.dtype)) for fqn, p in own)
    kind = f"{group.role.value}/{'moe' if experts else 'dense'}/{layers.kind_hash(group.role, m.signature, relative)}"
    return Layer(
        name=group.name,
        kind=kind,
        role=group.role,
        index=index,
        fwd_matmul_flops=m.matmul + moe.get("fwd_expert_flops", 0.0),
        fwd_attention_flops=m.attention,
        fwd_elementwise_flops=m.elementwise,
        num_params=sum(p.numel() for _, p in own),
        param_bytes=sum(p.numel() * p.element_size() for _, p in own),
        activation_bytes=act,
        attention_activation_bytes=attn_act,
        causal_attention=recognise.causal_attention(nodes, hint),
        input_bytes=in_bytes,
        output_bytes=out_bytes,
        bytes_moved=m.bytes_moved,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        ffn_hidden_size=shape.ffn_hidden_size,
        module_paths=tuple(group.paths),
        num_nodes=len(nodes),
        **moe,
    )


def _relative(fqn: str, paths: list[str]) -> str:
    for path in paths:
        if path and fqn.startswith(path + "."):
            return f"{paths.index(path)}:{fqn[len(path) + 1 :]}"
    return fqn


def _expand(built: list[Layer], full_blocks: tuple[str, ...], rep_of: dict[str, str]) -> list[Layer]:
    """Replace the traced representatives by every block they stand for, in model order."""
    if not rep_of:
        return built
    by_name = {layer.name: layer for layer in built}
    out: list[Layer] = []
    done = False
    for layer in built:
        if layer.role is LayerRole.BLOCK and layer.name in by_name and layer.name in rep_of:
            if not done:
                out += [replace(by_name[rep_of[b]], name=b, module_paths=(b,)) for b in full_blocks]
                done = True
            continue
        out.append(layer)
    return [replace(layer, index=i) for i, layer in enumerate(out)]


def _name_of(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    for attr in ("name", "name_or_path", "_name_or_path", "model_type"):
        value = getattr(config, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(model).__name__
