"""The mechanisms torchtitan's code adds (engines/torchtitan.yaml), each against a hand count of the bytes
it moves: the fp32 eager RMSNorm, the repeated K / V of grouped-query attention, FSDP2's reduce-scatter
copy-in and torch.optim.AdamW's unfused passes. Differences between two estimates that differ in one
Engine field, so the rest of the model cancels."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph, quick_and_exact

from autoplan.cost import estimate_config
from autoplan.cost.compute import layer_compute
from autoplan.graph.types import Layer, LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

H, A, F, S, D = 1024, 16, 2816, 512, 2  # hidden, heads, SwiGLU width, tokens, bf16 bytes
CLUSTER = a100_cluster()
RATE = CLUSTER.device.mem_bw_bytes_per_s * CLUSTER.device.mem_bw_efficiency
TITAN = every_zero_stage(Engine.load("torchtitan"))


def llama_block(kv: int = A) -> Layer:
    """A Llama-style block (SwiGLU: three h x f matmuls, kv key/value heads), one sequence of S tokens."""
    qkv = H + 2 * H * kv // A
    return Layer(name="layers.0", kind="block", role=LayerRole.BLOCK, index=1,
                 fwd_matmul_flops=2.0 * S * (H * qkv + H * H + 3 * H * F), fwd_attention_flops=4.0 * S * S * H,
                 fwd_elementwise_flops=10.0 * S * H, num_params=H * qkv + H * H + 3 * H * F + 2 * H,
                 param_bytes=2 * (H * qkv + H * H + 3 * H * F + 2 * H), activation_bytes=0,
                 causal_attention=True, input_bytes=2 * S * H, output_bytes=2 * S * H, hidden_size=H,
                 num_heads=A, num_kv_heads=kv, ffn_hidden_size=F)


def times(engine: Engine, recompute: Recompute = Recompute.NONE, kv: int = A):
    return layer_compute(llama_block(kv), CLUSTER.device, CLUSTER.peak_flops, ParallelConfig(), recompute,
                         scale=1.0, seq_len=S, graph_tokens=float(S), dtype_bytes=D, scores_materialised=False,
                         engine=engine)


def test_fp32_eager_rmsnorm_moves_its_kernels_bytes_beyond_the_fused_kernel() -> None:
    """torchtitan's RMSNorm, `_norm(x.float()).type_as(x) * weight`, kernel by kernel in (read + write)
    bytes per element for bf16 x: forward cast 2+4, pow 4+4, mean 4, * rstd 4+4, type_as 4+2, * weight
    2+2 = 36; backward: * weight's two gradients 2+2 and 4+2 (+ the sum 2), type_as 2+4, * rstd's two
    4+4 and 8+4 (+ the sum 4), mean's expand 4, pow's three 8, 8 and 12, the two x gradients summed 12,
    the cast 4+2 = 92. A fused kernel moves 4 forward and 6 backward. Two norms per block, H per token."""
    fwd_elem = (2 + 4) + (4 + 4) + 4 + (4 + 4) + (4 + 2) + (2 + 2)
    bwd_elem = (2 + 2) + (4 + 2) + 2 + (2 + 4) + (4 + 4) + (8 + 4) + 4 + 4 + 8 + 8 + 12 + 12 + (4 + 2)
    assert (fwd_elem, bwd_elem) == (36, 92)
    fused = times(dataclasses.replace(TITAN, rmsnorm="fused"))
    eager = times(dataclasses.replace(TITAN, rmsnorm="eager_fp32"))
    assert math.isclose((eager.fwd_s - fused.fwd_s) * RATE, 2 * S * H * (fwd_elem - 4), rel_tol=1e-9)
    assert math.isclose((eager.bwd_s - fused.bwd_s) * RATE, 2 * S * H * (bwd_elem - 6), rel_tol=1e-9)
    # torchtitan's op-level selective checkpointing and full recompute both re-run the norms' forward
    for mode in (Recompute.SELECTIVE, Recompute.FULL):
        delta = times(dataclasses.replace(TITAN, rmsnorm="eager_fp32"), mode).recompute_s - times(
            dataclasses.replace(TITAN, rmsnorm="fused"), mode).recompute_s
        assert math.isclose(delta * RATE, 2 * S * H * (fwd_elem - 4), rel_tol=1e-9)


def test_fused_elementwise_engines_and_gelu_blocks_ignore_the_norm_kind() -> None:
    megatron = Engine.load("megatron-core")
    a = times(dataclasses.replace(megatron, rmsnorm="eager_fp32"))
    b = times(dataclasses.replace(megatron, rmsnorm="fused"))
    assert (a.fwd_s, a.bwd_s) == (b.fwd_s, b.bwd_s)
    gpt = gpt_graph(h=H, a=A, layers=1, seq=S, unfused=False).blocks[0]
    run = [layer_compute(gpt, CLUSTER.device, CLUSTER.peak_flops, ParallelConfig(), Recompute.NONE, scale=1.0,
                         seq_len=S, graph_tokens=float(S), dtype_bytes=D, scores_materialised=False,
                         engine=dataclasses.replace(TITAN, rmsnorm=kind)) for kind in ("eager_fp32", "fused")]
    assert run[0].fwd_s == run[1].fwd_s and run[0].bwd_s == run[1].bwd_s


@pytest.mark.parametrize("kv", [2, 4])
def test_repeated_kv_is_a_copy_forward_and_a_sum_backward(kv: int) -> None:
    """repeat_kv (expand + reshape) reads K and V at kv heads and writes them at A heads: per token
    2 (H kv / A + H) elements each way; expand's backward sums the copies back: the same bytes."""
    on, off = times(TITAN, kv=kv), times(dataclasses.replace(TITAN, attention_saves_repeated_kv=False), kv=kv)
    expected = 2 * S * (H * kv / A + H) * D
    assert math.isclose((on.fwd_s - off.fwd_s) * RATE, expected, rel_tol=1e-9)
    assert math.isclose((on.bwd_s - off.bwd_s) * RATE, expected, rel_tol=1e-9)
    mha_on, mha_off = times(TITAN), times(dataclasses.replace(TITAN, attention_saves_repeated_kv=False))
    assert mha_on.fwd_s == mha_off.fwd_s  # no grouped-query attention: nothing repeated


