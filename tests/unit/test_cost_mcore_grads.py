"""Engine.embedding_grad_add (engines/megatron-core.yaml): the embedding's dense .grad is added into
Megatron-Core's fp32 main_grad by the DDP hook every microbatch: read 2 + read 4 + write 4 bytes per table
element on this tp rank. Checked against that hand count, and the quick estimate against the exact one.
(The buffer's per-step zero fill and 1 / dp scale are Engine.grad_buffer_passes: test_cost_grad_buffer_passes.py.)"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph, quick_and_exact

from autoplan.cost.compute import layer_compute
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

CLUSTER = dataclasses.replace(a100_cluster(), dtype="bf16")
RATE = CLUSTER.device.mem_bw_bytes_per_s * CLUSTER.device.mem_bw_efficiency
MCORE = Engine.load("megatron-core")


def graph():
    return gpt_graph(h=512, a=8, layers=2, seq=256, vocab=4096, unfused=False)


def test_the_quick_estimate_adds_what_the_exact_model_does() -> None:
    fields = ("embedding_grad_add",)
    from autoplan.search.space import SearchOptions, enumerate_space

    space = enumerate_space(graph(), CLUSTER, SearchOptions(global_batch=16))
    # ZeRO 0-2 (Megatron-Core's own layouts; the quick estimate approximates ZeRO-3's gather timeline)
    rows = [i for i in range(len(space)) if space.config(i).dp == 8 and space.config(i).pp == 1
            and space.config(i).zero <= 2][:3]
    assert len(rows) == 3
    deltas = [quick_and_exact(graph(), CLUSTER, space, rows, 16, engine)
              for engine in (MCORE, dataclasses.replace(MCORE, **dict.fromkeys(fields, False)))]
    (q_on, e_on), (q_off, e_off) = deltas
    assert np.all(e_on - e_off > 0)
    np.testing.assert_allclose(q_on - q_off, e_on - e_off, rtol=1e-6)


def _bwd(layer, engine: Engine, tp: int) -> float:
    return layer_compute(layer, CLUSTER.device, CLUSTER.peak_flops, ParallelConfig(tp=tp), Recompute.NONE,
                         scale=1.0, seq_len=256, graph_tokens=256.0, dtype_bytes=2, scores_materialised=False,
                         engine=engine).bwd_s


@pytest.mark.parametrize("tp", [1, 2])
def test_the_embedding_gradient_is_added_into_main_grad(tp: int) -> None:
    """(2 + 4 + 4) bytes per element of the embedding table's tp shard, in the backward; blocks unchanged."""
    plain = dataclasses.replace(MCORE, embedding_grad_add=False)
    embed, block = graph().layers[0], graph().layers[1]
    expected = embed.num_params / tp * (2 + 4 + 4) / RATE
    assert math.isclose(_bwd(embed, MCORE, tp) - _bwd(embed, plain, tp), expected, rel_tol=1e-9)
    assert _bwd(block, MCORE, tp) == _bwd(block, plain, tp)
    assert not Engine().embedding_grad_add
