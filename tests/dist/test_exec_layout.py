"""The layout that was priced is the one that runs (issue 9), observed on gloo ranks:

- for every schedule, the PipelineStages each rank builds (stage_index, the blocks of its module) are
  plan.layout.rank_stages / default_stages, and the split the cost model priced (cost.balanced_stages on
  the captured graph), on a 7-block model so that the split is uneven;
- for every ZeRO stage at pp=1 and pp=2, what FSDP2 actually does in a step (the gradient reductions and
  weight all-gathers, counted by wrapping torch.distributed's collectives; whether a unit's weights and
  gradients are full when a later microbatch's forward starts; the DTensor placements of parameters,
  gradients and Adam states at the optimizer step) is what plan.layout.zero_layout says.
"""

from __future__ import annotations

import collections
import importlib
from dataclasses import replace

import pytest
import torch
from harness import plan_collectives, run_ranks

from autoplan.models import PRESETS
from autoplan.plan.layout import default_stages, rank_stages, zero_layout
from autoplan.plan.types import ParallelConfig

pytestmark = pytest.mark.dist

MODEL = "tiny-gpt-7"  # tiny-gpt with 7 blocks: every schedule's default split is uneven
SEQ = 16


@pytest.fixture(autouse=True)
def _seven_block_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    # the ranks are forked from this process, so they see the added preset
    monkeypatch.setitem(PRESETS, MODEL, replace(PRESETS["tiny-gpt"], name=MODEL, num_layers=7))


def _options(global_batch: int, steps: int = 1):
    from autoplan.execute.train import TrainOptions

    return TrainOptions(steps=steps, global_batch=global_batch, seq_len=SEQ)


# --- pipeline placement -----------------------------------------------------------------------------

def _built_stages(rank: int, world_size: int, config: ParallelConfig) -> list[tuple[int, int, tuple[str, ...]]]:
    from autoplan.execute.train import _setup

    job = _setup(MODEL, config, _options(8), torch.device("cpu"))
    stages = getattr(job.schedule, "_stages", None) or [job.schedule._stage]
    out = []
    for stage in stages:
        part = stage.submod
        names = (["embed"] if part.embed is not None else []) + [f"layers.{n}" for n in part.layers]
        names += ["norm", "head"] if part.head is not None else []
        out.append((stage.stage_index, stage.num_stages, tuple(names)))
    return out


def _priced_blocks(rank: int, world_size: int, config: ParallelConfig) -> list[tuple[str, ...]]:
    from autoplan.cost import balanced_stages
    from autoplan.graph.capture import capture
    from autoplan.models import preset

    with torch.device("meta"):
        graph = capture(preset(MODEL), seq_len=SEQ, microbatch=1, model_name=MODEL)
    return [tuple(n for n in stage if n.startswith("layers.")) for stage in balanced_stages(graph, config)]


@pytest.mark.parametrize("schedule,virtual_stages", [
    ("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zb", 2),
], ids=["gpipe", "1f1b", "interleaved-v2", "zb-looped", "zb-v"])
def test_each_rank_builds_the_stages_that_were_priced(schedule: str, virtual_stages: int) -> None:
    config = ParallelConfig(pp=2, schedule=schedule, virtual_stages=virtual_stages, microbatch=2)
    built = run_ranks(_built_stages, 2, config)
    priced = run_ranks(_priced_blocks, 1, config)[0]
    names = ["embed", *(f"layers.{i}" for i in range(7)), "norm", "head"]
    split = default_stages(names, [n.startswith("layers.") for n in names], config)
    held = {}
    for pp_rank, stages in enumerate(built):
        assert [s[0] for s in stages] == list(rank_stages(config, pp_rank))
        assert all(s[1] == 2 * virtual_stages for s in stages)
        held.update({index: blocks for index, _, blocks in stages})
    assert [held[i] for i in range(2 * virtual_stages)] == list(split)
    assert [tuple(n for n in held[i] if n.startswith("layers.")) for i in range(2 * virtual_stages)] == priced
    # independent of layout.py: the V puts the last stage back on rank 0, the looped schedules on rank 1
    last_rank = 0 if (schedule, virtual_stages) == ("zb", 2) else 1
    assert 2 * virtual_stages - 1 in [s[0] for s in built[last_rank]]


