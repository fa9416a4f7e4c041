"""Test helpers for the cost tests: GPT layer graphs and A100-like clusters built from the analytic
formulas (Narayanan et al. 2021 FLOPs, Korthikanti et al. 2022 activations), independent of capture.
The tests here check the helper itself against the published closed forms."""

from __future__ import annotations

import math

from autoplan.cluster.types import ClusterSpec, DeviceSpec, LinkSpec
from autoplan.graph.types import Layer, LayerGraph, LayerRole


def gpt_graph(*, h: int, a: int, layers: int, seq: int, vocab: int = 51200, b: int = 1,
              unfused: bool = True, kv: int | None = None, experts: int = 0, top_k: int = 0) -> LayerGraph:
    """A GPT with a 4h GELU MLP, microbatch b: embed, `layers` blocks, head (untied weights). Its attention
    is causal; `unfused` materialises the scores (Megatron-LM 2021), else a fused (FlashAttention) kernel.
    The default vocabulary is GPT-2's 50257 padded as Megatron-LM pads it for tp up to 8 (to a multiple of
    128 tp: megatron/training/tokenizer _vocab_size_with_padding), so that tp divides it."""
    s, f, kv = seq, 4 * h, kv or a
    tok = b * s
    qkv = h + 2 * h * kv // a
    expert_params = experts * 2 * h * f
    expert_flops = 2.0 * tok * top_k * 2 * h * f if experts else 0.0
    mm = 2.0 * tok * (h * qkv + h * h) + (expert_flops if experts else 2.0 * tok * 2 * h * f)
    params = h * qkv + qkv + h * h + h + (expert_params + experts * (f + h) if experts else 2 * h * f + f + h) + 4 * h
    scores = 5 * a * s * s * b if unfused else 0
    block = {
        "role": LayerRole.BLOCK, "fwd_matmul_flops": mm, "fwd_attention_flops": 4.0 * b * s * s * h,
        "fwd_elementwise_flops": 10.0 * tok * h, "num_params": params, "param_bytes": 2 * params,
        "activation_bytes": 34 * s * b * h + scores, "attention_activation_bytes": scores,
        "causal_attention": True, "input_bytes": 2 * tok * h, "output_bytes": 2 * tok * h, "hidden_size": h,
        "num_heads": a, "num_kv_heads": kv, "ffn_hidden_size": f, "num_experts": experts, "top_k": top_k,
        "expert_params": expert_params, "fwd_expert_flops": expert_flops,
    }
    out = [Layer(name="embed", kind="embed", role=LayerRole.EMBEDDING, index=0, fwd_matmul_flops=0.0,
                 fwd_attention_flops=0.0, fwd_elementwise_flops=float(tok * h), num_params=(vocab + s) * h,
                 param_bytes=2 * (vocab + s) * h, activation_bytes=tok * h, output_bytes=2 * tok * h,
                 bytes_moved=8 * tok * h)]
    kind = "block/moe" if experts else "block/dense"
    out += [Layer(name=f"layers.{i}", kind=kind, index=i + 1, **block) for i in range(layers)]
    out.append(Layer(name="head", kind="head", role=LayerRole.HEAD, index=layers + 1,
                     fwd_matmul_flops=2.0 * tok * h * vocab, fwd_attention_flops=0.0,
                     fwd_elementwise_flops=5.0 * tok * vocab, num_params=vocab * h + 2 * h,
                     param_bytes=2 * (vocab * h + 2 * h), activation_bytes=4 * tok * h + 6 * tok * vocab,
                     input_bytes=2 * tok * h, output_bytes=4 * b, bytes_moved=24 * tok * vocab))
    return LayerGraph(model_name=f"gpt-h{h}-l{layers}", layers=tuple(out), seq_len=s, microbatch=b,
                      vocab_size=vocab)


def a100_cluster(num_nodes: int = 1, *, per_node: int = 8, nic_bw: float = 25e9, ideal: bool = False) -> ClusterSpec:
    """DGX A100-like: 312 TFLOP/s bf16, 80 GB at 2.0 TB/s, NVLink 300 GB/s per direction, one 200 Gb/s
    NIC per GPU. `ideal` sets every efficiency to 1 and latencies to 0 (for hand computations)."""
    eff = 1.0 if ideal else 0.8
    device = DeviceSpec(name="a100", peak_flops=(("bf16", 312e12), ("fp16", 312e12)), mem_bytes=80 * 2**30,
                        mem_bw_bytes_per_s=2.0e12, matmul_efficiency=eff,
                        matmul_half_size_flops=0.0 if ideal else 2e9, attention_efficiency=1.0 if ideal else 0.6,
                        mem_bw_efficiency=eff, runtime_reserve_bytes=0 if ideal else 3 * 2**30)
    nvlink = LinkSpec(name="nvlink", bw_bytes_per_s=300e9, latency_s=0.0 if ideal else 5e-6,
                      allreduce_busbw_fraction=eff, alltoall_bw_fraction=eff, p2p_bw_fraction=eff)
    ib = LinkSpec(name="ib", bw_bytes_per_s=nic_bw, latency_s=0.0 if ideal else 10e-6,
                  allreduce_busbw_fraction=eff, alltoall_bw_fraction=eff, p2p_bw_fraction=eff)
    return ClusterSpec(name="a100-test", device=device, devices_per_node=per_node, num_nodes=num_nodes,
                       intra_node=nvlink, inter_node=ib)


