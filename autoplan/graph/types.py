"""The layer graph: what the cost model knows about a model, per layer, after capture.

Quantities are for one microbatch of `LayerGraph.microbatch` sequences of `LayerGraph.seq_len` tokens,
with no parallelism; the cost model scales them (FLOPs, activations and bytes are linear in the
microbatch). Pure data: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

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
    # elements of the head's output projection that are the token embedding's own weight (V x h when the
    # head is tied to the embedding, 0 when untied): with a pipeline the first and the last stage each hold
    # it and all-reduce its gradient once per step (cost.estimate.tied_grad_reduce_s)
    tied_embedding_params: int = 0
    num_nodes: int = 0  # graph nodes captured (for reporting)
    capture_method: str = ""  # "export", "symbolic_trace", ...
    # the shape of one sample of the model's first input as captured (batch dimension dropped): (seq_len,)
    # for token ids, (channels, height, width) for an image model; () when not known
    input_shape: tuple[int, ...] = ()
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Component:
    """One component of a model (a vision tower, a projector, a language model): the module paths it
    covers and its own layer graph, captured with the rest of the model in one trace."""

    name: str  # its first module path, e.g. "model.vision_tower"
    module_paths: tuple[str, ...]
    graph: LayerGraph  # seq_len is the component's own sequence (image patches for a vision tower)
    connector: bool = False  # no repeated blocks of its own: a module between components (a projector)

    @property
    def fwd_flops(self) -> float:
        return self.graph.fwd_flops

    @property
    def has_blocks(self) -> bool:
        """Holds repeated blocks (a tower or a language model), not only a connector like a projector."""
        return not self.connector


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentEdge:
    """Activations flowing from one component to another: bytes per microbatch of
    ComponentGraph.microbatch samples in the forward (the backward returns as many gradient bytes)."""

    src: str
    dst: str
    activation_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentGraph:
    """A model as a DAG of components (vision tower -> projector -> language model; or a sensor branch and
    a vision branch both feeding a policy), each with its own LayerGraph, plus the edges between them.
    A single-chain model is one component and no edges. `components` are in the model's forward order,
    which is a topological order of the DAG."""

    model_name: str
    components: tuple[Component, ...]
    edges: tuple[ComponentEdge, ...] = ()
    microbatch: int = 1
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique, got {names}")
        for edge in self.edges:
            if edge.src not in names or edge.dst not in names:
                raise ValueError(f"edge {edge.src} -> {edge.dst} names a component not in {names}")
            if names.index(edge.src) >= names.index(edge.dst):
                raise ValueError(f"edge {edge.src} -> {edge.dst} runs against the forward order {names}")

    @property
    def is_single(self) -> bool:
        return len(self.components) == 1

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}: have {[c.name for c in self.components]}")

    def dag(self) -> Any:
        """The DAG as a networkx.DiGraph: nodes are component names (attribute `component`), edges carry
        `activation_bytes`."""
        import networkx as nx

        g = nx.DiGraph()
        for c in self.components:
            g.add_node(c.name, component=c)
        for e in self.edges:
            g.add_edge(e.src, e.dst, activation_bytes=e.activation_bytes)
        return g

    def edge_bytes(self, src: str, dst: str) -> int:
        return sum(e.activation_bytes for e in self.edges if e.src == src and e.dst == dst)

    def merged(self, names: tuple[str, ...] | list[str]) -> LayerGraph:
        """One LayerGraph of several components run on the same devices: the first name's layers, with the
        others' before them (as EMBEDDING layers, on the first pipeline stage) when they come earlier in
        the forward order, after them (as HEAD layers, on the last stage) otherwise; the first one's
        sequence length."""
        order = [c.name for c in self.components]
        main = self.component(names[0]).graph
        before: list[Layer] = []
        after: list[Layer] = []
        for name in sorted(names[1:], key=order.index):
            role, side = ((LayerRole.EMBEDDING, before) if order.index(name) < order.index(names[0])
                          else (LayerRole.HEAD, after))
            side += [replace(layer, role=role) for layer in self.component(name).graph.layers]
        layers = tuple(replace(layer, index=i) for i, layer in enumerate([*before, *main.layers, *after]))
        return replace(main, layers=layers, model_name=f"{self.model_name}/{'+'.join(names)}",
                       num_nodes=sum(self.component(n).graph.num_nodes for n in names))

    def encoder_split(self) -> EncoderSplit | None:
        """The model as encoder -> language model, for serving (encode -> prefill -> decode): every
        component before the last one (the language model, the DAG's sink) is the encoder side. None for
        a single chain or a model whose last component takes no activations from the others."""
        if self.is_single:
            return None
        last = self.components[-1]
        into = sum(e.activation_bytes for e in self.edges if e.dst == last.name)
        if not into:
            return None
        encoders = tuple(c.name for c in self.components[:-1])
        heavy = [n for n in encoders if self.component(n).has_blocks] or list(encoders)
        hidden = next((b.hidden_size for b in last.graph.blocks if b.hidden_size), 0)
        per_sample = into // self.microbatch
        tokens = per_sample // (hidden * last.graph.dtype_bytes) if hidden else 0
        return EncoderSplit(encoder=self.merged([heavy[0], *[n for n in encoders if n != heavy[0]]]),
                            decoder=last.graph, encoder_components=encoders, decoder_component=last.name,
                            handoff_bytes_per_sample=per_sample, encoder_tokens_per_sample=tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderSplit:
    """A model with components seen as one encoder stage feeding a language model (serving's encode ->
    prefill -> decode). `encoder` is all encoder-side components as one LayerGraph (captured at
    ComponentGraph.microbatch samples, sequence = the encoder's own, e.g. image patches); `decoder` the
    language model's graph (sequence = text + image tokens). Per sample the encoder hands
    handoff_bytes_per_sample bytes (capture dtype) to the decoder, filling encoder_tokens_per_sample of
    its positions (0 when the decoder's hidden size is not recognised)."""

    encoder: LayerGraph
    decoder: LayerGraph
    encoder_components: tuple[str, ...]
    decoder_component: str
    handoff_bytes_per_sample: int
    encoder_tokens_per_sample: int