def _graph() -> LayerGraph:
    g = gpt_graph(h=H, a=A, layers=2, seq=S, vocab=8192, unfused=False)
    return dataclasses.replace(g, layers=(g.layers[0], llama_block(), dataclasses.replace(
        llama_block(), name="layers.1", index=2), dataclasses.replace(g.layers[-1], index=3)))


def _step(engine: Engine, zero: int, microbatches: int = 1):
    cluster = dataclasses.replace(CLUSTER, dtype="bf16")
    config = ParallelConfig(dp=8, zero=zero, microbatch=1)
    return estimate_config(_graph(), cluster, config, global_batch=8 * microbatches, engine=engine)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_fsdp2_copy_in_adds_the_gradient_copy_to_every_reduce_scatter(microbatches: int) -> None:
    """FSDP2 (zero 3 reduces every microbatch) copies each block's bf16 gradients into the fp32 reduce-scatter
    input, and the compute stream waits for it: (2 + 4) bytes per parameter of the whole model, per
    microbatch, on the step's critical path."""
    params = sum(layer.num_params for layer in _graph().layers)
    off = dataclasses.replace(TITAN, reduce_scatter_copy_in=False)
    on, base = _step(TITAN, 3, microbatches), _step(off, 3, microbatches)
    expected = microbatches * (2 + 4) * params / RATE
    assert math.isclose(on.step_time_s - base.step_time_s, expected, rel_tol=1e-6)
    assert math.isclose(on.breakdown.dp_comm - base.breakdown.dp_comm, expected, rel_tol=1e-6)
    # plain data parallelism all-reduces the gradients where autograd left them: no copy-in
    assert _step(TITAN, 0).step_time_s == _step(off, 0).step_time_s


def test_unfused_adamw_is_eight_passes_over_the_shard() -> None:
    """torch.optim.AdamW's passes per fp32 parameter: mul_ 4+4, lerp_ 8+4, mul_ 4+4, addcmul_ 8+4, sqrt 4+4,
    div_ 4+4, add_ 4+4, addcdiv_ 12+4 = 80 bytes against a fused kernel's 28; zero 3 shards them dp ways."""
    unfused = 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16
    params = sum(layer.num_params for layer in _graph().layers)
    a = _step(TITAN, 3).breakdown.optimizer
    b = _step(dataclasses.replace(TITAN, fused_adam=True), 3).breakdown.optimizer
    assert math.isclose((a - b) * RATE, (unfused - 28) * params / 8, rel_tol=1e-9)


def test_shipped_engines_carry_their_optimizer_and_norm() -> None:
    assert not TITAN.fused_adam and TITAN.rmsnorm == "eager_fp32" and TITAN.reduce_scatter_copy_in
    assert not Engine.load("autoplan").fused_adam and Engine.load("autoplan").rmsnorm == "eager"
    for name in ("megatron-lm", "megatron-core", "megatron-deepspeed", "deepspeed"):
        engine = Engine.load(name)
        assert engine.fused_adam and not engine.reduce_scatter_copy_in
    with pytest.raises(ValueError, match="engine field 'rmsnorm' must be one of"):
        dataclasses.replace(TITAN, rmsnorm="apex")


def test_fp32_eager_rmsnorm_keeps_the_fp32_copy_of_both_norm_inputs() -> None:
    """Without recompute, `x.float()` is what pow and * rstd save: two norms x H x (4 - 2) bytes more per
    token than a norm that keeps the bf16 input; fp32 training has no copy to keep."""
    from autoplan.cost.compute import block_shape
    from autoplan.cost.memory import block_activation_bytes

    shape = block_shape(llama_block(), float(S))

    def held(kind: str, d: int) -> float:
        engine = dataclasses.replace(TITAN, rmsnorm=kind)
        return block_activation_bytes(shape, 1, S, ParallelConfig(), Recompute.NONE, d, False,
                                      selective="op", engine=engine)[0]

    assert held("eager_fp32", 2) - held("fused", 2) == 2 * H * (4 - 2) * S
    assert held("eager_fp32", 4) == held("fused", 4)


def test_the_quick_estimate_prices_the_copy_in_and_the_optimizer_as_the_exact_model_does() -> None:
    """search/assemble.py mirrors both: switching reduce_scatter_copy_in and fused_adam off moves the
    quick step time by what it moves the exact one, on every zero-3 and zero-1 candidate without a pipeline."""
    import numpy as np

    from autoplan.search.space import SearchOptions, enumerate_space

    graph, cluster = _graph(), dataclasses.replace(CLUSTER, dtype="bf16")
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=8))
    rows = [i for zero in (1, 3) for i in [j for j in range(len(space)) if space.config(j).pp == 1
                                           and space.config(j).zero == zero and space.config(j).dp == 8][:3]]
    assert {space.config(i).zero for i in rows} == {1, 3}
    deltas = [quick_and_exact(graph, cluster, space, rows, 8, engine)
              for engine in (TITAN, dataclasses.replace(TITAN, reduce_scatter_copy_in=False, fused_adam=True))]
    (q_on, e_on), (q_off, e_off) = deltas
    assert np.all(e_on - e_off > 0)
    np.testing.assert_allclose(q_on - q_off, e_on - e_off, rtol=1e-6)
