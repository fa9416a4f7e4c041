"""The device mesh of a plan: built once from (pp, dp, ep, cp, tp) and passed explicitly.

`build_mesh` makes the 5-D mesh in MESH_AXIS_ORDER (pp outermost, tp innermost); `sub_meshes` derives,
once, the 1-D meshes each technique needs, including the flattened data-parallel meshes: dense
parameters are replicated (or sharded) over dp*ep*cp, expert parameters over dp*cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.plan.types import MESH_AXIS_ORDER, ParallelConfig

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


@dataclass(frozen=True)
class SubMeshes:
    """1-D meshes of one rank, derived once from the 5-D mesh.

    dense_dp: ("dp", "ep", "cp") flattened, over which dense parameters and gradients are data parallel.
    expert_dp: ("dp", "cp") flattened, over which expert parameters (sharded over ep) are data parallel.
    """

    pp: DeviceMesh
    dp: DeviceMesh
    ep: DeviceMesh
    cp: DeviceMesh
    tp: DeviceMesh
    dense_dp: DeviceMesh
    expert_dp: DeviceMesh

    def rank_on(self, axis: str) -> int:
        """This rank's coordinate along one axis."""
        return getattr(self, axis).get_local_rank()


def sub_meshes(mesh: DeviceMesh) -> SubMeshes:
    """Slice the 5-D mesh of `build_mesh` into the meshes of SubMeshes (call once per mesh)."""
    return SubMeshes(
        pp=mesh["pp"],
        dp=mesh["dp"],
        ep=mesh["ep"],
        cp=mesh["cp"],
        tp=mesh["tp"],
        dense_dp=mesh["dp", "ep", "cp"]._flatten("dp_ep_cp"),
        expert_dp=mesh["dp", "cp"]._flatten("dp_cp"),
    )
