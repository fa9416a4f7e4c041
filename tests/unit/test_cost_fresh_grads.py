"""Engine.grad_freed_after_reduce (engines/torchtitan.yaml): when a backward starts with every .grad None
(FSDP2 frees each unsharded gradient after its reduce-scatter; optimizer.zero_grad(set_to_none=True) at
the step's start), autograd adopts each weight-gradient GEMM's output as the gradient, so the GEMM writes
its output once (2 bytes per weight element in bf16) instead of accumulating into a gradient (read + write,
2 x GRAD_ACCUMULATE_BYTES = 8). Checked against that hand count, per layer and per step, and the quick
estimate against the exact one."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph, quick_and_exact

from autoplan.cost import estimate_config
from autoplan.cost.compute import GRAD_ACCUMULATE_BYTES, layer_compute
from autoplan.graph.types import Layer, LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

H, A, F, S, D = 1024, 16, 2816, 512, 2  # hidden, heads, SwiGLU width, tokens, bf16 bytes
BASE = a100_cluster()
# an Ampere device with SMs: each GEMM's output write follows its mainloop (gemm_epilogue_overlap False);
# NVLink 10x faster than NVSwitch, so the data-parallel collectives of these small blocks hide behind them
CLUSTER = dataclasses.replace(BASE, dtype="bf16", device=dataclasses.replace(
    BASE.device, num_sms=108, gemm_epilogue_overlap=False, op_overhead_s=0.0),
    intra_node=dataclasses.replace(BASE.intra_node, bw_bytes_per_s=3e12))
RATE = CLUSTER.device.mem_bw_bytes_per_s * CLUSTER.device.mem_bw_efficiency
ON = every_zero_stage(Engine.load("torchtitan"))
OFF = dataclasses.replace(ON, grad_freed_after_reduce=False)
WEIGHTS = H * (3 * H) + H * H + 3 * H * F  # wq, wk, wv, wo, w1, w2, w3 (the norms' 2 H carry no GEMM)


def llama_block(name: str = "layers.0", index: int = 1) -> Layer:
    """A Llama-style block (SwiGLU: three h x f matmuls, as many kv heads as heads), S tokens."""
    return Layer(name=name, kind="block", role=LayerRole.BLOCK, index=index,
                 fwd_matmul_flops=2.0 * S * WEIGHTS, fwd_attention_flops=4.0 * S * S * H,
                 fwd_elementwise_flops=10.0 * S * H, num_params=WEIGHTS + 2 * H, param_bytes=2 * (WEIGHTS + 2 * H),
                 activation_bytes=0, causal_attention=True, input_bytes=2 * S * H, output_bytes=2 * S * H,
                 hidden_size=H, num_heads=A, num_kv_heads=A, ffn_hidden_size=F)


def graph() -> LayerGraph:
    g = gpt_graph(h=H, a=A, layers=2, seq=S, vocab=8192, unfused=False)
    return dataclasses.replace(g, layers=(g.layers[0], llama_block(), llama_block("layers.1", 2),
                                          dataclasses.replace(g.layers[-1], index=3)))


def test_a_freed_gradient_saves_the_accumulate_traffic_of_every_weight_element() -> None:
    """Per block: (8 - 2) bytes x the weight elements of its GEMMs at streaming bandwidth; nothing else
    in the block's backward moves, and an engine without the field saves nothing."""
    def times(engine: Engine):
        return layer_compute(llama_block(), CLUSTER.device, CLUSTER.peak_flops, ParallelConfig(), Recompute.NONE,
                             scale=1.0, seq_len=S, graph_tokens=float(S), dtype_bytes=D, scores_materialised=False,
                             engine=engine)
    on, off = times(ON), times(OFF)
    hand = (2 * GRAD_ACCUMULATE_BYTES - D) * WEIGHTS / RATE
    assert math.isclose(on.fresh_grad_saving_s, hand, rel_tol=1e-9)
    assert off.fresh_grad_saving_s == 0.0
    assert on.bwd_s == off.bwd_s and on.bwd_weight_s == off.bwd_weight_s  # the layer keeps the accumulating price


def test_the_step_takes_the_saving_off_every_microbatch_that_starts_with_freed_gradients() -> None:
    """ZeRO-3 reduce-scatters (and frees) after every microbatch: all m save; ZeRO-1 reduces once per step,
    so the gradients accumulate after the step's first microbatch: one in m saves. The compute breakdown
    (m x the rank's per-microbatch compute) falls by that many times the two blocks' saving."""
    per_block = (2 * GRAD_ACCUMULATE_BYTES - D) * WEIGHTS / RATE
    for zero, m, saving_microbatches in ((3, 3, 3), (1, 4, 1)):
        config = ParallelConfig(dp=8, zero=zero, microbatch=1)
        on, off = (estimate_config(graph(), CLUSTER, config, global_batch=8 * m, engine=e) for e in (ON, OFF))
        drop = off.breakdown["compute"] - on.breakdown["compute"]
        assert math.isclose(drop, 2 * per_block * saving_microbatches, rel_tol=1e-9), zero
        assert on.step_time_s < off.step_time_s


def test_the_quick_estimate_takes_off_what_the_exact_model_does() -> None:
    """search/assemble.py applies the same share to the per-layer saving (surrogate field 'fresh')."""
    from autoplan.search.space import SearchOptions, enumerate_space

    space = enumerate_space(graph(), CLUSTER, SearchOptions(global_batch=16))
    rows = [i for zero in (1, 3) for i in [j for j in range(len(space)) if space.config(j).pp == 1
                                           and space.config(j).zero == zero and space.config(j).dp == 8][:3]]
    assert {space.config(i).zero for i in rows} == {1, 3}
    deltas = [quick_and_exact(graph(), CLUSTER, space, rows, 16, engine) for engine in (ON, OFF)]
    (q_on, e_on), (q_off, e_off) = deltas
    assert np.all(e_off - e_on > 0)
    np.testing.assert_allclose(q_off - q_on, e_off - e_on, rtol=1e-6)
