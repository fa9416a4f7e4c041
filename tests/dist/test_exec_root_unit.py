"""FSDP2's root group as autoplan's executor runs it (engines/autoplan.yaml fsdp_root_unit, fsdp_root_reshards;
cost/fsdpunits.py), observed on gloo ranks: the order and sizes of one step's collectives, recorded by wrapping
torch.distributed's, against the units' own parameter counts.

ZeRO-3 (dp 2, one microbatch): the root group (embedding, final norm, head) is gathered first, then each block;
the backward opens on the root's gather again (reshard_after_forward=True passed to the root too, so torch
2.13's _lazy_init keeps it resharding), then the blocks' in reverse; the root's reduce-scatter is the step's
last. ZeRO-0 (replicate): one all-reduce per unit, the root's last.
"""

from __future__ import annotations

import pytest
import torch
from harness import plan_collectives, run_ranks

from autoplan.plan.types import ParallelConfig

pytestmark = pytest.mark.dist

MODEL, SEQ = "tiny-gpt", 16


def _own_numel(module: torch.nn.Module) -> int:
    """Elements of this rank's shards (or replicas) of the parameters `module`'s FSDP unit holds itself."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    inner = {id(p) for child in module.modules() if child is not module and isinstance(child, FSDPModule)
             for p in child.parameters()}
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters()
               if id(p) not in inner)


def _observe(rank: int, world_size: int, config: ParallelConfig) -> dict:
    from autoplan.execute.train import TrainOptions, train

    step, calls = [0], []

    def record(name, args, kwargs):
        data = {"all_gather_single": lambda: args[1] if len(args) > 1 else kwargs["input_tensor"],
                "reduce_scatter_single": lambda: kwargs["input"] if "input" in kwargs else args[1],
                "all_reduce": lambda: args[0] if args else kwargs["tensor"]}[name]()
        calls.append((name, data.numel()))

    with plan_collectives(step, ("all_gather_single", "reduce_scatter_single", "all_reduce"), record):
        result = train(MODEL, config, TrainOptions(steps=2, global_batch=2, seq_len=SEQ),
                       device=torch.device("cpu"), on_step=lambda s: step.__setitem__(0, s))
    model = result.parts[0]
    return {"calls": calls, "root": _own_numel(model), "blocks": [_own_numel(b) for b in model.layers.values()]}


def test_zero3_gathers_the_root_first_again_at_the_backward_and_reduces_it_last() -> None:
    obs = run_ranks(_observe, 2, ParallelConfig(dp=2, zero=3))[0]
    root, blocks = obs["root"], obs["blocks"]
    assert root > 0 and root not in blocks  # the sizes tell the units apart
    gathers = [n for kind, n in obs["calls"] if kind == "all_gather_single"]
    reduces = [n for kind, n in obs["calls"] if kind == "reduce_scatter_single"]
    # forward: the root's shard, then each block's; backward: the root's again, then the blocks' (prefetched)
    assert gathers == [root, *blocks, root, *reversed(blocks)], obs
    # gradients: each block after its backward (reverse order), the root's after the last
    assert reduces == [2 * n for n in reversed(blocks)] + [2 * root], obs  # the input is the unsharded gradient


def test_zero0_replicates_with_the_root_all_reduced_last() -> None:
    obs = run_ranks(_observe, 2, ParallelConfig(dp=2, zero=0))[0]
    reduces = [n for kind, n in obs["calls"] if kind == "all_reduce"]
    assert reduces == [*reversed(obs["blocks"]), obs["root"]], obs
