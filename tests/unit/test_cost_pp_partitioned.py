"""DeepSpeed's PartitionedTensor pipeline transfers with tp > 1 (Engine.pp_partitioned_tensors) against a hand
computation from DeepSpeed v0.10.0 deepspeed/runtime/pipe/engine.py and utils.py PartitionedTensor, per cut
and microbatch, A the whole activation and c = A / tp the chunk each tp rank sends (bytes read + written):
the sender clones its chunk and copies the meta to the device (2c, 1 sync) in forward; the receiver clones
twice, reads the meta back, zero-fills A, copies its chunk in, all-gathers into a list and clones the result
(6c + 5A, 1 gather, 1 sync); in backward the sender re-assembles its output and the gradient (2 x (2c + 5A,
1 gather, 1 sync)) and the receiver partitions the gradient (2c, 1 sync); each transfer sends the meta tensor
first. Nothing without tp, with SP or without a pipeline; the quick estimate moves by the same seconds."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph

from autoplan import cost
from autoplan.cost import comm, estimate_config
from autoplan.cost.compute import H2D_SYNC_COPY_S
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

H, S, MB, B = 1024, 1024, 1, 16
GRAPH = gpt_graph(h=H, a=16, layers=8, seq=S, vocab=32768)  # a large head: the last rank is the slowest
CLUSTER = dataclasses.replace(a100_cluster(1), dtype="fp16")
ON = every_zero_stage(dataclasses.replace(Engine.load("megatron-deepspeed"), pp_p2p_batched=True,
                                           pp_partitioned_tensors=True))
OFF = dataclasses.replace(ON, pp_partitioned_tensors=False)


def _step(engine: Engine, config: ParallelConfig) -> float:
    return estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=engine).step_time_s


def test_each_cut_costs_the_passes_gathers_syncs_and_meta_sends_of_deepspeeds_code() -> None:
    tp = 4
    config = ParallelConfig(pp=2, tp=tp, microbatch=MB)
    m = B // MB
    whole = MB * S * H * 2
    chunk = whole / tp
    dev = CLUSTER.device
    mem = lambda n: n / (dev.mem_bw_bytes_per_s * dev.mem_bw_efficiency)
    gather = comm.all_gather_s(whole, comm.group_placement(config, ("tp",), CLUSTER.devices_per_node), CLUSTER)
    sync = H2D_SYNC_COPY_S + dev.op_overhead_s
    meta = comm.p2p_s(8 * (1 + 3 + 2 + tp + 1), False, CLUSTER)  # [ndims, s, b, h, parts, rank, tp + 1 offsets]
    sender = mem(2 * chunk) + sync + 2 * (mem(2 * chunk + 5 * whole) + gather + sync) + meta
    receiver = mem(6 * chunk + 5 * whole) + gather + sync + mem(2 * chunk) + sync + meta
    # 1F1B on two ranks: m slots of the slower (the last, with the head) plus one of the other
    assert math.isclose(_step(ON, config) - _step(OFF, config), m * receiver + sender, rel_tol=1e-9)


def test_nothing_without_tp_with_sp_or_without_a_pipeline() -> None:
    for config in (ParallelConfig(pp=2, dp=4, microbatch=MB), ParallelConfig(pp=2, tp=4, sp=True, microbatch=MB),
                   ParallelConfig(pp=1, tp=8, microbatch=MB)):
        assert _step(ON, config) == _step(OFF, config), config


def test_the_quick_estimate_moves_by_the_exact_seconds() -> None:
    space = enumerate_space(GRAPH, CLUSTER, SearchOptions(global_batch=B))
    cols = space.columns
    piped = np.flatnonzero((cols["pp"] > 1) & (cols["tp"] > 1))
    rng = np.random.default_rng(2)
    rows = np.concatenate([rng.choice(piped, min(25, len(piped)), replace=False),
                           rng.choice(len(space), 10, replace=False)]).tolist()
    for batched in (True, False):
        on, off = (dataclasses.replace(e, pp_p2p_batched=batched) for e in (ON, OFF))
        before = quick_estimate(GRAPH, CLUSTER, space, B, cost.with_engine(off)).step_time_s
        after = quick_estimate(GRAPH, CLUSTER, space, B, cost.with_engine(on)).step_time_s
        for r in rows:
            config = space.config(r)
            want = _step(on, config) - _step(off, config)
            assert math.isclose(after[r] - before[r], want, rel_tol=1e-6, abs_tol=1e-12), (batched, config)


def test_only_deepspeeds_pipeline_engine_partitions() -> None:
    assert not Engine().pp_partitioned_tensors
    for name in Engine.names():
        assert Engine.load(name).pp_partitioned_tensors == (name in ("megatron-deepspeed", "deepspeed",
                                                                      "deepspeed-2024"))
