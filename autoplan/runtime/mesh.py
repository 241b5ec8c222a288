"""The device mesh of a layout.

Ranks are laid out with the last of ``Layout.mesh_dims`` varying fastest
(default ``("pp", "dp", "tp")``): consecutive ranks, which launchers place on
the same node, form the tensor-parallel groups, whose collectives sit on the
critical path of every layer; data-parallel groups come next, and pipeline
stages, which exchange only activations, span nodes.  This is the order of
Megatron-LM (Narayanan et al. 2021, Sec. 3.3) and torchtitan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .layout import Layout

__all__ = ["build_mesh", "mesh_coordinates", "rank_at"]


def build_mesh(layout: Layout, device_type: str = "cpu") -> DeviceMesh:
    """A 3-D mesh named ``pp``, ``dp``, ``tp`` (in ``layout.mesh_dims`` order)."""
    sizes = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp}
    dims = tuple(layout.mesh_dims)
    ranks = torch.tensor(layout.mesh_ranks(), dtype=torch.int64).view(*(sizes[d] for d in dims))
    return DeviceMesh(device_type, ranks, mesh_dim_names=dims)


def mesh_coordinates(layout: Layout, rank: int | None = None) -> dict[str, int]:
    """This rank's coordinate along each mesh dimension (no collective)."""
    rank = dist.get_rank() if rank is None else rank
    rank = layout.mesh_ranks().index(rank)   # this process's mesh position
    sizes = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp}
    coords: dict[str, int] = {}
    for d in reversed(layout.mesh_dims):
        coords[d] = rank % sizes[d]
        rank //= sizes[d]
    return coords


def rank_at(layout: Layout, **coords: int) -> int:
    """The process rank at mesh coordinates ``coords`` (``pp=``, ``dp=``, ``tp=``)."""
    sizes = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp}
    pos = 0
    for d in layout.mesh_dims:
        pos = pos * sizes[d] + coords[d]
    return layout.mesh_ranks()[pos]
