"""cost/projections.py against hand counts: an early-stopping full recompute (torch's non-reentrant
checkpoint) skips a dense block's MLP output GEMM, the residual add after it and, under tensor parallelism,
the MLP's reduction; separate Q / K / V linears cost three GEMMs at their own widths and two gradient adds.
Each test differs two estimates in one Engine field, so the rest of the model cancels."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from test_cost_graph_helper import a100_cluster, gpt_graph
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from autoplan.cost import estimate_layer
from autoplan.cost.compute import layer_compute
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

H, A, F_, S, D = 1024, 16, 2816, 4096, 2  # hidden, heads, SwiGLU width, tokens, bf16 bytes
IDEAL = a100_cluster(ideal=True)  # efficiency 1, no SMs: a GEMM is 2 m k n / 312e12 when compute-bound
PEAK, BW = 312e12, 2.0e12
TITAN = Engine.load("torchtitan")


def llama_block(kv: int = A) -> Layer:
    """A Llama-style block (SwiGLU: three h x f matmuls, kv key/value heads), one sequence of S tokens."""
    qkv = H + 2 * H * kv // A
    params = H * qkv + H * H + 3 * H * F_ + 2 * H
    return Layer(name="layers.0", kind="block", role=LayerRole.BLOCK, index=1,
                 fwd_matmul_flops=2.0 * S * (H * qkv + H * H + 3 * H * F_), fwd_attention_flops=4.0 * S * S * H,
                 fwd_elementwise_flops=10.0 * S * H, num_params=params, param_bytes=2 * params, activation_bytes=0,
                 causal_attention=True, input_bytes=2 * S * H, output_bytes=2 * S * H, hidden_size=H,
                 num_heads=A, num_kv_heads=kv, ffn_hidden_size=F_)


def times(engine: Engine, recompute: Recompute, layer: Layer | None = None, cluster=IDEAL):
    return layer_compute(layer or llama_block(), cluster.device, cluster.peak_flops, ParallelConfig(), recompute,
                         scale=1.0, seq_len=S, graph_tokens=float(S), dtype_bytes=D, scores_materialised=False,
                         engine=engine)


def test_early_stop_skips_the_mlp_output_gemm_and_the_last_residual_add() -> None:
    """Hand: the skipped w2 GEMM is 2 S h f FLOPs at peak; the residual add reads 2 h and writes h elements
    per token, 3 S h d bytes at 2 TB/s. Without early stop the recompute is the whole forward."""
    stop, whole = times(TITAN, Recompute.FULL), times(dataclasses.replace(TITAN, recompute_early_stop=False),
                                                      Recompute.FULL)
    assert math.isclose(whole.recompute_s, whole.fwd_s, rel_tol=1e-12)
    skipped = 2.0 * S * H * F_ / PEAK + 3.0 * S * H * D / BW
    assert math.isclose(whole.recompute_s - stop.recompute_s, skipped, rel_tol=1e-9)
    assert stop.fwd_s == whole.fwd_s and stop.bwd_s == whole.bwd_s  # only the recompute changes
    # selective and no recompute are not checkpoints that stop early
    for mode in (Recompute.NONE, Recompute.SELECTIVE):
        assert times(TITAN, mode).recompute_s == times(dataclasses.replace(TITAN, recompute_early_stop=False),
                                                       mode).recompute_s


def test_early_stop_skips_the_mlp_reduction_under_tensor_parallelism_but_nothing_in_a_moe_block() -> None:
    """tp 2 in one node, no SP: each block all-reduces S h d bytes after the attention and after the MLP;
    the early-stopped recompute runs the first only. Ring all-reduce on the ideal NVLink (300 GB/s, no
    latency): 2 (t - 1) / t x bytes / bw. A routed-expert block's recompute skips nothing."""
    config = ParallelConfig(tp=2, dp=4)
    layer = gpt_graph(h=H, a=A, layers=1, seq=S, unfused=False).blocks[0]
    cluster = a100_cluster(ideal=True)
    on, off = (estimate_layer(layer, cluster, config, Recompute.FULL, seq_len=S,
                              engine=dataclasses.replace(TITAN, recompute_early_stop=flag)) for flag in (True, False))
    all_reduce = 2 * (2 - 1) / 2 * S * H * D / 300e9
    assert math.isclose(off.tp_comm_s - on.tp_comm_s, all_reduce, rel_tol=1e-9)
    moe = gpt_graph(h=H, a=A, layers=1, seq=S, unfused=False, experts=8, top_k=2).blocks[0]
    on, off = (estimate_layer(moe, cluster, ParallelConfig(dp=8), Recompute.FULL, seq_len=S,
                              engine=dataclasses.replace(TITAN, recompute_early_stop=flag)) for flag in (True, False))
    assert on.recompute_s == off.recompute_s


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.mm += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def test_torch_non_reentrant_checkpoint_does_not_rerun_the_last_linear() -> None:
    """The fact the engines cite, run here: a pre-norm-style block of five bias-free linears (two in the
    attention stand-in, w1 / w3 / w2 in the MLP) under torch.utils.checkpoint(use_reentrant=False) runs 4 of
    its 5 forward mms again in backward (plus 2 per linear for the gradients); without early stop all 5."""
    lin = [torch.nn.Linear(16, 16, bias=False) for _ in range(5)]

    def block(x):
        h = x + lin[1](F.silu(lin[0](x)))
        return h + lin[4](F.silu(lin[2](h)) * lin[3](h))

    x = torch.randn(2, 4, 16, requires_grad=True)
    for early, recomputed in ((True, 4), (False, 5)):
        with torch.utils.checkpoint.set_checkpoint_early_stop(early):
            out = checkpoint(block, x, use_reentrant=False)
        count = _Count()
        with count:
            out.sum().backward()
        assert count.mm == recomputed + 2 * 5


