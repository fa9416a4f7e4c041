"""Hand-built serving models (parameter counts from the released configs, computed here, no capture)
and a zero-overhead engine, for the serving tests."""

from __future__ import annotations

from autoplan.serve.types import BlockGroup, ServeEngine, ServeModel


def llama(name: str, *, layers: int, h: int, a: int, g: int, f: int, vocab: int, wbytes: float = 2.0,
          experts: int = 0, top_k: int = 0) -> ServeModel:
    """A Llama-family decoder: q and o h x h, k and v h x (g d), SwiGLU 3 h f (per expert for a MoE,
    plus an h x E router), two RMSNorm vectors per block; untied embedding and head (+ final norm)."""
    d = h // a
    attn = 2 * h * h + 2 * h * g * d
    mlp = 3 * h * f
    dense = attn + 2 * h + (h * experts if experts else mlp)
    block = BlockGroup(count=layers, h=h, a=a, g=g, d=d, f=f, n_mlp=3, dense_params=dense,
                       expert_params=experts * mlp, num_experts=experts, top_k=top_k)
    return ServeModel(name=name, blocks=(block,), vocab_size=vocab, embed_params=vocab * h,
                      head_params=vocab * h + h, weight_bytes=wbytes, kv_bytes=wbytes if wbytes >= 2 else 2.0)


# Llama 3 70B (Llama Team 2024, Table 3; released config): 80 layers, h 8192, 64 heads, 8 kv, FFN 28672
LLAMA3_70B = llama("llama3-70b", layers=80, h=8192, a=64, g=8, f=28672, vocab=128256)
LLAMA3_8B = llama("llama3-8b", layers=32, h=4096, a=32, g=8, f=14336, vocab=128256)


def bare_engine(**fields) -> ServeEngine:
    """An engine with no overheads, the whole device memory, 1-token blocks: physics only."""
    base = {"name": "bare", "memory_fraction": 1.0, "memory_fraction_of": "total", "kv_block_tokens": 1,
                "max_num_seqs": 1024, "max_num_batched_tokens": 8192, "cuda_graph_max_batch": 1024}
    base.update(fields)
    return ServeEngine(**base)
