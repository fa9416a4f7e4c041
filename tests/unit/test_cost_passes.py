"""The engines' extra memory-bound passes (cost/passes.py) against hand-counted bytes: separate bias adds,
bias-gradient reductions, Megatron's attention layout copies and baddbmm's gradient scaling."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cost.compute import BlockShape, block_shape, layer_compute
from autoplan.cost.passes import PassBytes, extra_pass_bytes
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

FIELDS = ("separate_qkv_bias_add", "separate_fc2_bias_add", "bias_grad_reduction", "attention_layout_copies",
          "attention_grad_scale")
# the engine facts that change a block's GEMMs or its recompute (cost/projections.py) off too, so that only
# the passes differ between two estimates
BARE = dataclasses.replace(Engine(), separate_qkv_projections=False, recompute_early_stop=False,
                           **{name: False for name in FIELDS})
H, A, S, T, D = 1024, 16, 512, 2, 2  # hidden, heads, tokens (one sequence), tp, bytes per element


def _hand_bytes(field: str, sp: bool) -> tuple[float, float, float]:
    """(forward, backward, attention-core forward) bytes of one mechanism, counted by hand for the GPT
    block below: QKV width 3h, MLP width 4h, S tokens on the device, tp T, SP splitting the row-parallel
    outputs' tokens."""
    q, f, tokens_h = 3 * H, 4 * H, (S / T if sp else S)
    return {
        "separate_qkv_bias_add": (2 * S * q / T * D, 0.0, 0.0),  # read + write the QKV output
        "separate_fc2_bias_add": (2 * tokens_h * H * D, 0.0, 0.0),  # read + write the MLP output
        # one read of each biased linear's output gradient: QKV, fc1 (split over tp), the two output projections
        "bias_grad_reduction": (0.0, (S * q / T + S * f / T + 2 * tokens_h * H) * D, 0.0),
        # forward: the context's permute copy; backward: the QKV split's cat
        "attention_layout_copies": (2 * S * H / T * D, 2 * S * q / T * D, 2 * S * H / T * D),
        "attention_grad_scale": (0.0, 2 * 2 * S * H / T * D, 0.0),  # dQ and dK, each read + written
    }[field]


def _times(engine: Engine, sp: bool, recompute: Recompute = Recompute.NONE):
    layer = gpt_graph(h=H, a=A, layers=1, seq=S).layers[1]
    cluster = a100_cluster()
    config = ParallelConfig(tp=T, sp=sp, microbatch=1)
    return layer_compute(layer, cluster.device, cluster.peak_flops, config, recompute, scale=1.0, seq_len=S,
                         graph_tokens=float(S), dtype_bytes=D, scores_materialised=True, engine=engine)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("field", FIELDS)
def test_each_pass_adds_exactly_its_bytes_at_streaming_bandwidth(field: str, sp: bool) -> None:
    device = a100_cluster().device
    rate = device.mem_bw_bytes_per_s * device.mem_bw_efficiency
    fwd, bwd, attention = _hand_bytes(field, sp)
    one = dataclasses.replace(BARE, **{field: True})
    base, with_it = _times(BARE, sp), _times(one, sp)
    assert math.isclose((with_it.fwd_s - base.fwd_s) * rate, fwd, rel_tol=1e-9, abs_tol=1e-3)
    assert math.isclose((with_it.bwd_s - base.bwd_s) * rate, bwd, rel_tol=1e-9, abs_tol=1e-3)
    assert math.isclose((with_it.attention_fwd_s - base.attention_fwd_s) * rate, attention, rel_tol=1e-9,
                        abs_tol=1e-3)
    # selective recompute re-runs the attention core (the context copy is inside it), full the whole forward
    sel_delta = _times(one, sp, Recompute.SELECTIVE).recompute_s - _times(BARE, sp, Recompute.SELECTIVE).recompute_s
    full_delta = _times(one, sp, Recompute.FULL).recompute_s - _times(BARE, sp, Recompute.FULL).recompute_s
    assert math.isclose(sel_delta * rate, attention, rel_tol=1e-9, abs_tol=1e-3)
    assert math.isclose(full_delta * rate, fwd, rel_tol=1e-9, abs_tol=1e-3)
    assert fwd + bwd > 0  # every mechanism moves bytes somewhere


def test_all_passes_add_up_to_the_sum_of_their_parts() -> None:
    shape = block_shape(gpt_graph(h=H, a=A, layers=1, seq=S).layers[1], float(S))
    every = dataclasses.replace(BARE, **{name: True for name in FIELDS})
    total = extra_pass_bytes(shape, float(S), T, False, D, every)
    assert math.isclose(total.fwd, sum(_hand_bytes(f, False)[0] for f in FIELDS))
    assert math.isclose(total.bwd, sum(_hand_bytes(f, False)[1] for f in FIELDS))


