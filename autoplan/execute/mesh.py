"""The device mesh of a plan: built once from (pp, dp, ep, cp, tp) and passed explicitly.

`build_mesh` makes the 5-D mesh in MESH_AXIS_ORDER (pp outermost, tp innermost); `sub_meshes` derives,
once, the 1-D meshes each technique needs, including the flattened data-parallel meshes: dense
parameters are replicated (or sharded) over dp*ep*cp, expert parameters over dp*cp.

MoE folding (config.folded): `build_expert_mesh` makes a second mesh over the same ranks, (pp, edp, eep,
etp) of plan.layout.expert_mesh_shape; the experts are then sharded over its eep axis and data parallel
over its edp axis, and the tokens entering them are split over the dense tp group.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.plan.layout import EXPERT_AXIS_NAMES, expert_mesh_shape
from autoplan.plan.types import DENSE_DP, MESH_AXIS_ORDER, ParallelConfig

AXIS_NAMES: tuple[str, ...] = tuple(axis.value for axis in MESH_AXIS_ORDER)


def build_mesh(config: ParallelConfig, *, device_type: str) -> DeviceMesh:
    """The 5-D mesh ("pp", "dp", "ep", "cp", "tp") over all ranks of the default process group."""
    import torch.distributed as dist

    shape = tuple(size for _, size in config.mesh_shape())
    world = dist.get_world_size()
    if config.num_devices != world:
        raise ValueError(
            f"the plan needs pp*dp*ep*cp*tp = {config.num_devices} ranks but {world} were launched: "
            f"launch {config.num_devices} processes (--nproc-per-node) or change the degrees"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=AXIS_NAMES)


def build_expert_mesh(config: ParallelConfig, *, device_type: str) -> DeviceMesh | None:
    """The experts' own 4-D mesh (pp, edp, eep, etp) over the same ranks when the plan folds them
    (Megatron-Core's expert RankGenerator order, etp innermost); None when it does not. A collective
    call: every rank builds it, after build_mesh."""
    if not config.folded:
        return None
    import torch

    shape = tuple(size for _, size in expert_mesh_shape(config))
    return DeviceMesh(device_type, torch.arange(config.num_devices).view(shape), mesh_dim_names=EXPERT_AXIS_NAMES)


@dataclass(frozen=True)
class SubMeshes:
    """1-D meshes of one rank, derived once from the 5-D mesh.

    dense_dp: ("dp", "ep", "cp") flattened, over which dense parameters and gradients are data parallel.
    expert_dp: ("dp", "cp") flattened, over which expert parameters (sharded over ep) are data parallel;
      folded, the expert mesh's edp axis.
    experts: the mesh the routed experts are sharded over: ep, or folded the expert mesh's eep axis.
    token_split: folded, the dense tp mesh over which the experts' tokens are split; None otherwise.
    """

    pp: DeviceMesh
    dp: DeviceMesh
    ep: DeviceMesh
    cp: DeviceMesh
    tp: DeviceMesh
    dense_dp: DeviceMesh
    expert_dp: DeviceMesh
    experts: DeviceMesh | None = None  # None: the ep mesh
    token_split: DeviceMesh | None = None

    @property
    def expert_shards(self) -> DeviceMesh:
        return self.experts if self.experts is not None else self.ep

    def rank_on(self, axis: str) -> int:
        """This rank's coordinate along one axis."""
        return getattr(self, axis).get_local_rank()


def sub_meshes(mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None) -> SubMeshes:
    """Slice the 5-D mesh of `build_mesh` (and the expert mesh of `build_expert_mesh`, when the plan
    folds its experts) into the meshes of SubMeshes (call once per mesh)."""
    folded = expert_mesh is not None
    return SubMeshes(
        pp=mesh["pp"],
        dp=mesh["dp"],
        ep=mesh["ep"],
        cp=mesh["cp"],
        tp=mesh["tp"],
        dense_dp=mesh[DENSE_DP]._flatten("dp_ep_cp"),
        expert_dp=expert_mesh["edp"] if folded else mesh["dp", "cp"]._flatten("dp_cp"),
        experts=expert_mesh["eep"] if folded else None,
        token_split=mesh["tp"] if folded else None,
    )
