"""Device-synchronising host-to-device copies in a block's forward (Engine.block_forward_syncs: Megatron-
DeepSpeed's torch.tensor(0.0, device=...) pair) against a hand computation: each costs H2D_SYNC_COPY_S +
op_overhead_s per forward and per fully recomputed forward, nothing in the backward, nothing under CUDA
graphs, on a CPU profile or outside a block."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cluster.load import Cluster
from autoplan.cost.compute import H2D_SYNC_COPY_S
from autoplan.cost.layer import estimate_layer
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

H, A, S = 1024, 16, 1024


def _cost(engine: Engine, recompute: Recompute, *, index: int = 1, cluster=None, mb: int = 1):
    graph = gpt_graph(h=H, a=A, layers=2, seq=S)
    return estimate_layer(graph.layers[index], cluster or a100_cluster(), ParallelConfig(tp=1, microbatch=mb),
                          recompute, seq_len=S, engine=engine)


@pytest.mark.parametrize("mb", [1, 8])  # host-bound and device-bound forwards: the copies add either way
def test_each_sync_adds_its_copy_latency_and_one_op_to_forward_and_recompute(mb: int) -> None:
    base = Engine.load("megatron-deepspeed")
    off, on = dataclasses.replace(base, block_forward_syncs=0), dataclasses.replace(base, block_forward_syncs=2)
    op = a100_cluster().device.op_overhead_s
    per_pass = 2 * (6.0e-6 + op)  # hand: two copies, each 6 us (DualPath's measured 5-7 us) + one 10 us op
    assert H2D_SYNC_COPY_S == 6.0e-6
    a, b = _cost(off, Recompute.FULL, mb=mb), _cost(on, Recompute.FULL, mb=mb)
    assert math.isclose(b.fwd_s - a.fwd_s, per_pass, rel_tol=1e-9)
    assert math.isclose(b.recompute_s - a.recompute_s, per_pass, rel_tol=1e-9)
    assert b.bwd_s == a.bwd_s
    # without recompute only the forward pays
    a, b = _cost(off, Recompute.NONE, mb=mb), _cost(on, Recompute.NONE, mb=mb)
    assert math.isclose(b.time_s - a.time_s, per_pass, rel_tol=1e-9)


def test_no_sync_cost_under_cuda_graphs_on_a_cpu_profile_or_outside_a_block() -> None:
    on = dataclasses.replace(Engine.load("megatron-deepspeed"), block_forward_syncs=2)
    off = dataclasses.replace(on, block_forward_syncs=0)
    graphs = dataclasses.replace(on, cuda_graphs=True)
    assert _cost(graphs, Recompute.FULL).time_s == _cost(dataclasses.replace(graphs, block_forward_syncs=0),
                                                         Recompute.FULL).time_s
    cpu = Cluster.load("local-cpu", num_nodes=1)
    assert _cost(on, Recompute.FULL, cluster=cpu).time_s == _cost(off, Recompute.FULL, cluster=cpu).time_s
    for index in (0, 3):  # the embedding and the head
        assert _cost(on, Recompute.FULL, index=index).time_s == _cost(off, Recompute.FULL, index=index).time_s


def test_only_megatron_deepspeed_ships_the_copies() -> None:
    assert Engine.load("megatron-deepspeed").block_forward_syncs == 2
    for name in Engine.names():
        if name != "megatron-deepspeed":
            assert Engine.load(name).block_forward_syncs == 0, name
