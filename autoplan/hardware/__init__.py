"""Hardware stage: profiles (YAML), the cluster resource view, collective costs, the profiler.

* :func:`load_cluster` / :func:`compose_cluster` build a :class:`Cluster` from
  shipped or measured profiles (:func:`available_profiles`).
* :class:`Cluster` answers ``path(a, b)``, ``collective_time(op, group, nbytes)``
  and ``collective_params(op, group)``.
* ``autoplan profile`` (:func:`autoplan.hardware.profiler.main`) measures the
  machine it runs on and writes a profile; it is imported on demand because it
  needs torch.
"""

from .cluster import ClusterNode, Cluster, Device, Link, ServerNode, compose_cluster, load_cluster
from .hosts import HostSpec, ServerProfile
from .collectives import CollectiveLevel, CollectiveOp, CollectiveParams
from .profiles import (
    COLLECTIVE_OPS,
    DTYPE_FALLBACK,
    DTYPES,
    CollectiveEfficiency,
    CollectiveLatency,
    CompositeProfile,
    DeviceType,
    EfficiencyTable,
    OpOverhead,
    ElementwiseRates,
    IntraNodeTopology,
    MeshLink,
    NetworkSpec,
    NetworkTopology,
    NodeGroup,
    NodeSpec,
    Profile,
    SiteLink,
    available_profiles,
    load_profile,
    profile_dirs,
    profile_to_yaml,
    user_profiles_dir,
)

__all__ = [
    "available_profiles",
    "user_profiles_dir",
    "load_profile",
    "load_cluster",
    "compose_cluster",
    "profile_dirs",
    "profile_to_yaml",
    "Cluster",
    "ClusterNode",
    "ServerNode",
    "HostSpec",
    "ServerProfile",
    "Device",
    "Link",
    "CollectiveOp",
    "CollectiveParams",
    "CollectiveLevel",
    "Profile",
    "DeviceType",
    "EfficiencyTable",
    "OpOverhead",
    "ElementwiseRates",
    "NodeSpec",
    "MeshLink",
    "NetworkSpec",
    "CollectiveEfficiency",
    "CollectiveLatency",
    "IntraNodeTopology",
    "NetworkTopology",
    "NodeGroup",
    "SiteLink",
    "CompositeProfile",
    "DTYPES",
    "DTYPE_FALLBACK",
    "COLLECTIVE_OPS",
]