def test_separate_qkv_is_the_same_flops_plus_two_gradient_adds_on_an_ideal_device() -> None:
    """Without SMs (no tile quantization) three GEMMs of the same total FLOPs take the fused GEMM's time;
    the backward adds the two sums of the three input gradients: 2 x 3 S h d bytes."""
    fused = times(dataclasses.replace(TITAN, separate_qkv_projections=False), Recompute.NONE, llama_block(kv=4))
    apart = times(TITAN, Recompute.NONE, llama_block(kv=4))
    assert math.isclose(apart.gemm_fwd_s, fused.gemm_fwd_s, rel_tol=1e-9)
    assert math.isclose(apart.bwd_s - fused.bwd_s, 2 * 3 * S * H * D / BW, rel_tol=1e-9)


def test_narrow_kv_projections_fill_fewer_tiles_per_wave() -> None:
    """108 SMs, efficiency 1, epilogue hidden, T = 8192 tokens, h = 4096, 32 heads, 8 kv heads (Llama 3 8B's
    attention). Hand (NVIDIA Matrix Multiplication Background guide tiles, rate of a tile relative to 256x128
    by Mt Nt / (Mt + Nt)): fused QKV n = 6144: 32 x 48 = 1536 256x128 tiles in 15 waves of 108: 0.948; Q
    n = 4096: 32 x 32 = 1024 tiles in 10 waves: 0.948; K, V n = 1024: 32 x 8 = 256 tiles in 3 waves: 0.790
    (128x128: 512 tiles in 5 waves x 0.75 = 0.711; 64x64: 0.374). Forward time difference = 2 T h (4096 /
    0.948 + 2 x 1024 / 0.790 - 6144 / 0.948) / 312e12."""
    h, a, g, f, t = 4096, 32, 8, 14336, 8192
    device = dataclasses.replace(IDEAL.device, num_sms=108, gemm_epilogue_overlap=True)
    cluster = dataclasses.replace(IDEAL, device=device)
    qkv = h + 2 * h * g // a
    layer = dataclasses.replace(llama_block(), fwd_matmul_flops=2.0 * t * (h * qkv + h * h + 3 * h * f),
                                hidden_size=h, num_heads=a, num_kv_heads=g, ffn_hidden_size=f)

    def fwd(engine: Engine) -> float:
        return layer_compute(layer, device, cluster.peak_flops, ParallelConfig(), Recompute.NONE, scale=1.0,
                             seq_len=t, graph_tokens=float(t), dtype_bytes=D, scores_materialised=False,
                             engine=engine).gemm_fwd_s

    u_wide, u_kv = 1536 / 1620, 256 / 324
    assert math.isclose(1024 / 1080, u_wide)  # Q's tiles fill their waves as well as the fused GEMM's
    expected = 2.0 * t * h * (4096 / u_wide + 2 * 1024 / u_kv - 6144 / u_wide) / PEAK
    got = fwd(TITAN) - fwd(dataclasses.replace(TITAN, separate_qkv_projections=False))
    assert math.isclose(got, expected, rel_tol=1e-9)


def test_shipped_engines_say_how_their_code_projects_and_recomputes() -> None:
    """Megatron's fused query_key_value / linear_qkv and reentrant CheckpointFunction; torchtitan's and
    autoplan's three linears under torch's non-reentrant checkpoint; Hugging Face's three linears under its
    reentrant default."""
    facts = {name: (Engine.load(name).separate_qkv_projections, Engine.load(name).recompute_early_stop)
             for name in Engine.names()}
    assert facts["torchtitan"] == facts["autoplan"] == (True, True)
    assert facts["deepspeed-2024"] == (True, False)
    for name in ("megatron-lm", "megatron-core", "megatron-deepspeed", "deepspeed"):
        assert facts[name] == (False, False)
