"""Run a ComponentPlan: each device group trains its components with its own strategy, and activations and
their gradients travel between the groups with torch.distributed point-to-point sends.

Per group: a DeviceMesh ("dp", "tp") over its ranks (every rank builds every group's mesh, in group
order, since creating process groups is collective); then, in this fixed order, tensor parallelism of
the repeated blocks (Megatron column / row split of the attention and MLP projections, by their names
in transformers' CLIP and Llama layers), full activation recompute (checkpoint_wrapper per block), data
parallelism (execute.fsdp's FSDP2 / replicate per block, then each stage root). Embeddings, norms,
projector and heads stay replicated inside a tp group.

Schedule (GPipe across groups, as search/components.py prices it): a step's global batch is cut into
M hand-off microbatches; a group that feeds others runs every forward, sending each output as soon as
it is computed (isend), then every backward as gradients return; the group with the loss runs each
microbatch's forward and backward at once and returns the input gradients. Group data-parallel replica
j holds rows j of each microbatch; every tp rank of a receiving replica gets a copy from tp rank 0 of
the sending replicas. Gradients: the loss is each final replica's mean, so a received gradient is
dp_dst x dL/dx; it is scaled by dp_src / dp_dst before the sending group's own data-parallel average.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from autoplan.execute.component_models import Program, Stage, program_for
from autoplan.execute.fsdp import prepare_microbatch, wrap_blocks
from autoplan.plan.components import EXECUTOR_GROUP_OPTIONS, ComponentPlan, group_config_errors
from autoplan.plan.layout import ZeroLayout, zero_layout
from autoplan.plan.types import Recompute

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "wq", "wk", "wv", "w1", "w3")
ROWWISE = ("o_proj", "out_proj", "down_proj", "fc2", "wo", "w2")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True, slots=True)
class Layout:
    """A group's ranks as a (dp, tp) grid, tp innermost."""

    first_rank: int
    dp: int
    tp: int

    def rank(self, replica: int, tp_rank: int) -> int:
        return self.first_rank + replica * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        return divmod(rank - self.first_rank, self.tp)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.dp * self.tp)


def transfers(src: Layout, dst: Layout, rows: int, *, gradients: bool = False) -> list[tuple[int, int, int, int, int]]:
    """(sender, receiver, sender's first row, receiver's first row, rows) of one microbatch of `rows`
    samples split over each group's replicas. Activations: tp rank 0 of each src replica sends to every
    tp rank of the dst replicas whose rows overlap; gradients (gradients=True) go back from tp rank 0 of
    the dst replica to every tp rank of the src replica."""
    src_rows, dst_rows = rows // src.dp, rows // dst.dp
    out = []
    for jd in range(dst.dp):
        for js in range(src.dp):
            lo, hi = max(jd * dst_rows, js * src_rows), min((jd + 1) * dst_rows, (js + 1) * src_rows)
            if lo >= hi:
                continue
            if gradients:
                out += [(dst.rank(jd, 0), src.rank(js, t), lo - jd * dst_rows, lo - js * src_rows, hi - lo)
                        for t in range(src.tp)]
            else:
                out += [(src.rank(js, 0), dst.rank(jd, t), lo - js * src_rows, lo - jd * dst_rows, hi - lo)
                        for t in range(dst.tp)]
    return out


def check_executable(plan: ComponentPlan) -> None:
    """What this executor runs: dp x tp groups (pp, cp, ep = 1, no sequence parallelism), recompute none
    or full for the whole group; one line naming the group otherwise."""
    for i, group in enumerate(plan.groups):
        c = group.plan.config
        unsupported = group_config_errors(c, per_layer_recompute=bool(group.plan.layer_recompute))
        if unsupported:
            raise ValueError(f"group {i} ({group.name}) uses {', '.join(unsupported)}: the component executor runs "
                             f"dp x tp groups with recompute none or full; plan with "
                             f"{', '.join(f'{k}={v}' for k, v in EXECUTOR_GROUP_OPTIONS.items())}")
        if plan.microbatch_samples % c.dp:
            raise ValueError(f"group {i} ({group.name}): {plan.microbatch_samples} samples per microbatch do not "
                             f"split over dp={c.dp}")


@dataclass
class _Group:
    index: int
    layout: Layout
    stages: list[Stage]
    mesh: DeviceMesh | None = None
    fsdp: list[FSDPModule] = field(default_factory=list)  # the stage roots, when data parallel
    zero: ZeroLayout | None = None
    optimizer: torch.optim.Optimizer | None = None


def _layouts(plan: ComponentPlan) -> list[Layout]:
    return [Layout(g.first_rank, g.plan.config.dp, g.plan.config.tp) for g in plan.groups]


