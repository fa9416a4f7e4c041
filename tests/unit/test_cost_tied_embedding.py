"""The tied head's gradient all-reduce between the first and the last pipeline stage (LayerGraph.
tied_embedding_params, cost.estimate.tied_grad_reduce_s, Engine.tied_reduce_before_dp) against hand
computations: once per step, V/tp x h gradient elements in the reduce dtype over the 2-rank group, before
(DeepSpeed's ReduceTiedGrads) or after (Megatron's train_step) the data-parallel reduction; nothing when untied,
without a pipeline or with both stages on one rank; the quick estimate moves by the same seconds; capture finds
the tie."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph
from torch import nn

from autoplan import cost
from autoplan.cost import comm, estimate_config
from autoplan.cost.estimate import step_tail_s
from autoplan.cost.types import GroupPlacement
from autoplan.graph.layers import tied_embedding_params
from autoplan.graph.meta import meta_copy
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

H, S, MB, B, V = 1024, 1024, 1, 16, 8192
UNTIED = gpt_graph(h=H, a=16, layers=8, seq=S, vocab=V)
TIED = dataclasses.replace(UNTIED, tied_embedding_params=V * H)
FP16 = dataclasses.replace(a100_cluster(1), dtype="fp16")
# no DDP passes: with dp = 1 nothing else runs after the pipeline, so the step grows by the all-reduce alone
DS = every_zero_stage(dataclasses.replace(Engine.load("megatron-deepspeed"), dp_grad_passes=0))


def _step(graph, cluster, config, engine) -> float:
    return estimate_config(graph, cluster, config, global_batch=B, engine=engine).step_time_s


def test_the_step_grows_by_one_all_reduce_of_the_vocab_parallel_embedding_gradient() -> None:
    config = ParallelConfig(pp=2, tp=4, microbatch=MB)  # one node: the first and last stage share it
    pair = GroupPlacement(size=2, num_nodes=1, per_node=2)
    for cluster, elem in ((FP16, 2), (dataclasses.replace(FP16, dtype="bf16"), 4)):  # bf16: fp32 _hp_grad / main_grad
        want = comm.all_reduce_s(V * H / 4 * elem, pair, cluster)
        for before in (True, False):
            engine = dataclasses.replace(DS, tied_reduce_before_dp=before)
            grown = _step(TIED, cluster, config, engine) - _step(UNTIED, cluster, config, engine)
            assert math.isclose(grown, want, rel_tol=1e-9), (cluster.dtype, before)


def test_the_pair_crosses_nodes_when_the_pipeline_does() -> None:
    cluster = dataclasses.replace(a100_cluster(2), dtype="fp16")
    config = ParallelConfig(pp=2, tp=8, microbatch=MB)  # stage stride 8: the stages on different nodes
    want = comm.all_reduce_s(V * H / 8 * 2, GroupPlacement(size=2, num_nodes=2, per_node=1), cluster)
    assert math.isclose(_step(TIED, cluster, config, DS) - _step(UNTIED, cluster, config, DS), want, rel_tol=1e-9)


def test_before_or_after_the_data_parallel_reduction_by_hand() -> None:
    # rank 0 ends the pipeline last (offset 0) and reduces for 1 s; rank 2, the last stage, ended 4 s earlier
    # and reduces for 2 s; the tied all-reduce takes 1 s
    tails, offsets = [1.0, 0.5, 2.0], [0.0, 3.0, 4.0]
    assert step_tail_s(tails, offsets, 2, 0.0, True) == 1.0  # max(1, 0.5 - 3, 2 - 4)
    assert step_tail_s(tails, offsets, 2, 1.0, True) == 3.0  # tied from 0 to 1, then rank 2's 2 s
    assert step_tail_s(tails, offsets, 2, 1.0, False) == 2.0  # after rank 0's reduction (1 s): 1 + 1


def test_nothing_untied_without_a_pipeline_or_with_both_ends_on_rank_0() -> None:
    for config in (ParallelConfig(pp=1, tp=8, microbatch=MB),
                   ParallelConfig(pp=2, tp=4, microbatch=MB, schedule="zb", virtual_stages=2)):
        assert _step(TIED, FP16, config, DS) == _step(UNTIED, FP16, config, DS), config


def test_the_quick_estimate_moves_by_the_exact_seconds() -> None:
    space = enumerate_space(TIED, FP16, SearchOptions(global_batch=B))
    piped = np.flatnonzero(space.columns["pp"] > 1)
    rng = np.random.default_rng(1)
    rows = np.concatenate([rng.choice(piped, min(15, len(piped)), replace=False),
                           rng.choice(len(space), 8, replace=False)]).tolist()
    for engine in (every_zero_stage(Engine.load("megatron-deepspeed")), every_zero_stage(Engine.load("megatron-lm"))):
        before = quick_estimate(UNTIED, FP16, space, B, cost.with_engine(engine)).step_time_s
        after = quick_estimate(TIED, FP16, space, B, cost.with_engine(engine)).step_time_s
        for r in rows:
            config = space.config(r)
            want = _step(TIED, FP16, config, engine) - _step(UNTIED, FP16, config, engine)
            assert math.isclose(after[r] - before[r], want, rel_tol=1e-6, abs_tol=1e-12), (engine.name, config)


class _Lm(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(64, 16), nn.LayerNorm(16), nn.Linear(16, 64, bias=False)
        self.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(16, 16))})
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers["0"](self.embed(x))))


def test_capture_finds_a_head_tied_to_the_embedding() -> None:
    # capture hands its meta copy of the model (meta_copy keeps tied parameters one tensor) to the count
    for tie, want in ((True, 64 * 16), (False, 0)):
        model = _Lm(tie)
        assert tied_embedding_params(model) == tied_embedding_params(meta_copy(model, torch.bfloat16)) == want
