"""Which devices a plan may use: the pools a search draws device counts from.

A plan need not use every device of the cluster.  1,016 A100s (127 nodes of 8) force
every layout that uses all of them into 127 data-parallel replicas, since 127 is prime;
126 nodes run a pipeline and are 40% faster.  So the devices used are part of the
search: a :class:`Pool` is an ordered tuple of devices, and a layout of ``n`` devices
runs on the first ``n`` of a pool (ranks laid out ``tp`` innermost over them, as
:mod:`autoplan.plan` describes), leaving the rest idle.

* Every cluster has the pool of all its devices in cluster order (node by node, group
  by group, site by site): its prefixes are whole nodes, or some devices of the first
  node where the degrees allow (tensor- and context-parallel groups inside one NVLink
  domain, :meth:`Pool.domain`; :meth:`Pool.whole_nodes_first`).
* A cluster of several device types also has one pool per nonempty proper subset of
  its types (the devices of those types, in cluster order): leaving a slow group idle
  is one of the priced options.

``use_all_devices=True`` keeps only the whole first pool, at its full size.

Examples
--------
>>> from autoplan.hardware import load_cluster
>>> [p.name for p in pools(load_cluster("mixed-a100-v100"))]
['all', 'A100-SXM4-80GB', 'V100-SXM2-32GB']
>>> p = pools(load_cluster("a100-sxm4-80gb", nodes=2))[0]
>>> p.domain(16), p.domain(12), p.domain(5), p.whole_node(16), p.whole_node(12)
(8, 4, 5, 8, None)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Pool", "pools", "prefix_domain", "idle_text", "kept_text"]


@dataclass(frozen=True)
class Pool:
    """Devices a layout may run on, in the order its ranks are laid out.

    Attributes
    ----------
    name : str
        ``"all"``, or the device types it holds (``"A100-SXM4-80GB"``).
    devices : tuple of int
        Cluster device indices; a layout of ``n`` devices runs on ``devices[:n]``.
    node_sizes : tuple of int
        Devices of each of the pool's nodes, in order (they add up to ``len(devices)``).
    """

    name: str
    devices: tuple[int, ...]
    node_sizes: tuple[int, ...]
    _domains: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.devices)

    def _split(self, n: int) -> tuple[list[int], int]:
        """The sizes of the nodes the first ``n`` devices fill, and the devices of the
        partly used node after them (0: none)."""
        full, left = [], n
        for size in self.node_sizes:
            if left >= size:
                full.append(size)
                left -= size
            else:
                break
        return full, left

    def domain(self, n: int) -> int:
        """The size of the device groups that tile every node of the first ``n`` devices
        (a partly used node counts with the devices used): groups of consecutive devices
        of this size, or a divisor of it, never straddle two nodes (NVLink domains)."""
        hit = self._domains.get(n)
        if hit is None:
            full, left = self._split(n)
            hit = self._domains[n] = math.gcd(*full, left) if full or left else 1
        return hit

    def whole_nodes_first(self, n: int) -> bool:
        """Whether a layout may use the first ``n`` devices: whole nodes, or some of the
        first node's (a layout of several nodes uses each whole: the devices a node
        leaves idle would be idle for the layout's sake alone)."""
        full, left = self._split(n)
        return not left or not full

    def whole_node(self, n: int) -> int | None:
        """The device count of every node the first ``n`` devices use, when they fill
        whole nodes of one size; else None."""
        hit = self._domains.get(-n, False)
        if hit is False:
            full, left = self._split(n)
            hit = self._domains[-n] = (full[0] if full and not left and len(set(full)) == 1
                                       else None)
        return hit


def pools(cluster: Any, *, use_all_devices: bool = False) -> list[Pool]:
    """The pools of ``cluster`` (see the module docstring), the pool of every device first."""
    def pool(name: str, nodes: list[int]) -> Pool:
        devices = tuple(d for j in nodes for d in cluster.devices_of_node(j))
        return Pool(name, devices, tuple(len(cluster.devices_of_node(j)) for j in nodes))

    every = pool("all", list(range(cluster.num_nodes)))
    if use_all_devices:
        return [every]
    types = [t.name for t in cluster.device_types]
    out = [every]
    if len(types) > 1:
        type_of = [cluster.profiles[node.profile].device.name for node in cluster.nodes]
        for k in range(1, len(types)):
            for kept in itertools.combinations(types, k):
                out.append(pool("+".join(kept),
                                [j for j, t in enumerate(type_of) if t in kept]))
    return out


