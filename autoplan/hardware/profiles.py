"""Hardware profiles: typed records, and loading them from YAML files.

Three modules, gathered here: :mod:`.profile_records` (the records),
:mod:`.profile_yaml` (parsing and writing YAML) and :mod:`.profile_discovery`
(finding profiles by name).

A *profile* describes one kind of node: its device type (peak FLOP/s per dtype,
memory, memory bandwidth, achievable matmul efficiency), the fabric inside the
node and the network between nodes.  A *composite profile* describes a
heterogeneous cluster: groups of nodes of different profiles, placed at sites,
and the links between the sites.

YAML keys carry their unit (``memory_GiB``, ``bw_bidir_GBps``, ``bw_per_nic_Gbps``,
``latency_us``); values are converted to SI units (bytes, bytes/s, seconds,
FLOP/s) exactly once, here, at load.  Every record field name carries its SI
unit.  Loading rejects missing and unknown keys, wrong types and physically
impossible values with a :class:`~autoplan.errors.ProfileError` that names the
file, the field path and what was expected.

Profiles are found by name, searched in this order: the folders listed in the
``AUTOPLAN_PROFILES`` environment variable (separated by ``os.pathsep``), the
user's folder ``$AUTOPLAN_HOME/profiles`` (default ``~/.autoplan/profiles``,
where ``autoplan profile`` writes), then the shipped profiles.  An earlier folder
overrides a later one.  The file ``<name>.yaml`` must declare ``name: <name>``.

The shipped profiles are the repository's top-level ``profiles/`` folder; a wheel
carries it as ``autoplan/_profiles`` (see ``setup.py``).

Examples
--------
>>> from autoplan.hardware.profiles import load_profile
>>> p = load_profile("a100-sxm4-80gb")
>>> p.device.peak_flops_per_s["bf16"]
312000000000000.0
>>> p.node.devices_per_node, p.node.bw_unidir_bytes_per_s
(8, 300000000000.0)
"""

from __future__ import annotations

from .profile_discovery import (HOME_ENV, PROFILES_ENV, available_profiles, find_profile_file,
                                load_profile, profile_dirs, shipped_profiles_dir, user_profiles_dir)
from .profile_records import (COLLECTIVE_OPS, DTYPE_FALLBACK, DTYPES, CollectiveEfficiency,
                              CollectiveLatency, CompositeProfile, DeviceType, EfficiencyTable, IntraNodeTopology,
                              MeshLink, NetworkSpec, NetworkTopology, NodeGroup, NodeSpec, OpOverhead,
                              ElementwiseRates, Profile, SiteLink)
from .profile_yaml import parse_profile, profile_to_yaml
from .hosts import HostSpec, ServerProfile

__all__ = [
    "DTYPES",
    "DTYPE_FALLBACK",
    "COLLECTIVE_OPS",
    "IntraNodeTopology",
    "NetworkTopology",
    "EfficiencyTable",
    "DeviceType",
    "OpOverhead",
    "ElementwiseRates",
    "CollectiveEfficiency",
    "CollectiveLatency",
    "MeshLink",
    "NodeSpec",
    "NetworkSpec",
    "Profile",
    "NodeGroup",
    "SiteLink",
    "CompositeProfile",
    "HostSpec",
    "ServerProfile",
    "PROFILES_ENV",
    "HOME_ENV",
    "shipped_profiles_dir",
    "user_profiles_dir",
    "profile_dirs",
    "available_profiles",
    "find_profile_file",
    "load_profile",
    "parse_profile",
    "profile_to_yaml",
]
