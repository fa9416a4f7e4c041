"""The captured layer graph as the serving cost model needs it: block groups with their shapes and
parameter counts, the embedding and the LM head (a ServeModel). Pure: reads graph.types only.
"""

from __future__ import annotations

from autoplan.cost.compute import block_shape
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.serve.types import BlockGroup, ServeModel

# bytes per element of the serving dtypes (weights, KV cache)
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def dtype_bytes(name: str, what: str) -> float:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown {what} dtype {name!r}: choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def serve_model(graph: LayerGraph, *, weight_dtype: str = "bf16", kv_dtype: str | None = None,
                act_dtype: str | None = None) -> ServeModel:
    """The ServeModel of a captured decoder. Block shapes come from the captured FLOPs and parameters
    (cost.compute.block_shape), grouped where consecutive blocks share a kind. head_dim = h / a (as in
    every preset and HF Llama/Mixtral/Qwen config). Raises ValueError for a graph with no recognised
    transformer block."""
    tokens = float(graph.seq_len * graph.microbatch)
    groups: list[BlockGroup] = []
    kinds: list[str] = []
    for layer in graph.blocks:
        shape = block_shape(layer, tokens)
        if shape is None:
            raise ValueError(f"layer {layer.name!r} of {graph.model_name} is not a recognised transformer block: "
                             f"serving plans need a decoder-only transformer")
        group = BlockGroup(count=1, h=shape.h, a=shape.a, g=shape.g, d=shape.h // shape.a, f=shape.f,
                           n_mlp=shape.n_mlp, dense_params=layer.num_params - layer.expert_params,
                           expert_params=layer.expert_params, num_experts=shape.num_experts,
                           top_k=shape.top_k, ops_per_block=layer.num_nodes)
        if kinds and kinds[-1] == layer.kind:
            last = groups[-1]
            groups[-1] = BlockGroup(**{**_fields(last), "count": last.count + 1})
        else:
            groups.append(group)
            kinds.append(layer.kind)
    if not groups:
        raise ValueError(f"{graph.model_name} has no transformer blocks: serving plans need a decoder-only transformer")
    embed = sum(layer.num_params for layer in graph.layers if layer.role is LayerRole.EMBEDDING)
    head = sum(layer.num_params for layer in graph.layers if layer.role is LayerRole.HEAD)
    w = dtype_bytes(weight_dtype, "weight")
    # activations stay 16-bit under fp8 / int weights; vLLM / SGLang cache_dtype "auto" keeps K/V in
    # the activation dtype
    act = act_dtype or ("bf16" if w < 2 else weight_dtype)
    kv = dtype_bytes(kv_dtype or act, "kv-cache")
    # the embedding and LM head stay in the activation dtype under 8-bit weights: vLLM docs
    # (features/quantization/fp8: dynamic FP8 quantizes "all Linear modules (except for the final
    # lm_head)"); NVIDIA ModelOpt FP8 checkpoints likewise exclude lm_head
    ends = dtype_bytes(act, "activation") if w < 2 else w
    return ServeModel(name=graph.model_name, blocks=tuple(groups), vocab_size=graph.vocab_size or 1,
                      embed_params=embed, head_params=head, weight_bytes=w, kv_bytes=kv,
                      act_bytes=dtype_bytes(act, "activation"), ends_bytes=ends)


def _fields(group: BlockGroup) -> dict:
    return {name: getattr(group, name) for name in BlockGroup.__dataclass_fields__}