def prefix_domain(cluster: Any, devices: tuple[int, ...]) -> int:
    """:meth:`Pool.domain` of an arbitrary device tuple (each node counted with the devices
    of it in ``devices``)."""
    counts: dict[int, int] = {}
    for d in devices:
        node = cluster.devices[d].node
        counts[node] = counts.get(node, 0) + 1
    return math.gcd(*counts.values()) if counts else 1


def idle_text(cluster: Any, used: tuple[int, ...], step_s: float, label: str,
              all_best: tuple[float, str] | None, all_bound_s: float | None,
              objective: str = "time") -> str:
    """Why a plan leaves devices idle, in one sentence.

    ``all_best``: the step time and label of the best layout of every device the search
    priced (None: it priced none, every one bounded at ``all_bound_s`` seconds or more).

    >>> from autoplan.hardware import load_cluster
    >>> c = load_cluster("a100-sxm4-80gb", nodes=2)
    >>> idle_text(c, tuple(range(8)), 1.0, "dp8", (3.0, "dp16 z3"), None)
    '8 of 16 devices idle (node 1): every layout of all 16 is slower (best priced: dp16 z3, 3.000 s); on 8 devices dp8 takes 1.000 s'
    """
    n = cluster.num_devices
    idle, where = _idle_where(cluster, used)
    if objective == "time":
        if all_best is not None:
            why = (f"every layout of all {n} is slower (best priced: {all_best[1]}, "
                   f"{all_best[0]:.3f} s)")
        elif all_bound_s is not None and math.isfinite(all_bound_s):
            why = f"every layout of all {n} takes at least {all_bound_s:.3f} s"
        else:
            why = f"no layout of all {n} fits or splits the batch"
    else:
        why = f"the cheapest per sample at the given prices (all {n}: " + (
            f"{all_best[1]}, {all_best[0]:.3f} s)" if all_best is not None else "not cheaper)")
    return f"{len(idle)} of {n} devices idle ({where}): {why}; on {len(used)} devices " \
           f"{label} takes {step_s:.3f} s"


def kept_text(cluster: Any, used: tuple[int, ...], step_s: float, label: str,
              planned_on: int) -> str:
    """Why a plan :func:`autoplan.replan` kept as it was leaves devices idle, in one
    sentence: it was the fastest of every subset of the ``planned_on`` devices it was made
    for (:attr:`autoplan.Plan.fastest_for`), and this cluster's are among them.

    >>> from autoplan.hardware import load_cluster
    >>> kept_text(load_cluster("a100-sxm4-80gb", nodes=2), tuple(range(8)), 1.0, "dp8", 24)
    '8 of 16 devices idle (node 1): dp8 was the fastest layout of every subset of the 24 devices it was planned for, these among them; on 8 devices it takes 1.000 s'
    """
    idle, where = _idle_where(cluster, used)
    return (f"{len(idle)} of {cluster.num_devices} devices idle ({where}): {label} was the "
            f"fastest layout of every subset of the {planned_on} devices it was planned for, "
            f"these among them; on {len(used)} devices it takes {step_s:.3f} s")


def _idle_where(cluster: Any, used: tuple[int, ...]) -> tuple[list[int], str]:
    """The devices ``used`` leaves idle, and where they are in words (whole nodes, or
    device ranges)."""
    idle = sorted(set(range(cluster.num_devices)) - set(used))
    nodes = sorted({cluster.devices[d].node for d in idle})
    whole = [j for j in nodes if set(cluster.devices_of_node(j)) <= set(idle)]
    where = (f"node{'s' if len(whole) > 1 else ''} {_ranges(whole)}" if whole == nodes
             else f"devices {_ranges(idle)}")
    return idle, where


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out = []
    for _, run in itertools.groupby(enumerate(values), key=lambda x: x[1] - x[0]):
        items = [v for _, v in run]
        out.append(str(items[0]) if len(items) == 1 else f"{items[0]}-{items[-1]}")
    return ", ".join(out)
