"""FSDP2's root group and torchtitan's last block kept gathered (cost/fsdpunits.py): which layer slot each
all-gather and reduce-scatter belongs to, and what that does to the step, against hand computations."""

from __future__ import annotations

import dataclasses

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cost import comm, estimate_config
from autoplan.cost.dataparallel import dp_groups
from autoplan.cost.fsdpunits import unit_numels
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

ROLES = [LayerRole.EMBEDDING, LayerRole.BLOCK, LayerRole.BLOCK, LayerRole.BLOCK, LayerRole.HEAD]
COUNTS = [100.0, 10.0, 11.0, 12.0, 50.0]
OFF = dataclasses.replace(Engine(), fsdp_root_unit=False)
TITAN = dataclasses.replace(Engine(), fsdp_root_unit=True, fsdp_root_reshards=False, fsdp_last_block_reshards=False)
RESHARDING_ROOT = dataclasses.replace(Engine(), fsdp_root_unit=True)


def _layers(roles: list[LayerRole]) -> list[Layer]:
    return [Layer(name=f"l{i}", kind=role.value, role=role, index=i, fwd_matmul_flops=0.0, fwd_attention_flops=0.0,
                  fwd_elementwise_flops=0.0, num_params=0, param_bytes=0, activation_bytes=0)
            for i, role in enumerate(roles)]


def test_the_root_group_is_gathered_first_reduced_last_and_kept_or_regathered() -> None:
    """embed 100, blocks 10 / 11 / 12, head 50: the root group (150) is gathered before slot 0 and reduced
    after slot 0's backward (the last); torchtitan keeps it and the last block (12) for the backward,
    autoplan's executor's root re-gathers before the first backward (slot 4's)."""
    layers = _layers(ROLES)
    titan = unit_numels(layers, COUNTS, TITAN)
    assert titan.fwd_gather == (150.0, 10.0, 11.0, 12.0, 0.0)
    assert titan.bwd_gather == (0.0, 10.0, 11.0, 0.0, 0.0)
    assert titan.reduce == (150.0, 10.0, 11.0, 12.0, 0.0)
    regathered = unit_numels(layers, COUNTS, RESHARDING_ROOT)
    assert regathered.bwd_gather == (0.0, 10.0, 11.0, 12.0, 150.0)
    assert regathered.fwd_gather == titan.fwd_gather and regathered.reduce == titan.reduce
    assert sum(titan.fwd_gather) == sum(titan.reduce) == sum(COUNTS)  # nothing lost, nothing counted twice


def test_without_a_root_group_each_slot_moves_its_own() -> None:
    """Off (or a middle pipeline stage of blocks only) every slot gathers and reduces its own parameters;
    the last-block rule alone needs the head on the rank."""
    layers = _layers(ROLES)
    own = tuple(COUNTS)
    off = unit_numels(layers, COUNTS, OFF)
    assert off.fwd_gather == off.bwd_gather == off.reduce == own
    kept = unit_numels(layers, COUNTS, dataclasses.replace(OFF, fsdp_last_block_reshards=False))
    assert kept.bwd_gather == (100.0, 10.0, 11.0, 0.0, 50.0)
    middle = unit_numels(_layers([LayerRole.BLOCK] * 3), [10.0, 11.0, 12.0], TITAN)
    assert middle.fwd_gather == middle.bwd_gather == middle.reduce == (10.0, 11.0, 12.0)


def _setup():
    graph = gpt_graph(h=1024, a=16, layers=4, seq=8192, vocab=32000, unfused=False)
    cluster = a100_cluster(2, ideal=True)  # no SM counts: hidden collectives cost the compute nothing
    config = ParallelConfig(dp=16, zero=3)
    embed, head = graph.layers[0].num_params, graph.layers[-1].num_params
    group = dp_groups(config, cluster).dense

    def ag(n: float) -> float:
        return comm.all_gather_s(n * 2.0, group, cluster)  # bf16 weights

    def rs(n: float) -> float:
        return comm.reduce_scatter_s(n * 4.0, group, cluster)  # fp32 gradients

    return graph, cluster, config, embed, head, ag, rs


