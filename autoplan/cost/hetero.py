"""Heterogeneity and placement terms of the cost engine: which device type prices a group,
where a replica's groups sit on the cluster's nodes, and ranks sharing cores.

* A group of devices is priced on its slowest device type (:func:`device_of`); replicas
  with the same device types, micro-batch count and placement cost the same, and the
  slowest sets the step (``CostEngine._evaluate``).
* A replica whose tensor-, context- or expert-parallel groups straddle two nodes (NVLink
  domains) is priced apart from those inside one (:func:`placement`,
  :func:`replicas_alike`).
* Ranks of a one-node cluster sharing fewer cores than they are
  (``NodeSpec.shared_cores``, :func:`shared_cores`) slow each other down: the pipeline
  and the step's hidden reductions pay for it (``CostEngine._evaluate``).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

from .layout import Layout

if TYPE_CHECKING:
    from .engine import CostEngine

__all__ = ["device_of", "shared_cores", "node_devices", "dp_concurrency", "placement",
           "replicas_alike"]


def device_of(engine: CostEngine, devices: tuple[int, ...]):
    """The :class:`~autoplan.hardware.DeviceType` that prices work spread over
    ``devices``: the slowest among them (lowest bf16-or-best peak, then least memory)."""
    d = engine._device_cache.get(devices)
    if d is None:
        types = {engine.cluster.device_type_of(i).name: engine.cluster.device_type_of(i)
                 for i in devices}
        d = min(types.values(), key=lambda t: (max(t.peak_flops_per_s.values()), t.memory_bytes))
        engine._device_cache[devices] = d
    return d


def shared_cores(engine: CostEngine, lay: Layout) -> tuple[int, int] | None:
    """``(ranks, cores)`` when the layout's ranks outnumber the cores they share: a
    one-node cluster whose node has ``shared_cores`` (CPU ranks measured all busy at
    once, :class:`~autoplan.hardware.NodeSpec`); ``None`` otherwise."""
    if len(engine.cluster.nodes) != 1:
        return None
    cores = engine.cluster.profile_of(0).node.shared_cores
    if cores is None:
        return None
    ranks = sum(len(devices) for devices in lay.rank_devices)
    return (ranks, cores) if cores < ranks else None


def node_devices(engine: CostEngine, device: int) -> int:
    """Devices on the node of ``device``."""
    return engine.cluster.profile_of(device).node.devices_per_node


def dp_concurrency(engine: CostEngine, group: tuple[int, ...]) -> int | None:
    """``concurrent_groups`` for data-parallel collectives (see ``dp_nic_per_device``)."""
    if not engine.options.dp_nic_per_device:
        return None
    return engine._node_devices(group[0])


def placement(engine: CostEngine, lay: Layout, p: int, r: int) -> tuple:
    """Where the groups of replica ``r`` on pipeline rank ``p`` sit
    (:meth:`Cluster.placement <autoplan.hardware.Cluster.placement>` of each)."""
    g = engine._groups(lay.rank_devices[p], lay.rank_tp[p], lay.cp, lay.ep, r)
    place = engine.cluster.placement
    return tuple(place(x) if x else () for x in (g.tp, g.cp, g.ep))


def replicas_alike(engine: CostEngine, lay: Layout) -> bool:
    """Whether every replica's tensor-, context- and expert-parallel groups sit alike
    on every pipeline rank (then replica 0 stands for all on one device type).

    Ranks laid out over consecutive devices, as the search does, place groups of
    ``g`` (``tp x cp`` a replica, ``ep x tp`` an expert-parallel group) alike when
    every NVLink domain edge inside the rank falls on a group edge, or every group
    spans whole nodes of one size; other layouts are compared replica by replica."""
    # first by the identity of the rank -> devices map (the search reuses one per
    # degree combination; hashing a thousand devices per estimate would cost time)
    quick_key = (id(lay.rank_devices), lay.rank_tp, lay.cp, lay.ep)
    seen = engine._alike_by_id.get(quick_key)
    if seen is not None and seen[0] is lay.rank_devices:
        return seen[1]
    key = (lay.rank_devices, lay.rank_tp, lay.cp, lay.ep)
    hit = engine._alike.get(key)
    if hit is not None:
        engine._alike_by_id[quick_key] = (lay.rank_devices, hit)
        return hit
    hit = True
    for p, devs in enumerate(lay.rank_devices):
        tp = lay.rank_tp[p]
        spans = [tp * lay.cp] + ([tp * lay.ep] if lay.ep > 1 else [])
        start, n = devs[0], len(devs)
        if devs == tuple(range(start, start + n)):
            starts = engine._node_starts
            edges = starts[bisect_right(starts, start):bisect_right(starts, start + n - 1)]
            if all(all((e - start) % g == 0 for e in edges)
                   or (engine._node_size is not None and g % engine._node_size == 0
                       and start % engine._node_size == 0) for g in spans):
                continue
        first = engine._placement(lay, p, 0)
        if any(engine._placement(lay, p, r) != first for r in range(1, lay.dp)):
            hit = False
            break
    if len(engine._alike) > 4096:
        engine._alike.clear()
        engine._alike_by_id.clear()
    engine._alike[key] = hit
    engine._alike_by_id[quick_key] = (lay.rank_devices, hit)
    return hit
