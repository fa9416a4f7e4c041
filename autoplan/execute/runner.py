"""The forward of one pipeline stage (or of the whole model) of a model that is not a preset.

A stage is a copy of the model with the other blocks removed from the block container (which becomes a
ModuleDict keyed by the original indices, so every parameter keeps its original name: plans, checkpoints and
weights files refer to them) and the embedding / head modules set to None off the first / last stage. Its
`forward` is replaced on the instance by the family's runner:

- "hf-decoder" (Llama, Mistral, Qwen2, Mixtral, ...): embed_tokens on the first stage; RoPE from explicit
  global positions on every stage (the full sequence under sequence parallelism, this rank's zig-zag
  positions under context parallelism); each decoder layer called with attention_mask=None, so attention is
  causal SDPA; norm and lm_head on the last stage;
- "gpt2": wte + wpe(positions), dropout, the blocks, ln_f, lm_head;
- "module": the model's own forward when it is not pipelined; otherwise the layer units of the captured graph
  in order, each applied to the previous one's output (check_chain verifies that this is the model's forward).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoplan.execute.context import zigzag_positions
from autoplan.graph.roles import ModelRoles
from autoplan.graph.types import LayerRole


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInfo:
    family: str
    first: bool
    last: bool
    base: str = ""  # the Hugging Face base model's attribute ("model", "transformer")
    chain: tuple[str, ...] = ()  # "module" family, pipelined: the units this stage runs, in order
    seq_factor: int = 1  # sequence parallel degree: a hidden state holds 1/seq_factor of the sequence
    cp: int = 1
    cp_rank: int = 0


def logits_of(output: Any) -> torch.Tensor:
    """A model output as the logits tensor: itself, its `.logits`, or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValueError(f"the model returned {type(output).__name__}; autoplan trains on logits [batch, seq, vocab]: "
                     f"return them (a tensor, an object with .logits, or a tuple starting with them)")


def _positions(info: StageInfo, local_len: int, device: torch.device) -> torch.Tensor:
    """Global positions [1, S] of the sequence this rank's attention sees (all of the tp group's sequence)."""
    return zigzag_positions(local_len * info.cp, info.cp, info.cp_rank, device=device)[None]


def _hf_decoder_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    info: StageInfo = self.autoplan_stage
    base = getattr(self, info.base)
    h = base.embed_tokens(x) if info.first else x
    local_len = x.shape[1] if info.first else x.shape[1] * info.seq_factor
    position_ids = _positions(info, local_len, h.device)
    rope = base.rotary_emb(h, position_ids) if getattr(base, "rotary_emb", None) is not None else None
    for layer in base.layers.values():
        h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rope)
        h = h[0] if isinstance(h, tuple) else h
    if info.last:
        h = self.lm_head(base.norm(h))
    return h


def _gpt2_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    info: StageInfo = self.autoplan_stage
    base = getattr(self, info.base)
    if info.first:
        h = base.drop(base.wte(x) + base.wpe(_positions(info, x.shape[1], x.device)))
    else:
        h = x
    for block in base.h.values():
        h = block(h, attention_mask=None)
        h = h[0] if isinstance(h, tuple) else h
    if info.last:
        h = self.lm_head(base.ln_f(h))
    return h


def _chain_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for path in self.autoplan_stage.chain:
        x = self.get_submodule(path)(x)
    return logits_of(x) if self.autoplan_stage.last else x


def _own_forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    return logits_of(type(self).forward(self, *args, **kwargs))


_RUNNERS = {"hf-decoder": _hf_decoder_forward, "gpt2": _gpt2_forward}


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, child = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), child


def chain_units(roles: ModelRoles) -> tuple[str, ...]:
    """Every module path of the captured layers, in forward order (the "module" family's pipeline chain)."""
    return tuple(path for unit in roles.layers for path in unit.paths)


def _has_params(model: nn.Module, path: str) -> bool:
    return next(model.get_submodule(path).parameters(), None) is not None


