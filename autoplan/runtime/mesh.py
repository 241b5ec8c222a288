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

**One set of process groups per mesh.**  Every process group holds threads and
buffers (gloo: about three threads a group) until ``destroy_process_group``;
a process that calls :func:`autoplan.parallelize` again (a replan after a
failure, a notebook's what-if, a benchmark running layouts one after another)
would otherwise create a new set each time.  :func:`build_mesh` and
:func:`shared_group` build a mesh or group once per process and hand the same
one back while its groups are alive (meshes and groups are immutable; torch
itself keeps a mesh's flattened sub-meshes the same way).  The cache is keyed by
the ranks alone, so every rank hits or misses it together, as the collective
``new_group`` requires.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..plan import Plan

__all__ = ["build_mesh", "mesh_coordinates", "rank_at", "expert_meshes", "shared_group"]

#: Meshes and groups built in this process, by their ranks (see the module's docstring)
_MESHES: dict[tuple, DeviceMesh] = {}
_GROUPS: dict[tuple[int, ...], Any] = {}


def _alive(group: Any) -> bool:
    """Whether ``group`` is still registered (not destroyed with ``destroy_process_group``)."""
    from torch.distributed import distributed_c10d as c10d

    return group in c10d._world.pg_map


def _mesh_alive(mesh: DeviceMesh) -> bool:
    try:
        return all(_alive(mesh.get_group(d)) for d in mesh.mesh_dim_names or ())
    except (RuntimeError, KeyError, ValueError):   # a group that is gone
        return False


def build_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    """The plan's mesh as a torch :class:`DeviceMesh` named by ``plan.mesh.dims``: built
    (collective, on every rank) the first time this process needs its shape and ranks,
    the same mesh afterwards while its groups are alive."""
    key = (device_type, tuple(plan.mesh.dims), tuple(plan.mesh.degrees),
           tuple(plan.mesh.devices))
    mesh = _MESHES.get(key)
    if mesh is None or not _mesh_alive(mesh):
        ranks = torch.tensor(plan.mesh.devices, dtype=torch.int64).view(*plan.mesh.degrees)
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(plan.mesh.dims))
        _MESHES[key] = mesh
    return mesh


def shared_group(members: tuple[int, ...]) -> Any:
    """``dist.new_group(members)``, built once per process while it is alive (collective:
    every rank calls it for every group, in the same order, as ``new_group`` requires)."""
    members = tuple(members)
    group = _GROUPS.get(members)
    if group is None or not _alive(group):
        group = dist.new_group(list(members))
        _GROUPS[members] = group
    return group


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
    replicas hold each shard).  Collective (creates the groups) on every rank the first time
    for a mesh; the same pair afterwards."""
    cache = mesh.__dict__.setdefault("_autoplan_expert_meshes", {})
    sizes = (plan.dp * plan.cp // plan.ep, plan.ep)
    if sizes not in cache:
        dp_cp = mesh["dp", "cp"]._flatten("dp_cp") if plan.cp > 1 else mesh["dp"]
        split = dp_cp._unflatten(0, sizes, ("edp", "ep"))
        cache[sizes] = (split["edp"], split["ep"])
    return cache[sizes]
