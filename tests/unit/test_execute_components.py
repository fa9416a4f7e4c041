"""The component executor's pure parts, in one process: the row hand-off between groups against a brute
force ownership map, the stage programs against the models' own forward, and the plans it refuses."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from autoplan.execute.component_models import program_for
from autoplan.execute.components import Layout, check_executable, transfers
from autoplan.models.multimodal import SensorPolicy, tiny_llava
from autoplan.plan.components import ComponentGroup, ComponentPlan
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan


@pytest.mark.parametrize("src,dst", [((2, 1), (1, 2)), ((1, 2), (2, 2)), ((4, 1), (2, 3)), ((2, 2), (4, 1))])
def test_transfers_deliver_each_row_once_per_receiver(src: tuple[int, int], dst: tuple[int, int]) -> None:
    rows = 12
    a, b = Layout(0, *src), Layout(src[0] * src[1], *dst)
    # brute force: global row r lives on src replica r // (rows / dp_src) and is needed by every tp
    # rank of dst replica r // (rows / dp_dst)
    got: dict[int, list[int]] = {r: [] for r in b.ranks}
    for sender, receiver, first, at, n in transfers(a, b, rows):
        replica, tp_rank = a.coords(sender)
        assert tp_rank == 0  # tp rank 0 of a replica sends
        got[receiver] += [(replica * (rows // a.dp) + first + i, at + i) for i in range(n)]
    for receiver, pieces in got.items():
        replica, _ = b.coords(receiver)
        share = rows // b.dp
        assert sorted(pieces) == [(replica * share + i, i) for i in range(share)]
    # gradients go back from tp rank 0 of the receiving replica to every tp rank of the sender replica
    back = transfers(a, b, rows, gradients=True)
    assert sum(n for *_, n in back) == rows * a.tp
    assert all(b.coords(sender)[1] == 0 for sender, *_ in back)


def _run_stages(program, batch):
    values = {}
    for stage in program.stages:
        values[stage.name] = stage.module(*[batch[f] for f in stage.fields], *[values[n] for n in stage.needs])
    return values[program.stages[-1].name]


def test_llava_stages_reproduce_the_model_forward() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_llava()
    program = program_for(model, 24)
    batch = program.make_batch(0, 0, 3)
    assert batch["input_ids"].shape == (3, 24) and (batch["labels"] == -100).sum() == 3 * 15
    expected = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits
    torch.testing.assert_close(_run_stages(program, batch), expected, rtol=0, atol=0)
    names = {s.original_name(n) for s in program.stages for n, _ in s.module.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def test_policy_stages_reproduce_the_model_forward() -> None:
    torch.manual_seed(0)
    model = SensorPolicy()
    program = program_for(model, 0)
    batch = program.make_batch(0, 0, 3)
    torch.testing.assert_close(_run_stages(program, batch), model(batch["images"], batch["state"]), rtol=0, atol=0)


def _plan(config: ParallelConfig) -> ComponentPlan:
    est = Estimate(step_time_s=1.0, tokens_per_s=1.0, mfu=0.1, peak_mem_bytes=1, mem_capacity_bytes=2, fits=True,
                   breakdown=Breakdown())
    one = Plan(config=ParallelConfig(), estimate=est, model_name="m", cluster_name="c", num_devices=1,
               global_batch=8, seq_len=24)
    other = dataclasses.replace(one, config=config, num_devices=config.num_devices)
    groups = (ComponentGroup(components=("a",), first_rank=0, num_devices=1, plan=one),
              ComponentGroup(components=("b",), first_rank=1, num_devices=config.num_devices, plan=other))
    return ComponentPlan(model_name="m", cluster_name="c", num_devices=1 + config.num_devices, global_batch=8,
                         seq_len=24, num_microbatches=2, groups=groups, edges=(), estimate=est)


@pytest.mark.parametrize("config,message", [
    (ParallelConfig(pp=2), "pp=2"), (ParallelConfig(cp=2), "cp=2"), (ParallelConfig(tp=2, sp=True), "sp=True"),
    (ParallelConfig(recompute="selective"), "recompute=selective"), (ParallelConfig(dp=8), "do not split"),
])
def test_unsupported_group_strategies_are_refused(config: ParallelConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_executable(_plan(config))


def test_supported_strategies_pass() -> None:
    for tp, dp, zero in itertools.product((1, 2), (1, 2), (0, 3)):
        check_executable(_plan(ParallelConfig(tp=tp, dp=dp, zero=zero, recompute="full")))