def build_stage(skeleton: nn.Module, roles: ModelRoles, *, family: str, blocks: tuple[str, ...] | None,
                first: bool, last: bool, seq_factor: int = 1, cp: int = 1, cp_rank: int = 0) -> nn.Module:
    """A copy of `skeleton` running `blocks` (None: the whole model, unpipelined), with the runner of `family`."""
    part = copy.deepcopy(skeleton)
    prefix = getattr(part, "base_model_prefix", "")
    info = StageInfo(family=family, first=first, last=last, base=prefix, seq_factor=seq_factor, cp=cp,
                     cp_rank=cp_rank)
    if blocks is not None or family != "module":
        _keep_blocks(part, roles, roles.block_paths if blocks is None else blocks)
    if blocks is not None:
        for unit in roles.layers:
            drop = (unit.role is LayerRole.EMBEDDING and not first) or (unit.role is LayerRole.HEAD and not last)
            for path in unit.paths if drop else ():
                if _has_params(part, path):
                    parent, child = _parent(part, path)
                    setattr(parent, child, None)
    if family == "module":
        if blocks is None:
            part.forward = types.MethodType(_own_forward, part)
            part.autoplan_stage = info
            return part
        info = StageInfo(**{**_fields(info), "chain": stage_chain(roles, blocks, first=first, last=last)})
        part.forward = types.MethodType(_chain_forward, part)
    else:
        part.forward = types.MethodType(_RUNNERS[family], part)
    part.autoplan_stage = info
    return part


def stage_chain(roles: ModelRoles, blocks: tuple[str, ...], *, first: bool, last: bool) -> tuple[str, ...]:
    """The module paths a "module"-family stage runs: the embedding layer's on the first stage, its blocks,
    the head layer's on the last; a layer between blocks goes with the block before it."""
    kept, out, holds_previous = set(blocks), [], first
    for unit in roles.layers:
        if unit.role is LayerRole.BLOCK:
            holds_previous = unit.name in kept
            take = holds_previous
        elif unit.role is LayerRole.EMBEDDING:
            take = first
        elif unit.role is LayerRole.HEAD:
            take = last
        else:
            take = holds_previous
        if take:
            out += list(unit.paths)
    return tuple(out)


def _fields(info: StageInfo) -> dict[str, Any]:
    return {name: getattr(info, name) for name in StageInfo.__slots__}


def _keep_blocks(part: nn.Module, roles: ModelRoles, blocks: tuple[str, ...]) -> None:
    """Replace the block container by a ModuleDict of `blocks`, keyed by their original names."""
    container = part.get_submodule(roles.container)
    names = {b.rpartition(".")[2] if roles.container else b for b in blocks}
    kept = nn.ModuleDict({name: child for name, child in container.named_children() if name in names})
    if roles.container:
        parent, child = _parent(part, roles.container)
        setattr(parent, child, kept)


def check_chain(model: nn.Module, roles: ModelRoles, example: torch.Tensor) -> str | None:
    """None when model(example) is the chain of chain_units (each unit called once, on the previous unit's
    output alone, the last unit's output the model's); else why not, in one line. Runs on the meta device, on a
    copy whose buffers are moved there too (a BatchNorm's running statistics are real CPU tensors)."""
    model = copy.deepcopy(model).to("meta")
    units = chain_units(roles)
    calls: dict[str, list[tuple[Any, Any]]] = {path: [] for path in units}
    handles = []
    for path in units:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any, path: str = path) -> None:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            calls[path].append((args[0] if len(tensors) == 1 and args else None, output))
        handles.append(model.get_submodule(path).register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.device("meta"):
            output = model(example)
    except Exception as exc:  # noqa: BLE001 - the reason goes into the one-line refusal
        return f"its forward does not run on the meta device ({type(exc).__name__}: {exc})"
    finally:
        for handle in handles:
            handle.remove()
    previous, previous_name = example, "the input tokens"
    for path in units:
        if len(calls[path]) != 1:
            return f"{path} runs {len(calls[path])} times in one forward, not once"
        given, produced = calls[path][0]
        if given is not previous:
            return f"{path} is not applied to the output of {previous_name} alone"
        previous, previous_name = produced, path
    try:
        final = logits_of(output)
    except ValueError as exc:
        return str(exc)
    if final is not previous:
        return f"the model's output is not the output of {units[-1]}"
    return None


__all__ = ["StageInfo", "build_stage", "chain_units", "check_chain", "logits_of", "stage_chain"]