def _dp(graph, cluster, config, engine: Engine) -> float:
    plain = dataclasses.replace(engine, gather_copy_out=False, reduce_scatter_copy_in=False)
    return estimate_config(graph, cluster, config, global_batch=16, engine=plain).breakdown.dp_comm


@pytest.mark.parametrize("engine", [TITAN, RESHARDING_ROOT])
def test_the_root_group_moves_the_head_s_collectives_to_the_step_s_ends(engine: Engine) -> None:
    """ZeRO-3, dp 16 over 2 nodes, one microbatch, blocks long enough to hide every per-block collective.
    Per layer (embed E, head H): forward, the first gather is the root's AG(E + H) instead of AG(E) (the
    head's own was hidden under the last block); backward, the first gather is AG(H) per layer, nothing
    for torchtitan's kept root, AG(E + H) for a root that reshards (the last block's gather was hidden
    under the head's backward either way); the last reduction is RS(E + H) instead of RS(E) (the head's
    own was hidden). So the exposed data-parallel time grows by AG(E + H) - AG(E) + RS(E + H) - RS(E) +
    (0 or AG(E + H)) - AG(H)."""
    graph, cluster, config, embed, head, ag, rs = _setup()
    back_gather = ag(embed + head) if engine.fsdp_root_reshards else 0.0
    want = ag(embed + head) - ag(embed) + rs(embed + head) - rs(embed) + back_gather - ag(head)
    got = _dp(graph, cluster, config, engine) - _dp(graph, cluster, config, OFF)
    assert got == pytest.approx(want, rel=1e-9)
    assert want > 0  # the head's fp32 reduction, now last, outweighs the bf16 gather torchtitan saves


def test_the_backward_copy_out_skips_what_stays_gathered() -> None:
    """FSDP2 copies every gathered unit out of the all-gather buffer (gather_copy_out): with torchtitan's
    kept root and last block the backward copies E + H + one block fewer, 2 x 2 bytes each at the
    device's streaming rate (kernels.memory_time_s), on top of the collectives' change."""
    graph, cluster, config, embed, head, _, _ = _setup()
    block = graph.blocks[-1].num_params
    with_copy = [estimate_config(graph, cluster, config, global_batch=16,
                                 engine=dataclasses.replace(e, reduce_scatter_copy_in=False)).breakdown.dp_comm
                 for e in (TITAN, OFF)]
    rate = cluster.device.mem_bw_bytes_per_s * cluster.device.mem_bw_efficiency
    saved_copy = 2.0 * 2.0 * (embed + head + block) / rate
    collectives = _dp(graph, cluster, config, TITAN) - _dp(graph, cluster, config, OFF)
    assert with_copy[0] - with_copy[1] == pytest.approx(collectives - saved_copy, rel=1e-9)


def test_torchtitan_and_autoplan_s_executor_have_the_root_group_megatron_does_not() -> None:
    """torchtitan keeps its root and last block gathered; autoplan's executor passes reshard_after_forward=True
    to every fully_shard, root included (execute/fsdp.py _wrapper); Megatron's DDP buckets and its FSDP2
    path wraps the embedding and output layer on their own."""
    titan, own = Engine.load("torchtitan"), Engine.load("autoplan")
    assert (titan.fsdp_root_unit, titan.fsdp_root_reshards, titan.fsdp_last_block_reshards) == (True, False, False)
    assert (own.fsdp_root_unit, own.fsdp_root_reshards, own.fsdp_last_block_reshards) == (True, True, True)
    assert not any(Engine.load(name).fsdp_root_unit for name in ("megatron-core", "megatron-lm", "megatron-deepspeed"))
