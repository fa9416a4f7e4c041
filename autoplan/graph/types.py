"""The layer graph: what the cost model knows about a model, per layer, after capture.

Quantities are for one microbatch of `LayerGraph.microbatch` sequences of `LayerGraph.seq_len` tokens,
with no parallelism; the cost model scales them (FLOPs, activations and bytes are linear in the
microbatch). Pure data: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from autoplan.plan.layout import divisibility_errors
from autoplan.plan.types import ParallelConfig


class LayerRole(str, Enum):
    EMBEDDING = "embedding"  # token (and position) embedding: first pipeline stage
    BLOCK = "block"  # a repeated block (transformer layer, MLP block, ...)
    HEAD = "head"  # final norm + output projection (+ loss): last pipeline stage
    OTHER = "other"  # anything else at top level (kept in order)


@dataclass(frozen=True, slots=True, kw_only=True)
class Layer:
    """One layer: a group of graph nodes under one module path (e.g. "layers.3").

    FLOPs are forward only (backward is about twice the forward's matmul FLOPs). `kind` is the same
    string for structurally identical layers, so the search solves each kind once."""

    name: str  # module path, as in model.named_modules(): "embed", "layers.0", "head"
    kind: str  # identical layers share it, e.g. "block/dense/3f1c2a"
    role: LayerRole
    index: int  # position in the model's forward order
    fwd_matmul_flops: float  # linear layers / projections (2 * m * n * k per matmul)
    fwd_attention_flops: float  # the attention core: Q K^T and scores x V
    fwd_elementwise_flops: float  # norms, activations, softmax, residual adds, ...
    num_params: int
    param_bytes: int
    activation_bytes: int  # saved for backward with no recompute (autograd's saved tensors)
    attention_activation_bytes: int = 0  # part of activation_bytes that selective recompute drops
    # the attention core is causal (is_causal=True, or a recognised lower-triangular mask): a fused kernel
    # skips the masked half (Dao 2023). Only fused attention ops are inspected: False for unfused ones.
    causal_attention: bool = False
    input_bytes: int = 0  # the layer's input (what full recompute keeps; what a stage receives)
    output_bytes: int = 0  # the layer's output (what a pipeline stage sends on)
    bytes_moved: int = 0  # memory traffic of the forward: every op's inputs read + outputs written
    # transformer shape, when the layer is a recognised transformer block (0 otherwise); lets the cost
    # model use the published formulas (Korthikanti et al. 2022) and split heads over tp
    hidden_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    ffn_hidden_size: int = 0
    # mixture of experts, when present
    num_experts: int = 0  # routed experts (0 = dense)
    top_k: int = 0
    num_shared_experts: int = 0
    expert_params: int = 0  # parameters in routed experts (sharded over ep)
    fwd_expert_flops: float = 0.0  # part of fwd_matmul_flops spent in routed experts
    # every module path the layer covers (the head layer holds the final norm too); graph nodes in it
    module_paths: tuple[str, ...] = ()
    num_nodes: int = 0

    @property
    def fwd_flops(self) -> float:
        return self.fwd_matmul_flops + self.fwd_attention_flops + self.fwd_elementwise_flops

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerGraph:
    """A model as an ordered tuple of layers, with the shapes it was captured at."""

    model_name: str
    layers: tuple[Layer, ...]
    seq_len: int
    microbatch: int
    dtype_bytes: int = 2  # bytes per element of parameters and activations as captured/trained
    vocab_size: int = 0
    num_nodes: int = 0  # graph nodes captured (for reporting)
    capture_method: str = ""  # "export", "symbolic_trace", ...
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def num_params(self) -> int:
        return sum(layer.num_params for layer in self.layers)

    @property
    def fwd_flops(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def blocks(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.role is LayerRole.BLOCK)

    def divisibility_sizes(self) -> tuple[dict[str, int], ...]:
        """The sizes a parallel config must divide, as keywords of plan.layout.divisibility_errors: one dict
        per distinct block shape (heads, kv heads, FFN width), each with the model's vocabulary, routed
        experts, seq_len and block count."""
        blocks = self.blocks or self.layers
        experts = max((b.num_experts for b in blocks), default=0)
        shapes = dict.fromkeys((b.num_heads, b.num_kv_heads, b.ffn_hidden_size) for b in blocks)
        return tuple({"num_heads": heads, "num_kv_heads": kv_heads, "ffn_hidden_size": ffn, "num_experts": experts,
                      "vocab_size": self.vocab_size, "seq_len": self.seq_len, "num_blocks": len(self.blocks)}
                     for heads, kv_heads, ffn in shapes)

    def divisibility_errors(self, config: ParallelConfig, *, global_batch: int | None = None,
                            sizes: tuple[dict[str, int], ...] | None = None) -> tuple[str, ...]:
        """Every way `config` fails to divide this model, one line each (empty when it runs): the rules of
        plan.layout.divisibility_errors (their one home) over divisibility_sizes() (or `sizes`, computed
        once by a caller that checks many configs)."""
        out: dict[str, None] = {}
        for kwargs in sizes if sizes is not None else self.divisibility_sizes():
            out.update(dict.fromkeys(divisibility_errors(config, **kwargs, global_batch=global_batch)))
        return tuple(out)

    def kinds(self) -> dict[str, tuple[Layer, ...]]:
        """Layers grouped by kind, in first-appearance order."""
        out: dict[str, list[Layer]] = {}
        for layer in self.layers:
            out.setdefault(layer.kind, []).append(layer)
        return {k: tuple(v) for k, v in out.items()}
