"""An asynchronous gradient-reduction stream (Engine.grad_reduce_async) on the NIC the compute stream's own
exposed transfers use (cost.pipeline.nic_shared_reduce_s): two transfers on one link at once each get half
of it (NVIDIA/nccl issues 1094, 204), so the compute stream's transfers stretch by the stream's busy share and the
NIC carries both. Checked against hand computations (ideal links)."""

from __future__ import annotations

import dataclasses

import pytest
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph

from autoplan.cost import comm, estimate_config, estimate_layer
from autoplan.cost.dataparallel import dp_groups
from autoplan.cost.pipeline import nic_shared_reduce_s
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig


@pytest.mark.parametrize(("reduce", "compute", "nic_in", "nic_out", "shared", "stream"), [
    # nothing on the NIC beside the stream: nothing added
    (10.0, 6.0, 0.0, 0.0, 0.0, 0.0),
    # compute-bound: slot 10 + 2, the stream busy 2 / 12 of it: the 3 s of transfers meet it for 1/6, 0.5 s more
    (2.0, 10.0, 1.0, 2.0, 0.5, 0.5),
    # link-bound: the stream is always busy; before, 10 - 6 = 4 exposed. The NIC carries 10 + 2: slot
    # 6 (layers) + 1 (hops) + 5 = 12, one second more, and the stream does 2 s more
    (10.0, 6.0, 1.0, 1.0, 1.0, 2.0),
])
def test_shared_nic_by_hand(reduce, compute, nic_in, nic_out, shared, stream) -> None:
    got_shared, got_stream = nic_shared_reduce_s(reduce, compute, nic_in, nic_out)
    assert float(got_shared) == pytest.approx(shared, rel=1e-12, abs=1e-15)
    assert float(got_stream) == pytest.approx(stream, rel=1e-12, abs=1e-15)


def _cp_setup(per_node: int):
    """cp 2 x dp 2 on 4 GPUs, ZeRO-2 reduced every microbatch under megatron-core with Llama 3's
    grad_reduce_async and its exposed all-gather CP, one reduce-scatter per layer, 8 microbatches; with one
    GPU per node both the cp and the data-parallel groups cross nodes, with 4 neither does."""
    graph = gpt_graph(h=1024, a=16, kv=4, layers=2, seq=4096, vocab=4096, unfused=False)
    cluster = a100_cluster(4 // per_node, per_node=per_node, nic_bw=200e9, ideal=True)
    config = ParallelConfig(cp=2, dp=2, zero=2)
    engine = dataclasses.replace(Engine.load("megatron-core"), grad_reduce_async=True, dp_bucket_numel=0,
                                 cp_comm_overlap=False)
    return graph, cluster, config, engine


def test_a_cp_exchange_across_nodes_shares_the_nic_with_the_reductions(monkeypatch) -> None:
    """pp 1, compute-bound: each of the 8 microbatches' slots grows by the stream's busy share u = R / C of
    the CP exchange X (both across nodes), R the layers' fp32 reduce-scatters and C their time; the step by
    8 u X, the data-parallel part of the breakdown carrying it. Inside a node nothing is shared."""
    import autoplan.cost.dataparallel as dp

    graph, cluster, config, engine = _cp_setup(per_node=1)
    costs = [estimate_layer(layer, cluster, config, "none", seq_len=graph.seq_len, engine=engine)
             for layer in graph.layers]
    group = dp_groups(config, cluster).dense
    reduce = sum(comm.reduce_scatter_s(c.grad_param_count * 4.0, group, cluster) for c in costs)
    compute = sum(c.time_s for c in costs)
    x = sum(c.cp_comm_s for c in costs)
    assert x > 0 and reduce < compute
    est = estimate_config(graph, cluster, config, global_batch=16, engine=engine)
    with monkeypatch.context() as patch:
        patch.setattr(dp, "nic_shared_reduce_s", lambda *a: (0.0, 0.0))
        alone = estimate_config(graph, cluster, config, global_batch=16, engine=engine)
    assert est.step_time_s - alone.step_time_s == pytest.approx(8 * reduce / compute * x, rel=1e-9)
    assert est.breakdown.dp_comm - alone.breakdown.dp_comm == pytest.approx(8 * reduce / compute * x, rel=1e-9)
    graph, cluster, config, engine = _cp_setup(per_node=4)
    with monkeypatch.context() as patch:
        patch.setattr(dp, "nic_shared_reduce_s", lambda *a: (0.0, 0.0))
        alone = estimate_config(graph, cluster, config, global_batch=16, engine=engine)
    assert estimate_config(graph, cluster, config, global_batch=16, engine=engine).step_time_s == alone.step_time_s


def test_the_quick_estimate_shares_the_nic_as_the_exact_model(monkeypatch) -> None:
    """The quick estimate (search/pipeline_terms.nic_shared) adds what the exact model adds for the NIC it
    shares, for every candidate of the space (cp 2 across nodes among them): the step with the mechanism less
    the step without it, both ways alike (the quick estimate's other approximations cancel)."""
    import autoplan.cost.dataparallel as dp
    import autoplan.search.pipeline_terms as terms
    from autoplan import cost
    from autoplan.search.space import SearchOptions, enumerate_space
    from autoplan.search.surrogate import quick_estimate

    graph, cluster, config, engine = _cp_setup(per_node=1)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=16, zero=(2,), microbatch=(1,)))
    rows = list(range(len(space)))
    assert any(space.config(r) == config for r in rows)
    eng = cost.with_engine(every_zero_stage(engine))

    def steps():
        exact = [eng.estimate_config(graph, cluster, space.config(r), global_batch=16).step_time_s for r in rows]
        return quick_estimate(graph, cluster, space, 16, eng).step_time_s[rows], exact

    quick, exact = steps()
    with monkeypatch.context() as patch:
        for module in (dp, terms):
            patch.setattr(module, "nic_shared_reduce_s", lambda *a: (0.0, 0.0))
        quick_alone, exact_alone = steps()
    added = [e - a for e, a in zip(exact, exact_alone)]
    assert max(added) > 0
    assert list(quick - quick_alone) == pytest.approx(added, rel=1e-9, abs=1e-15)
