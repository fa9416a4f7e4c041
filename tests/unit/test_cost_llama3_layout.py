"""Llama 3 405B's layout (Dubey et al. 2024, section 3.3.2) through the mechanisms it needs: stages that hold
only the embedding or only the head, an all-gather CP exchange on the critical path, and ZeRO-2's gradient
buffers; each against a hand computation on an ideal device (efficiencies 1, no latency)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph

from autoplan.cost import comm, estimate_config, estimate_layer
from autoplan.cost.types import GroupPlacement
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

IDEAL = a100_cluster(ideal=True)


# --- stages holding only the embedding or only the head ------------------------------------------------

def test_explicit_stages_may_outnumber_the_blocks() -> None:
    """pp 2 x v 2 = 4 stages on 2 blocks: the default split refuses, a split with the embedding and the
    head alone runs, and the model's other rules (tp divides the heads) still apply."""
    graph = gpt_graph(h=256, a=8, layers=2, seq=128, unfused=False)
    config = ParallelConfig(pp=2, dp=4, virtual_stages=2, schedule="interleaved")
    with pytest.raises(ValueError, match="4 pipeline stages but the model has 2 blocks"):
        estimate_config(graph, IDEAL, config, global_batch=8)
    stages = (("embed",), ("layers.0",), ("layers.1",), ("head",))
    est = estimate_config(graph, IDEAL, config, global_batch=8, stages=stages)
    # rank 0 runs stages 0 and 2 (embedding, block 1), rank 1 stages 1 and 3 (block 0, head): the peak
    # rank's 16-bit weights are one block and one end, not two blocks
    embed, block, head = (graph.layers[0].num_params, graph.layers[1].num_params, graph.layers[-1].num_params)
    assert est.memory.weights in (2 * (embed + block), 2 * (block + head))
    # the pipeline part of the step is at least m slots of the slowest rank (rank 1: block 0 and the head,
    # each layer's time_s by hand from estimate_layer) and at most m + p - 1 of them plus the hops
    layer = {n: estimate_layer(lay, IDEAL, config, config.recompute, seq_len=graph.seq_len,
                               graph_microbatch=graph.microbatch) for lay in graph.layers for n in (lay.name,)}
    slots = [layer["embed"].time_s + layer["layers.1"].time_s, layer["layers.0"].time_s + layer["head"].time_s]
    m, b = 8 // 4, est.breakdown
    pipeline = b.compute + b.recompute + b.pp_bubble + b.pp_comm
    assert slots[1] > 10 * slots[0] and m * slots[1] <= pipeline <= (m + 1) * slots[1] + b.pp_comm
    six = a100_cluster(per_node=6, ideal=True)
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        estimate_config(graph, six, dataclasses.replace(config, tp=3, dp=1), global_batch=2, stages=stages)
    with pytest.raises(ValueError, match="every pipeline stage needs at least one layer"):
        estimate_config(graph, IDEAL, config, global_batch=8, stages=(("embed", "layers.0"), ("layers.1",),
                                                                       ("head",), ()))


# --- context parallelism: all-gather before the core, or a ring beside it ------------------------------

@pytest.mark.parametrize(("keeps", "separate"), [(True, False), (False, False), (True, True), (False, True)])
def test_an_all_gather_cp_exchange_is_exposed_in_full(keeps: bool, separate: bool) -> None:
    """cp 2, kv heads g: the K / V of the whole sequence for the tp rank's kv heads are 2 s h g / a
    elements. Without cp_comm_overlap (Llama 3: "the all-gather communication latency is exposed in the
    critical path") forward pays the all-gather, backward the reduce-scatter of dK / dV and, unless the
    gathered K / V were kept, a second all-gather; selective recompute re-gathers them once more when not
    kept. With cp_separate_kv_collectives each exchange is two collectives of half the bytes (K, then V:
    TE's AttnFuncWithCPAndKVAllGather, autoplan's ContextParallelCore). The ring (cp_comm_overlap) hides
    them behind the attention core: never more."""
    h, a, g, s, cp = 1024, 16, 4, 8192, 2
    block = gpt_graph(h=h, a=a, kv=g, layers=1, seq=s, unfused=False).blocks[0]
    config = ParallelConfig(cp=cp, dp=4)
    engine = dataclasses.replace(Engine(), cp_comm_overlap=False, cp_saves_gathered_kv=keeps,
                                 cp_separate_kv_collectives=separate)
    group = GroupPlacement(size=cp, num_nodes=1, per_node=cp)
    kv_bytes = 2.0 * s * h * g / a * 2
    pieces = 2 if separate else 1
    gather = pieces * comm.all_gather_s(kv_bytes / pieces, group, IDEAL)
    scatter = pieces * comm.reduce_scatter_s(kv_bytes / pieces, group, IDEAL)
    hand = gather + scatter + (0.0 if keeps else gather)
    exposed = estimate_layer(block, IDEAL, config, "none", seq_len=s, engine=engine)
    assert math.isclose(exposed.cp_comm_s, hand, rel_tol=1e-9)
    selective = estimate_layer(block, IDEAL, config, "selective", seq_len=s, engine=engine)
    assert math.isclose(selective.cp_comm_s, hand + (0.0 if keeps else gather), rel_tol=1e-9)
    ring = estimate_layer(block, IDEAL, config, "none", seq_len=s,
                          engine=dataclasses.replace(engine, cp_comm_overlap=True))
    assert 0.0 <= ring.cp_comm_s < exposed.cp_comm_s
    assert exposed.time_s - ring.time_s == pytest.approx(exposed.cp_comm_s - ring.cp_comm_s, rel=1e-9)


