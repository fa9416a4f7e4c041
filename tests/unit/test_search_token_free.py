"""Models without tokens are searched over what the executor runs for them (search.space.token_free_restriction):
a ResNet (blocks that are not transformer blocks) over dp / ZeRO, pp over its blocks, full recompute and the
microbatch; a ViT (transformer blocks) also over tp and selective recompute, never cp or sp; token models as
before. The reason is a note of every plan."""

from __future__ import annotations

import functools

import pytest
import torch

import autoplan
from autoplan.graph.capture import capture
from autoplan.models import preset
from autoplan.models.vision import resnet_tiny, vit_tiny
from autoplan.plan.types import Recompute
from autoplan.search.space import RECOMPUTES, SearchOptions, enumerate_space, token_free_restriction

CLUSTER = autoplan.Cluster.load("local-cpu", num_nodes=1, devices_per_node=8)


@functools.cache
def graph(name: str):
    factory = {"resnet": resnet_tiny, "vit": vit_tiny}[name]
    with torch.device("meta"):
        return capture(factory(), seq_len=64, microbatch=1)


def _values(space, column: str) -> set[int]:
    return {int(v) for v in space.columns[column]}


def test_a_resnet_is_searched_without_tp_cp_sp_or_selective_recompute() -> None:
    space = enumerate_space(graph("resnet"), CLUSTER, SearchOptions(global_batch=32))
    assert _values(space, "tp") == _values(space, "cp") == _values(space, "ep") == {1}
    assert _values(space, "sp") == {0}
    assert {RECOMPUTES[i] for i in _values(space, "recompute")} == {Recompute.NONE, Recompute.FULL}
    assert _values(space, "pp") == {1, 2, 4} and 3 in _values(space, "zero")  # pipelines over 4 blocks; ZeRO


def test_a_vit_keeps_tp_and_selective_recompute_but_no_sequence_split() -> None:
    space = enumerate_space(graph("vit"), CLUSTER, SearchOptions(global_batch=32))
    assert {1, 2, 4} <= _values(space, "tp") and _values(space, "cp") == {1} and _values(space, "sp") == {0}
    assert Recompute.SELECTIVE in {RECOMPUTES[i] for i in _values(space, "recompute")}


def test_the_plans_say_why() -> None:
    plans = autoplan.autoplan(graph("resnet"), CLUSTER, global_batch=32, seq_len=64, top_k=2, use_ilp=False)
    note = plans[0].notes[-1]
    assert "takes inputs of shape (3, 8, 8), not tokens" in note and "full recompute" in note
    assert all(p.config.tp == 1 and p.config.cp == 1 for p in plans)


def test_a_fixed_degree_the_executor_cannot_run_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"tp=\[2\]: .* its blocks are not transformer blocks: it runs with tp in \[1\]"):
        token_free_restriction(graph("resnet"), SearchOptions(global_batch=32, tp=2))
    with pytest.raises(ValueError, match=r"cp=\[2\]: .* not tokens: it runs with cp in \[1\]"):
        token_free_restriction(graph("vit"), SearchOptions(global_batch=32, cp=2))
    options, _ = token_free_restriction(graph("vit"), SearchOptions(global_batch=32, tp=(1, 2), sp=(False, True)))
    assert (options.tp, options.sp) == ((1, 2), (False,))


def test_token_models_are_searched_as_before() -> None:
    with torch.device("meta"):
        g = capture(preset("tiny-gpt"), seq_len=16, microbatch=1)
    options = SearchOptions(global_batch=8)
    assert token_free_restriction(g, options) == (options, "")