def quick_and_exact(graph: LayerGraph, cluster: ClusterSpec, space, rows: list[int], global_batch: int,
                    engine):
    """Step times of `rows` of a search space under `engine`: the quick estimate's (search.surrogate) and the
    exact model's (cost.estimate_config through cost.with_engine), for tests that the two move together."""
    import numpy as np

    from autoplan import cost
    from autoplan.search.surrogate import quick_estimate

    eng = cost.with_engine(engine)
    quick = quick_estimate(graph, cluster, space, global_batch, eng).step_time_s[rows]
    exact = np.array([eng.estimate_config(graph, cluster, space.config(i), global_batch=global_batch).step_time_s
                      for i in rows])
    return quick, exact


def quick_and_exact_change(graph: LayerGraph, cluster: ClusterSpec, on, off, keep, *, global_batch: int = 16,
                           count: int = 4):
    """(quick estimate's, exact model's) step-time change from engine `off` to engine `on` (quick_and_exact)
    on the first `count` candidates of the search space for `global_batch` whose ParallelConfig `keep`
    accepts; there must be one. For tests that the quick estimate moves as the exact model does."""
    from autoplan.search.space import SearchOptions, enumerate_space

    space = enumerate_space(graph, cluster, SearchOptions(global_batch=global_batch))
    rows = [i for i in range(len(space)) if keep(space.config(i))][:count]
    assert rows, "no candidate of the space passes keep"
    (q_on, e_on), (q_off, e_off) = (quick_and_exact(graph, cluster, space, rows, global_batch, e) for e in (on, off))
    return q_on - q_off, e_on - e_off


def unfused_attention_by_hand(seq: int, *, h: int = 1024, a: int = 16, b: int = 2, peak: float = 312e12,
                              bw: float = 2.0e12) -> tuple[float, float, float]:
    """Hand terms for Megatron's unfused attention core against FlashAttention on the ideal A100 of
    a100_cluster(ideal=True) (HBM 2 TB/s, 312 TFLOP/s, no SMs): (scores, one batched score GEMM at
    max(FLOPs / peak, bytes / bw) -- Q K^T writing the s x s scores, or P V reading them --, FlashAttention's
    forward at its amortised rate: half the causal square, kv / (kv + 1) over its 128-key blocks, the
    non-matmul share 16 x 9 / 14 at head dim d against 128)."""
    d = h // a
    scores = b * a * seq * seq
    gemm = max(2.0 * scores * d / peak, (2 * seq * d * 2 + seq * seq * 2) * b * a / bw)
    share = 16 * 9 / 14
    kv = seq / 128 / 2
    flash_fwd = 4.0 * b * seq * seq * h * 0.5 / (peak * kv / (kv + 1) * (1 + share / 128) / (1 + share / d))
    return scores, gemm, flash_fwd


def write_profile_variant(tmp_path, edit):
    """The shipped dgx-a100-80gb profile's YAML, changed in place by edit(data), written to
    tmp_path / variant.yaml: a user's own profile file for the loader's checks. Returns its path."""
    import yaml

    from autoplan.cluster.load import shipped_dirs

    data = yaml.safe_load((shipped_dirs("profiles")[0] / "dgx-a100-80gb.yaml").read_text())
    edit(data)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def narayanan_flops(*, B: int, s: int, l: int, h: int, V: int) -> float:
    """Model FLOPs per step (Narayanan et al. 2021, appendix): 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    return 72.0 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def test_helper_graph_matches_narayanan_flops() -> None:
    g = gpt_graph(h=1024, a=16, layers=4, seq=512, vocab=1000, b=2)
    three_fwd = 3 * sum(x.fwd_matmul_flops + x.fwd_attention_flops for x in g.layers) / 2  # per sequence
    assert math.isclose(three_fwd, narayanan_flops(B=1, s=512, l=4, h=1024, V=1000), rel_tol=1e-12)


def test_helper_block_params_are_12h2_plus_13h() -> None:
    g = gpt_graph(h=256, a=4, layers=1, seq=64)
    assert g.blocks[0].num_params == 12 * 256**2 + 13 * 256


def every_zero_stage(engine):
    """`engine` with every ZeRO stage and every pipeline schedule allowed, with a pipeline or without
    (Engine.zero_stages, zero_stages_with_pp, zero0_1d_only and schedules, which estimate_config enforces): for the mechanism
    tests that sweep the whole search space, ZeRO 0-3 and every schedule, under an engine variant whatever the
    engine itself runs (each field's cost term is read at every stage and schedule)."""
    import dataclasses

    from autoplan.plan.engine import ZERO_STAGES
    from autoplan.plan.types import Schedule

    return dataclasses.replace(engine, zero_stages=ZERO_STAGES, zero_stages_with_pp=None, zero0_1d_only=False,
                               schedules=tuple(s.value for s in Schedule))