# --- ZeRO ---------------------------------------------------------------------------------------------

def _describe(tensor: torch.Tensor | None) -> str:
    """'none', 'full' (a plain tensor or a replicated DTensor) or 'shard'."""
    from torch.distributed.tensor import DTensor, Shard

    if tensor is None:
        return "none"
    if isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements):
        return "shard"
    return "full"


def _fsdp_units(parts: list[torch.nn.Module]) -> int:
    """FSDP units holding parameters of their own (not their FSDP children's)."""
    from torch.distributed.fsdp import FSDPModule

    units = 0
    for part in parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            inner = {id(p) for child in module.modules() if child is not module and isinstance(child, FSDPModule)
                     for p in child.parameters()}
            units += any(id(p) not in inner for p in module.parameters())
    return units


def _observe_zero(rank: int, world_size: int, config: ParallelConfig, global_batch: int) -> dict:
    """Train 2 steps; observe step 1 (step 0 of a pipeline also runs torch's shape inference)."""
    from torch.distributed.fsdp import FSDPModule

    from autoplan.execute.train import train
    from autoplan.models.transformer import Block

    step = [0]
    calls: collections.Counter = collections.Counter()

    forwards: list[tuple[str, str]] = []
    first_block: list[torch.nn.Module] = []

    def before_forward(module, args):  # global hooks run before FSDP's own pre-forward (the all-gather)
        if isinstance(module, Block) and isinstance(module, FSDPModule):
            if not first_block:
                first_block.append(module)
            if step[0] == 1 and module is first_block[0]:
                weight = module.attn.wq.weight
                forwards.append((_describe(weight), _describe(weight.grad)))

    at_step: dict = {}

    def after_optimizer_step(optimizer, args, kwargs):
        if step[0] == 1:
            param = optimizer.param_groups[0]["params"][0]
            at_step.update(param=_describe(param), grad=_describe(param.grad),
                           states=sorted({_describe(v) for v in optimizer.state[param].values() if v.ndim}))

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(before_forward),
             importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook(after_optimizer_step)]
    try:
        with plan_collectives(step, ("all_gather_single", "reduce_scatter_single", "all_reduce"),
                              lambda name, args, kwargs: calls.update([name])):
            result = train(MODEL, config, _options(global_batch, steps=2), device=torch.device("cpu"),
                           on_step=lambda s: step.__setitem__(0, s))
    finally:
        for hook in hooks:
            hook.remove()
    return {"calls": dict(calls), "forwards": forwards, "at_step": at_step, "units": _fsdp_units(result.parts)}


@pytest.mark.parametrize("pp", [1, 2], ids=["pp1", "pp2"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_executor_runs_zero_as_zero_layout_says(zero: int, pp: int) -> None:
    m = 3  # microbatches per step: 6 sequences over dp 2, microbatch 1
    config = ParallelConfig(pp=pp, dp=2, zero=zero, schedule="1f1b")  # 1F1B: a forward follows a backward
    layout = zero_layout(config, m)
    for obs in run_ranks(_observe_zero, 2 * pp, config, 2 * m):
        units = obs["units"]
        assert units >= 2, obs
        reduce_name = "reduce_scatter_single" if layout.grad_reduction == "reduce_scatter" else "all_reduce"
        gathers = units * (layout.weight_gathers_per_microbatch * m + layout.weight_gathers_per_step)
        expected = {reduce_name: units * (m if layout.reduce_every_microbatch else 1)}
        expected.update({"all_gather_single": gathers} if gathers else {})
        assert obs["calls"] == expected, (layout, obs)
        later = obs["forwards"][1:]  # when a later microbatch's forward starts, before FSDP gathers
        assert len(later) == m - 1
        assert any(w == "full" for w, _ in later) is not layout.shards_weights, (layout, obs)
        assert any(g == "full" for _, g in later) is not layout.shards_gradients, (layout, obs)
        sharded = "shard" if layout.shards_optimizer else "full"
        assert obs["at_step"] == {"param": sharded, "grad": sharded, "states": [sharded]}, (layout, obs)
