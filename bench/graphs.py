"""Layer graphs of the published models, built from their published shapes and the standard formulas
(no capture, so the accuracy bench runs in seconds): Megatron's GPT and the Llama family.

The graphs describe the model, not the engine: attention is plain causal attention; whether its scores
are materialised is the engine's (Engine.attention).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's autoplan

from autoplan.graph.types import Layer, LayerGraph, LayerRole

# Host ops per forward when the engine has no count of its own: the nodes autoplan's capture finds in its
# GPT and Llama blocks (autoplan.graph.capture of the gpt3-1.7b and llama3-8b presets: 20 and 69).
GPT_BLOCK_NODES, LLAMA_BLOCK_NODES, EMBED_NODES, HEAD_NODES = 20, 69, 8, 16


def gpt_graph(*, h: int, a: int, layers: int, seq: int, vocab: int, b: int = 1, ffn: int | None = None,
              tied: bool = True) -> LayerGraph:
    """Megatron GPT for microbatch b (Narayanan et al. 2021, appendix: 24 b s h^2 matmul + 4 b s^2 h
    attention FLOPs per block; 12 h^2 + 13 h parameters; Korthikanti et al. 2022: 34 s b h activation
    bytes without the scores). Embedding: (V + s) h parameters (word + learned positions). Head: the
    V x h projection (tied to the embedding, tied_embedding_params = V h: Megatron-LM's GPTModel shares
    word_embeddings_weight, Megatron-DeepSpeed's GPTModelPipe by TiedLayerSpec('embed'); the last pipeline
    stage keeps its own copy; tied False: --untie-embeddings-and-output-weights, a head of its own) and Megatron's
    vocab-parallel cross entropy in fp32: logits stored 2 + 4 bytes each, about 24 bytes of traffic per
    logit (fp16 write, max, subtract, exp, sum, divide passes)."""
    s, f = seq, ffn or 4 * h
    tok = b * s
    params = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    block = {
        "kind": "block", "role": LayerRole.BLOCK, "fwd_matmul_flops": 2.0 * tok * (4 * h * h + 2 * h * f),
        "fwd_attention_flops": 4.0 * b * s * s * h, "fwd_elementwise_flops": 10.0 * tok * h,
        "num_params": params, "param_bytes": 2 * params, "activation_bytes": 34 * tok * h,
        "attention_activation_bytes": 0, "causal_attention": True, "input_bytes": 2 * tok * h,
        "output_bytes": 2 * tok * h, "hidden_size": h, "num_heads": a, "num_kv_heads": a, "ffn_hidden_size": f,
        "num_nodes": GPT_BLOCK_NODES,
    }
    return _graph(f"gpt-h{h}-l{layers}", block, h=h, layers=layers, s=s, b=b, vocab=vocab,
                  embed_params=(vocab + s) * h, tied=vocab * h if tied else 0)


def llama_graph(*, h: int, a: int, kv: int, ffn: int, layers: int, seq: int, vocab: int, b: int = 1) -> LayerGraph:
    """A Llama block (Touvron et al. 2023; Dubey et al. 2024): RMSNorm, grouped-query attention with kv
    heads (QKV width h + 2 h kv / a), SwiGLU MLP of width ffn (three h x ffn matmuls), no biases, no
    dropout; untied embedding and head."""
    s, tok = seq, b * seq
    qkv = h + 2 * h * kv // a
    params = h * qkv + h * h + 3 * h * ffn + 2 * h
    block = {
        "kind": "block", "role": LayerRole.BLOCK,
        "fwd_matmul_flops": 2.0 * tok * (h * qkv + h * h + 3 * h * ffn),
        "fwd_attention_flops": 4.0 * b * s * s * h, "fwd_elementwise_flops": 10.0 * tok * h,
        "num_params": params, "param_bytes": 2 * params, "activation_bytes": (8 * h + 4 * h * kv // a + 6 * ffn) * tok,
        "attention_activation_bytes": 0, "causal_attention": True, "input_bytes": 2 * tok * h,
        "output_bytes": 2 * tok * h, "hidden_size": h, "num_heads": a, "num_kv_heads": kv, "ffn_hidden_size": ffn,
        "num_nodes": LLAMA_BLOCK_NODES,
    }
    return _graph(f"llama-h{h}-l{layers}", block, h=h, layers=layers, s=s, b=b, vocab=vocab, embed_params=vocab * h)


def _graph(name: str, block: dict, *, h: int, layers: int, s: int, b: int, vocab: int, embed_params: int,
           tied: int = 0) -> LayerGraph:
    tok = b * s
    out = [Layer(name="embed", kind="embed", role=LayerRole.EMBEDDING, index=0, fwd_matmul_flops=0.0,
                 fwd_attention_flops=0.0, fwd_elementwise_flops=float(tok * h), num_params=embed_params,
                 param_bytes=2 * embed_params, activation_bytes=tok * h, output_bytes=2 * tok * h,
                 bytes_moved=8 * tok * h, num_nodes=EMBED_NODES)]
    out += [Layer(name=f"layers.{i}", index=i + 1, **block) for i in range(layers)]
    out.append(Layer(name="head", kind="head", role=LayerRole.HEAD, index=layers + 1,
                     fwd_matmul_flops=2.0 * tok * h * vocab, fwd_attention_flops=0.0,
                     fwd_elementwise_flops=5.0 * tok * vocab, num_params=vocab * h + 2 * h,
                     param_bytes=2 * (vocab * h + 2 * h), activation_bytes=4 * tok * h + 6 * tok * vocab,
                     input_bytes=2 * tok * h, output_bytes=4 * b, bytes_moved=24 * tok * vocab,
                     num_nodes=HEAD_NODES))
    return LayerGraph(model_name=name, layers=tuple(out), seq_len=s, microbatch=b, vocab_size=vocab,
                      tied_embedding_params=tied)
