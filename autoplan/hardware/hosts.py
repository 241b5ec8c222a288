"""Host memory, the host link and CPU-only server nodes.

Embedding-heavy training (recommendation models) keeps tables where there is room:
a GPU's memory, its node's host memory read over the host link (PCIe, or NVLink-C2C on
Grace), or CPU-only parameter-server nodes reached over the network.  A node profile's
optional ``host`` section (:class:`HostSpec`) gives the first two; a *server profile*
(``kind: server``, :class:`ServerProfile`) the third: cores, DRAM and NICs, no device.

YAML (units in key names, converted to SI at load as the other sections are)::

    host:
      memory_GiB: 2048          # the node's DRAM
      memory_bw_GBps: 614.4     # its aggregate DRAM bandwidth
      cores: 112
      pcie_bw_GBps: 64          # per device, one direction (optional: none on a CPU host)
      source: DGX H100 datasheet ...

    kind: server
    name: cpu-server-...
    description: ...
    host: {...}                 # no pcie_bw: it has no device
    network: {...}              # as a node profile's

Examples
--------
>>> from autoplan.hardware import load_profile
>>> p = load_profile("a100-sxm4-80gb")
>>> p.host.memory_bytes // 2**30, p.host.pcie_bw_bytes_per_s
(2048, 15750000000.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ProfileError
from ..records import Record
from .profile_records import _NAME_RE, NetworkSpec, _require, _text

__all__ = ["HostSpec", "ServerProfile"]


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class HostSpec(Record):
    """The host side of a node: its DRAM, its cores and the link each device has to them.

    Parameters
    ----------
    memory_bytes : int
        DRAM of the whole node.
    memory_bw_bytes_per_s : float
        Aggregate DRAM bandwidth of the node (all channels, all sockets).
    cores : int
        Physical CPU cores of the node.
    source : str
        Where the figures come from (a datasheet, a measurement).
    pcie_bw_bytes_per_s : float or None
        Per device, one direction: what one device reads from host memory at once
        (PCIe Gen4 x16: 32 GB/s raw).  ``None`` on a host without devices (a CPU server,
        a CPU-only measured profile).
    """

    memory_bytes: int
    memory_bw_bytes_per_s: float
    cores: int
    source: str
    pcie_bw_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.memory_bytes, int) and not isinstance(self.memory_bytes, bool)
                 and self.memory_bytes > 0, "memory_bytes",
                 f"expected a host memory capacity > 0 bytes, got {self.memory_bytes!r}")
        _require(_positive(self.memory_bw_bytes_per_s), "memory_bw_bytes_per_s",
                 f"expected a host memory bandwidth > 0, got {self.memory_bw_bytes_per_s!r}")
        _require(isinstance(self.cores, int) and not isinstance(self.cores, bool)
                 and self.cores >= 1, "cores", f"expected a core count >= 1, got {self.cores!r}")
        _require(self.pcie_bw_bytes_per_s is None or _positive(self.pcie_bw_bytes_per_s),
                 "pcie_bw_bytes_per_s",
                 f"expected a host-link bandwidth > 0 or none, got {self.pcie_bw_bytes_per_s!r}")
        _require(_text(self.source), "source", "expected a non-empty source")


@dataclass(frozen=True)
class ServerProfile(Record):
    """A CPU-only node kind (a parameter server): its host and its network, no device.

    A cluster holds servers beside its devices (:meth:`autoplan.Cluster.with_servers`);
    the dense search never places layers on them, the sparse planner
    (:mod:`autoplan.sparse`) may place embedding tables there.
    """

    name: str
    description: str
    host: HostSpec
    network: NetworkSpec

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(_NAME_RE.fullmatch(self.name)), "name",
                 f"expected a profile name of lowercase letters, digits, '-', '_' and '.', "
                 f"got {self.name!r}")
        if self.host.pcie_bw_bytes_per_s is not None:
            raise ProfileError("a server has no device, so no host link: drop pcie_bw",
                               path="host.pcie_bw_bytes_per_s")
