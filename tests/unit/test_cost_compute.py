"""Compute-time formulas of autoplan.cost against hand computations (ideal device: every efficiency 1)."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cost import estimate_config, estimate_layer, matmul_efficiency
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

COST_DIR = Path(__file__).resolve().parents[2] / "autoplan" / "cost"


def _plain(mm: float, attn: float, **kw) -> Layer:
    """An unrecognised layer with only matmul and attention FLOPs (no elementwise traffic)."""
    return Layer(name="x", kind="x", role=LayerRole.BLOCK, index=0, fwd_matmul_flops=mm, fwd_attention_flops=attn,
                 fwd_elementwise_flops=0.0, num_params=0, param_bytes=0, activation_bytes=1000, **kw)


def test_cost_package_imports_no_torch() -> None:
    for path in COST_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path.name


def test_matmul_efficiency_is_half_at_half_size() -> None:
    device = a100_cluster().device
    assert math.isclose(matmul_efficiency(device, device.matmul_half_size_flops), device.matmul_efficiency / 2)
    assert matmul_efficiency(device, 1e15) > 0.99 * device.matmul_efficiency


def test_forward_and_backward_time_at_peak() -> None:
    cluster = a100_cluster(ideal=True)
    cost = estimate_layer(_plain(3.12e12, 1.56e12), cluster, ParallelConfig(), Recompute.NONE, seq_len=128)
    assert math.isclose(cost.fwd_s, 0.015, rel_tol=1e-9)  # (3.12 + 1.56) TFLOP / 312 TFLOP/s
    assert math.isclose(cost.bwd_s, 0.030, rel_tol=1e-9)
    assert math.isclose(cost.bwd_weight_s, 0.010, rel_tol=1e-9)  # weight gradients: one matmul pass


def test_microbatch_scales_linearly_and_tp_splits() -> None:
    cluster = dataclasses.replace(a100_cluster(ideal=True), devices_per_node=2)
    layer = _plain(3.12e12, 0.0)
    one = estimate_layer(layer, cluster, ParallelConfig(microbatch=1), "none", seq_len=128, graph_microbatch=2)
    assert math.isclose(one.fwd_s, 0.005, rel_tol=1e-9)
    split = estimate_layer(layer, cluster, ParallelConfig(tp=2, microbatch=2), "none", seq_len=128,
                           graph_microbatch=2)
    assert math.isclose(split.fwd_s, 0.005, rel_tol=1e-9)


def test_narrow_tp_matmuls_run_less_efficiently() -> None:
    g = gpt_graph(h=1024, a=16, layers=1, seq=1024)
    cluster = a100_cluster(1)
    t1 = estimate_layer(g.blocks[0], cluster, ParallelConfig(tp=1, dp=8), "none", seq_len=1024)
    t8 = estimate_layer(g.blocks[0], cluster, ParallelConfig(tp=8), "none", seq_len=1024)
    assert t8.fwd_s > t1.fwd_s / 8 * 1.2  # 8x less work but slower per FLOP


def test_recompute_modes() -> None:
    g = gpt_graph(h=1024, a=16, layers=1, seq=1024)
    cluster = a100_cluster(1)
    cfg = ParallelConfig(dp=8)
    whole = Engine(recompute_early_stop=False)  # a recompute that re-runs the whole forward (reentrant)
    none, sel, full = (estimate_layer(g.blocks[0], cluster, cfg, r, seq_len=1024, engine=whole) for r in Recompute)
    assert none.recompute_s == 0.0
    assert math.isclose(full.recompute_s, full.fwd_s)
    attention_core = g.blocks[0].fwd_attention_flops / (312e12 * cluster.device.attention_efficiency)
    assert attention_core < sel.recompute_s < full.recompute_s  # core + its score kernels, less than all


def test_host_bound_floor() -> None:
    cluster = a100_cluster(ideal=True)
    slow_host = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, op_overhead_s=1e-3))
    cost = estimate_layer(_plain(3.12e9, 0.0, num_nodes=10), slow_host, ParallelConfig(), "full", seq_len=8)
    assert math.isclose(cost.fwd_s, 0.010)  # 10 ops x 1 ms > 10 us of device time
    assert math.isclose(cost.bwd_s, 0.020)
    assert math.isclose(cost.recompute_s, 0.010)


def test_unknown_dtype_is_an_error() -> None:
    cluster = dataclasses.replace(a100_cluster(), dtype="int3")
    with pytest.raises(ValueError, match="int3"):
        estimate_layer(_plain(1.0, 0.0), cluster, ParallelConfig(), "none", seq_len=8)


@pytest.mark.parametrize("profile", ["dgx-a100-80gb", "dgx-h100-80gb", "h200"])
def test_shipped_gpu_profiles_have_a_host_floor(profile: str) -> None:
    from autoplan.cluster.load import Cluster
    cluster = Cluster.load(profile, num_nodes=1)
    overhead = cluster.device.op_overhead_s
    assert 1e-6 <= overhead <= 1e-4  # eager per-op host time is microseconds, not ns or ms
    tiny = estimate_layer(_plain(1e8, 0.0, num_nodes=40), cluster, ParallelConfig(), "none", seq_len=8)
    assert math.isclose(tiny.fwd_s, 40 * overhead)  # 0.1 GFLOP is < 1 us of device time: host-bound
    assert math.isclose(tiny.bwd_s, 80 * overhead)
    big = estimate_layer(_plain(1e13, 0.0, num_nodes=40), cluster, ParallelConfig(), "none", seq_len=8)
    device_s = 1e13 / (cluster.peak_flops * matmul_efficiency(cluster.device, 1e13))
    assert math.isclose(big.fwd_s, device_s)  # 10 TFLOP runs far longer than 40 ops take to issue


def test_gemm_roofline_by_hand() -> None:
    """Ideal A100 (312 TFLOP/s, 2.0 TB/s, efficiencies 1): [128 x 8192] @ [8192 x 8192] in bf16 moves
    (2 * 128 * 8192 + 8192^2) * 2 bytes = 138 MB (69 us) for 17.2 GFLOP (55 us): memory-bound; with
    8192 rows it is compute-bound; a weight-gradient pass accumulating 8 bytes per weight element
    moves 4x the weight bytes."""
    from autoplan.cost.compute import gemm_pass_s
    device = a100_cluster(ideal=True).device
    small = gemm_pass_s(device, 312e12, 128, 8192, 8192, 1, 2)
    assert math.isclose(small, (2 * 128 * 8192 + 8192**2) * 2 / 2.0e12)
    big = gemm_pass_s(device, 312e12, 8192, 8192, 8192, 3, 2)
    assert math.isclose(big, 3 * 2 * 8192**3 / 312e12)
    wgrad = gemm_pass_s(device, 312e12, 8192, 128, 8192, 1, 2, out_bytes=8)
    assert math.isclose(wgrad, (2 * 128 * 8192 * 2 + 8192**2 * 8) / 2.0e12)


def test_few_tokens_per_device_make_the_block_weight_bound() -> None:
    """A GPT block (h 4096, GELU 4h) at 64 tokens per device: every matmul pass is bound by its weight
    traffic, so the weight-gradient time is the hand sum of (A + B) * 2 + W * 8 bytes over the four
    weight matmuls, while at 8192 tokens it is their FLOPs at peak."""
    cluster = a100_cluster(ideal=True)
    h = 4096
    # wq, wk, wv (three linears in autoplan's executor: Engine.separate_qkv_projections), proj, fc1, fc2 as (k, n)
    weights = [(h, h), (h, h), (h, h), (h, h), (h, 4 * h), (4 * h, h)]
    for seq, bound in ((64, "memory"), (8192, "compute")):
        g = gpt_graph(h=h, a=32, layers=1, seq=seq, unfused=False)
        cost = estimate_layer(g.blocks[0], cluster, ParallelConfig(), "none", seq_len=seq)
        if bound == "memory":
            hand = sum((seq * k + seq * n) * 2 + k * n * 8 for k, n in weights) / 2.0e12
        else:
            hand = sum(2 * seq * k * n for k, n in weights) / 312e12
        assert math.isclose(cost.bwd_weight_s, hand, rel_tol=1e-9), bound


def test_fused_causal_attention_costs_half_the_square() -> None:
    """FlashAttention skips the masked half of a causal square (Dao 2023): 1.56 TFLOP of full-square
    attention costs 0.78 TFLOP at peak; matmuls unchanged."""
    cluster = a100_cluster(ideal=True)
    cost = estimate_layer(_plain(3.12e12, 1.56e12, causal_attention=True), cluster, ParallelConfig(),
                          Recompute.NONE, seq_len=128)
    assert math.isclose(cost.fwd_s, (3.12e12 + 0.78e12) / 312e12, rel_tol=1e-9)
    assert math.isclose(cost.bwd_s, 2 * (3.12e12 + 0.78e12) / 312e12, rel_tol=1e-9)


@pytest.mark.parametrize("recompute", list(Recompute))
def test_causal_halves_fused_attention_time_and_leaves_unfused_alone(recompute: Recompute) -> None:
    """FlashAttention-2 by hand (kernels.flash_efficiency on an ideal device without SMs): a causal query
    block visits half the s / 128 key blocks, so it computes half the square at kv / (kv + 1) with kv =
    8 instead of 16; d = 64 heads scale by (1 + r c / (14 * 128)) / (1 + r c / (14 * 64)), r = 16 (no
    fp32 peak in the profile), c = 9. The backward is 2.5 x the forward (Dao 2023's count). An unfused
    kernel (scores stored) computes the whole square whatever the mask."""
    h, a, s = 1024, 16, 2048
    cluster = a100_cluster(ideal=True)
    core = 4.0 * s * s * h / 312e12  # the full square's forward at peak (attention_efficiency 1)
    share = 16 * 9 / 14
    head_dim = (1 + share / 128) / (1 + share / (h // a))
    kv_full, kv_causal = s / 128, s / 128 / 2
    fused_full = core / (head_dim * kv_full / (kv_full + 1))
    fused_causal = core / 2 / (head_dim * kv_causal / (kv_causal + 1))
    for unfused in (False, True):
        causal = gpt_graph(h=h, a=a, layers=1, seq=s, unfused=unfused).blocks[0]
        assert causal.causal_attention
        full = dataclasses.replace(causal, causal_attention=False)
        c, f = (estimate_layer(x, cluster, ParallelConfig(), recompute, seq_len=s) for x in (causal, full))
        saved = 0.0 if unfused else fused_full - fused_causal
        assert saved >= 0.0
        assert math.isclose(f.fwd_s - c.fwd_s, saved, rel_tol=1e-9, abs_tol=1e-15)
        assert math.isclose(f.bwd_s - c.bwd_s, 2.5 * saved, rel_tol=1e-9, abs_tol=1e-15)
        redo = {Recompute.NONE: 0.0, Recompute.SELECTIVE: saved, Recompute.FULL: saved}[recompute]
        assert math.isclose(f.recompute_s - c.recompute_s, redo, rel_tol=1e-9, abs_tol=1e-15)


def test_causal_attention_changes_time_not_model_flops() -> None:
    """MFU keeps Megatron's full-square FLOPs (Narayanan et al. 2021): mfu x step time is the same."""
    g = gpt_graph(h=1024, a=16, layers=2, seq=4096, unfused=False)
    full = dataclasses.replace(g, layers=tuple(dataclasses.replace(x, causal_attention=False) for x in g.layers))
    cluster = a100_cluster(1)
    cfg = ParallelConfig(dp=8, microbatch=1)
    e_causal, e_full = (estimate_config(x, cluster, cfg, global_batch=16) for x in (g, full))
    assert e_causal.step_time_s < e_full.step_time_s
    assert math.isclose(e_causal.mfu * e_causal.step_time_s, e_full.mfu * e_full.step_time_s, rel_tol=1e-9)


@pytest.mark.parametrize("profile", ["dgx-a100-80gb", "dgx-h100-80gb", "h200"])
def test_small_k_gemm_pays_its_output_write(profile: str) -> None:
    """At a fixed 4096 x 4096 bf16 output, a GEMM's time is its mainloop plus the write of C (measured on
    A100 and H100: profiles' gemm_epilogue_overlap comments), so k = 256 runs below the k = 4096 rate.
    Hand: 256x128 tiles, 512 of them in ceil(512 / SMs) waves; mainloop 2 m n k / (peak x
    matmul_efficiency x 512 / (waves x SMs)) + waves x gemm_tile_fill_s; C 4096^2 x 2 bytes at HBM bw x
    mem_bw_efficiency."""
    from autoplan.cluster.load import Cluster
    from autoplan.cost.compute import gemm_pass_s
    d = Cluster.load(profile, num_nodes=1).device
    peak = d.peak("bf16")
    sms = d.num_sms
    waves = math.ceil(512 / sms)
    util = 512 / (waves * sms)
    write_s = 4096**2 * 2 / (d.mem_bw_bytes_per_s * d.mem_bw_efficiency)
    rate = {}
    for k in (256, 4096):
        mainloop_s = 2 * 4096**2 * k / (peak * d.matmul_efficiency * util) + waves * d.gemm_tile_fill_s
        t = gemm_pass_s(d, peak, 4096, k, 4096, 1, 2)
        assert math.isclose(t, mainloop_s + write_s, rel_tol=1e-12), k
        rate[k] = 2 * 4096**2 * k / t
    assert rate[256] < 0.8 * rate[4096]  # the write is half to all of the mainloop at k = 256, 4-9 % of it at k = 4096


def test_tile_fill_is_paid_once_per_wave_of_tiles() -> None:
    """gemm_tile_fill_s = 1 us on an ideal 108-SM device: a 2304 x 1536 output is 9 x 12 = 108 tiles of
    256x128 (one full wave; 128x128 tiles would need two), 6912 x 1536 is 324 tiles (three waves), so 3
    compute-bound GEMMs (k = 4096) take 3 x 1 and 3 x 3 us longer than without the fill; on a profile
    without SMs (a CPU) there is no tile to fill."""
    from autoplan.cost.kernels import gemm_fill_s, gemm_pass_s
    base = dataclasses.replace(a100_cluster(ideal=True).device, num_sms=108)
    filled = dataclasses.replace(base, gemm_tile_fill_s=1e-6)
    for m, waves in ((2304, 1), (6912, 3)):
        extra = gemm_pass_s(filled, 312e12, m, 4096, 1536, 3, 2) - gemm_pass_s(base, 312e12, m, 4096, 1536, 3, 2)
        assert math.isclose(extra, 3 * waves * 1e-6, rel_tol=1e-9), m
    assert gemm_fill_s(dataclasses.replace(filled, num_sms=0), 6912, 1536) == 0.0