def build_groups(plan: ComponentPlan, program: Program, *, device: torch.device, lr: float,
                 weight_decay: float, optimizer: str = "adamw") -> tuple[list[Layout], _Group]:
    """Every group's layout, and this rank's group parallelised (collective: call on every rank)."""
    check_executable(plan)
    layouts = _layouts(plan)
    meshes = [DeviceMesh(device.type, torch.tensor(list(lay.ranks)).view(lay.dp, lay.tp), mesh_dim_names=("dp", "tp"))
              for lay in layouts]
    rank = dist.get_rank()
    index = next(i for i, lay in enumerate(layouts) if rank in lay.ranks)
    group = _Group(index=index, layout=layouts[index], mesh=meshes[index],
                   stages=[program.stage(name) for name in plan.groups[index].components])
    config = plan.groups[index].plan.config
    group.zero = zero_layout(config, plan.num_microbatches)
    for stage in group.stages:
        stage.module.to(device)
        blocks = [b for path in stage.block_lists for b in stage.module.get_submodule(path)]
        if config.tp > 1:
            for block in blocks:
                _tensor_parallel(block, group.mesh["tp"])
        if config.recompute is Recompute.FULL:
            _checkpoint_blocks(stage)
            blocks = [b for path in stage.block_lists for b in stage.module.get_submodule(path)]
        if config.dp > 1:
            wrap_blocks(stage.module, blocks, layout=group.zero, mesh=group.mesh["dp"])
    group.fsdp = [s.module for s in group.stages if isinstance(s.module, FSDPModule)]
    params = [p for s in group.stages for p in s.module.parameters()]
    group.optimizer = (torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)
                       if optimizer == "adamw" else torch.optim.SGD(params, lr=lr, foreach=False))
    return layouts, group


def _tensor_parallel(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron's split of one block (Shoeybi et al. 2019): q/k/v and the MLP's first projections
    column-parallel, the attention output and the MLP's last projection row-parallel (their output
    all-reduced): each rank holds heads / tp heads. Views must use -1 for the head count (transformers'
    CLIP and Llama attention do)."""
    plan: dict[str, Any] = {}
    for name, module in block.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Linear) and leaf in COLWISE:
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and leaf in ROWWISE:
            plan[name] = RowwiseParallel()
    if not plan:
        raise ValueError(f"tensor parallelism found no projections in {type(block).__name__} (looked for "
                         f"{COLWISE + ROWWISE}): plan this group with tp=1")
    parallelize_module(block, tp_mesh, plan)


def _checkpoint_blocks(stage: Stage) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for path in stage.block_lists:
        blocks = stage.module.get_submodule(path)
        for i in range(len(blocks)):
            blocks[i] = checkpoint_wrapper(blocks[i])


# --- point-to-point ----------------------------------------------------------------------------------

def _header(t: torch.Tensor) -> torch.Tensor:
    """int64 [8]: dtype index, ndim, shape (up to 6 dims)."""
    h = torch.zeros(8, dtype=torch.int64)
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2:2 + t.dim()] = torch.tensor(t.shape)
    return h


def send(t: torch.Tensor, to: int, tag: int, works: list) -> None:
    """Asynchronous send of a header and the tensor; `works` keeps them alive until waited."""
    data = t.detach().contiguous()
    h = _header(data)
    works.append((dist.isend(h, to, tag=2 * tag), h))
    works.append((dist.isend(data, to, tag=2 * tag + 1), data))


def recv(src: int, tag: int, device: torch.device) -> torch.Tensor:
    h = torch.empty(8, dtype=torch.int64)
    dist.recv(h, src, tag=2 * tag)
    shape = [int(x) for x in h[2:2 + int(h[1])]]
    out = torch.empty(shape, dtype=_DTYPES[int(h[0])], device=device)
    dist.recv(out, src, tag=2 * tag + 1)
    return out


def wait_all(works: list) -> None:
    for work, _ in works:
        work.wait()
    works.clear()


def full_parameters(group: _Group) -> dict[str, torch.Tensor]:
    """This group's parameters as full CPU tensors by the model's names (collective inside the group)."""
    out = {}
    for stage in group.stages:
        for name, param in stage.module.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[stage.original_name(name)] = full.detach().cpu().clone()
    return out


def prepare_backward(group: _Group, *, last: bool) -> None:
    """Before one microbatch's backward: reduce gradients now or accumulate, as the group's ZeRO layout
    says (execute.fsdp.prepare_microbatch; every microbatch for ZeRO-2/3, the last one otherwise)."""
    for module in group.fsdp:
        prepare_microbatch(module, group.zero, last=last)


def program_of(model: nn.Module, plan: ComponentPlan) -> Program:
    """The model's Program, checked against the plan's components."""
    program = program_for(model, plan.seq_len)
    planned = [c for g in plan.groups for c in g.components]
    if sorted(planned) != sorted(s.name for s in program.stages):
        raise ValueError(f"the plan's components {planned} are not the model's {[s.name for s in program.stages]}")
    return program
