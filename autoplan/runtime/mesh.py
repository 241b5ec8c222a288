"""The device mesh of a plan.

The mesh is the plan's own (:attr:`Plan.mesh`): dimensions ``pp``, ``dp``,
``cp``, ``tp``, outermost first, so the last varies fastest over consecutive
ranks, which launchers place on the same node: tensor-parallel groups, whose
collectives sit on the critical path of every layer, stay inside a node; data-
and context-parallel groups come next, and pipeline stages, which exchange
only activations, span nodes.  This is the order of Megatron-LM (Narayanan et
al. 2021, Sec. 3.3) and torchtitan.  ``plan.mesh.devices[i]`` is the process
rank at mesh position ``i`` (a plan maps its ranks onto devices; the runtime
runs process ``r`` on device ``r``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..plan import Plan

__all__ = ["build_mesh", "mesh_coordinates", "rank_at", "expert_meshes"]


def build_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    """The plan's mesh as a torch :class:`DeviceMesh` named by ``plan.mesh.dims``."""
    ranks = torch.tensor(plan.mesh.devices, dtype=torch.int64).view(*plan.mesh.degrees)
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(plan.mesh.dims))


def mesh_coordinates(plan: Plan, rank: int | None = None) -> dict[str, int]:
    """This rank's coordinate along each mesh dimension (no collective)."""
    rank = dist.get_rank() if rank is None else rank
    pos = plan.mesh.devices.index(rank)   # this process's mesh position
    coords: dict[str, int] = {}
    for d, n in zip(reversed(plan.mesh.dims), reversed(plan.mesh.degrees)):
        coords[d] = pos % n
        pos //= n
    return coords


def rank_at(plan: Plan, **coords: int) -> int:
    """The process rank at mesh coordinates ``coords`` (``pp=``, ``dp=``, ``cp=``, ``tp=``;
    a dimension left out is 0)."""
    pos = 0
    for d, n in zip(plan.mesh.dims, plan.mesh.degrees):
        pos = pos * n + coords.get(d, 0)
    return plan.mesh.devices[pos]


def expert_meshes(mesh: DeviceMesh, plan: Plan) -> tuple[DeviceMesh, DeviceMesh]:
    """``(edp, ep)``: the expert data-parallel and the expert-parallel sub-meshes of the
    flattened ``dp x cp`` dimension (:attr:`MeshPlan.ep`: ranks with the same
    ``(dp_index * cp + cp_index) // ep`` share a MoE layer's experts; ``edp = dp x cp / ep``
    replicas hold each shard).  Collective (creates the groups) on every rank."""
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp") if plan.cp > 1 else mesh["dp"]
    split = dp_cp._unflatten(0, (plan.dp * plan.cp // plan.ep, plan.ep), ("edp", "ep"))
    return split["edp"], split["ep"]