def test_megatron_core_rings_and_autoplan_all_gathers() -> None:
    assert Engine.load("megatron-core").cp_comm_overlap and not Engine.load("autoplan").cp_comm_overlap


def test_separate_kv_collectives_pay_one_more_latency_each_exchange() -> None:
    """On a real link (latency > 0) two all-gathers of S / 2 cost one collective's latency more than one of
    S: by hand, on the test cluster's one-protocol (alpha-beta) link, (n - 1) ring steps at its latency; the
    bandwidth term is the same. An exposed exchange without kept K / V and no recompute runs 3 of them."""
    cluster = a100_cluster()
    h, a, g, s, cp = 1024, 16, 4, 8192, 2
    block = gpt_graph(h=h, a=a, kv=g, layers=1, seq=s, unfused=False).blocks[0]
    config = ParallelConfig(cp=cp, dp=4)
    base = dataclasses.replace(Engine(), cp_comm_overlap=False, cp_saves_gathered_kv=False)
    one = estimate_layer(block, cluster, config, "none", seq_len=s,
                         engine=dataclasses.replace(base, cp_separate_kv_collectives=False)).cp_comm_s
    two = estimate_layer(block, cluster, config, "none", seq_len=s, engine=base).cp_comm_s
    group = comm.group_placement(config, ("cp",), cluster.devices_per_node)
    kv_bytes = 2.0 * s * h * g / a * 2
    extra = 2 * comm.all_gather_s(kv_bytes / 2, group, cluster) - comm.all_gather_s(kv_bytes, group, cluster)
    link = cluster.intra_node
    assert extra > 0.0
    assert two - one == pytest.approx(3 * extra, rel=1e-9)
    assert extra == pytest.approx((cp - 1) * link.latency_s, rel=1e-9)


# --- ZeRO-2: sharded gradients, plus the buffers of the layer being reduced ------------------------------

def test_zero2_holds_the_largest_layers_unsharded_and_reduce_scatter_gradients() -> None:
    """dp 8, ZeRO-2 reduced every microbatch: gradients at rest are the 1/8 shard (2 bytes each on
    autoplan's executor), and the layer being reduced first holds its unsharded gradients (2 bytes) and
    their fp32 reduce-scatter input (4 bytes: grad_reduce_fp32), for the largest layer (the embedding)."""
    graph = gpt_graph(h=512, a=8, layers=2, seq=256, unfused=False)
    params = sum(layer.num_params for layer in graph.layers)
    largest = max(layer.num_params for layer in graph.layers)
    zero2 = estimate_config(graph, IDEAL, ParallelConfig(dp=8, zero=2), global_batch=8)
    zero1 = estimate_config(graph, IDEAL, ParallelConfig(dp=8, zero=1), global_batch=8)
    assert zero1.memory.gradients == pytest.approx(2.0 * params, abs=8)
    assert zero2.memory.gradients == pytest.approx(2.0 * params / 8 + largest * (2 + 4), abs=8)
    assert zero2.memory.weights == zero1.memory.weights


def test_the_quick_estimate_counts_zero2_reduce_buffers_as_the_exact_model() -> None:
    """ZeRO-2 candidates with dp > 1 (megatron-core: reduced every microbatch, also with pp > 1): the quick
    peak memory, which mirrors cost.memory.zero2_reduce_bytes, is the exact one to 0.5 %."""
    import numpy as np

    from autoplan import cost
    from autoplan.search.space import SearchOptions, enumerate_space
    from autoplan.search.surrogate import quick_estimate

    graph = gpt_graph(h=512, a=8, layers=4, seq=256, vocab=4096, unfused=False)
    cluster = a100_cluster(2, per_node=4)
    eng = cost.with_engine(every_zero_stage(Engine.load("megatron-core")))
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=16, zero=(2,)))
    quick = quick_estimate(graph, cluster, space, 16, eng)
    rows = [r for r in range(len(space)) if space.config(r).dp > 1][:40]
    assert rows
    exact = np.array([eng.estimate_config(graph, cluster, space.config(r), global_batch=16).peak_mem_bytes
                      for r in rows])
    assert np.abs(exact / quick.peak_mem_bytes[rows] - 1).max() < 0.005