def test_engines_without_the_mechanisms_and_blocks_without_biases_add_nothing() -> None:
    gpt = block_shape(gpt_graph(h=H, a=A, layers=1, seq=S).layers[1], float(S))
    for name in ("torchtitan", "megatron-core"):  # torchtitan's separate Q / K / V linears: their own test
        engine = dataclasses.replace(Engine.load(name), separate_qkv_projections=False)
        assert extra_pass_bytes(gpt, float(S), T, False, D, engine) == PassBytes()
    assert extra_pass_bytes(None, float(S), T, False, D, Engine.load("megatron-lm")) == PassBytes()
    # a Llama-style (SwiGLU) block has no biases: under Megatron only the attention layout passes remain
    llama = BlockShape(h=H, a=A, g=A, f=4 * H, n_mlp=3)
    got = extra_pass_bytes(llama, float(S), T, False, D, Engine.load("megatron-lm"))
    layout = _hand_bytes("attention_layout_copies", False)
    scale = _hand_bytes("attention_grad_scale", False)
    assert math.isclose(got.fwd, layout[0]) and math.isclose(got.bwd, layout[1] + scale[1])
    # autoplan's executor (torch 2.x: bias in the addmm epilogue) keeps only the bias-gradient reductions and
    # the sum of its wq / wk / wv input gradients (two adds of [S, H]: read two, write one)
    mine = extra_pass_bytes(gpt, float(S), T, False, D, Engine.load("autoplan"))
    assert mine.fwd == 0.0
    assert math.isclose(mine.bwd, _hand_bytes("bias_grad_reduction", False)[1] + 2 * 3 * S * H * D)


def test_shipped_megatron_engines_carry_what_their_code_does() -> None:
    lm, mds = Engine.load("megatron-lm"), Engine.load("megatron-deepspeed")
    assert lm.separate_qkv_bias_add and not lm.separate_fc2_bias_add  # fc2: skip_bias_add=True (2021-22)
    assert mds.separate_qkv_bias_add and mds.separate_fc2_bias_add  # fc2: no skip_bias_add (c08e2cc2)
    for engine in (lm, mds, Engine.load("deepspeed")):
        assert engine.bias_grad_reduction and engine.attention_layout_copies and engine.attention_grad_scale


def test_megatron_fused_softmax_shape_rules() -> None:
    """fused_softmax.py is_kernel_available, by hand: b * np a multiple of 4 (and of 4 batches per block
    for s_k in (128, 4096]; 8 for s_k <= 128), 16 < s_k <= max_keys, no rules when max_keys is 0."""
    from autoplan.cost.passes import fused_softmax_available as ok

    assert ok(4, 1024, 1024, 4096) and ok(12, 2048, 2048, 4096) and ok(8, 128, 128, 4096)
    assert not ok(2, 1024, 1024, 4096)  # tp 8, 16 heads, microbatch 1: 2 batches
    assert not ok(6, 2048, 2048, 4096)  # 48 heads over tp 16, microbatch 2
    assert not ok(4, 128, 128, 4096)  # s_k <= 128: 8 batches per block
    assert not ok(4, 8192, 8192, 4096) and not ok(4, 16, 16, 4096)
    assert ok(2, 1024, 1024, 0)


@pytest.mark.parametrize("mb, falls_back", [(1, True), (2, False)])
def test_softmax_fallback_adds_its_fp32_passes_and_ops(mb: int, falls_back: bool) -> None:
    """tp 8, 16 heads: microbatch 1 leaves b * np = 2 (torch fallback), 2 gives 4 (fused). Hand: 2 * 1024^2
    scores per microbatch, 28 extra bytes each forward, 36 - 2 backward; five extra host ops forward (and
    in the recomputed forward), four backward."""
    engine = dataclasses.replace(Engine.load("megatron-deepspeed"), fused_softmax_max_keys=4096)
    rules_off = dataclasses.replace(engine, fused_softmax_max_keys=0)
    s, h, t = 1024, 1024, 8
    layer = gpt_graph(h=h, a=16, layers=1, seq=s).layers[1]
    cluster = a100_cluster()
    device = cluster.device

    def times(e: Engine):
        return layer_compute(layer, device, cluster.peak_flops, ParallelConfig(tp=t, microbatch=mb), Recompute.FULL,
                             scale=float(mb), seq_len=s, graph_tokens=float(s), dtype_bytes=2,
                             scores_materialised=True, engine=e)

    a, b = times(rules_off), times(engine)
    scores = (mb * 16 / t) * s * s if falls_back else 0.0
    rate = device.mem_bw_bytes_per_s * device.mem_bw_efficiency
    op = device.op_overhead_s
    assert math.isclose(b.fwd_s - a.fwd_s, scores * 28 / rate, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(b.attention_fwd_s - a.attention_fwd_s, scores * 28 / rate, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(b.bwd_s - a.bwd_s, scores * 34 / rate, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(b.host_fwd_s - a.host_fwd_s, 5 * op * falls_back, abs_tol=1e-15)
    assert math.isclose(b.host_rec_s - a.host_rec_s, 5 * op * falls_back, abs_tol=1e-15)
    assert math.isclose(b.host_bwd_s - a.host_bwd_s, 4 * op * falls_back, abs_tol=1e-15)
