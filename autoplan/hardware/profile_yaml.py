"""Hardware profiles as YAML: parse (units converted to SI once, every key and value
checked, errors naming file and field) and write back (:func:`profile_to_yaml`)."""

from __future__ import annotations

import enum
import math
import re
from typing import Any, Callable, Mapping

import yaml

from ..errors import ProfileError
from .device_records import _DEFAULT_TABLE_KEY
from .profile_records import (COLLECTIVE_OPS, DTYPES, VARIANT_TABLES,
                              CollectiveEfficiency,
                              CollectiveLatency, CompositeProfile, DeviceType, EfficiencyTable,
                              IntraNodeTopology, MeshLink, NetworkSpec, NetworkTopology, NodeGroup,
                              NodeSpec, OpOverhead, Profile, SiteLink, RATE_KINDS,
                              ElementwiseRates)
from .hosts import HostSpec, ServerProfile

__all__ = ["parse_profile", "profile_to_yaml"]

# --------------------------------------------------------------------------- YAML schema

# Unit suffixes accepted per quantity, with the factor to SI.  The SI spelling
# comes first: profile_to_yaml writes it, so a dump reloads exactly.
_BYTES = {"bytes": 1, "GiB": 2**30, "GB": 10**9, "MiB": 2**20}
_BW_BYTES = {"bytes_per_s": 1.0, "GBps": 1e9, "TBps": 1e12, "Gbps": 1e9 / 8}
_BW_BITS = {"bytes_per_s": 1.0, "Gbps": 1e9 / 8, "GBps": 1e9}
_LATENCY = {"s": 1.0, "us": 1e-6, "ms": 1e-3}
_FLOPS = {"flops_per_s": 1.0, "TFLOPs_per_s": 1e12}


class _YamlLoader(yaml.SafeLoader):
    """Safe loader that reads ``1e9`` as a float (YAML 1.2) and rejects duplicate keys."""


_YamlLoader.yaml_implicit_resolvers = {
    k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    keys = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in keys:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        keys.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _Section:
    """One YAML mapping being read: tracks the keys used, names paths in errors."""

    def __init__(self, data: Any, file: str | None, path: str, what: str) -> None:
        if not isinstance(data, dict):
            raise ProfileError(f"expected a mapping ({what}), got {_describe(data)}",
                               file=file, path=path)
        self.data, self.file, self.path, self.what = data, file, path, what
        self.allowed: list[str] = []

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, message: str) -> ProfileError:
        return ProfileError(message, file=self.file, path=self.at(key))

    def _get(self, key: str, what: str, required: bool) -> Any:
        self.allowed.append(key)
        if key not in self.data:
            if required:
                raise self.error(key, f"missing key {key!r}: expected {what}")
            return None
        return self.data[key]

    def text(self, key: str, what: str, *, required: bool = True) -> str | None:
        value = self._get(key, what, required)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"expected {what} (a non-empty string), got {_describe(value)}")
        return value

    def integer(self, key: str, what: str, *, minimum: int = 1) -> int:
        value = self._get(key, what, True)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, f"expected {what}: an integer >= {minimum}, got {_describe(value)}")
        return value

    def number(self, key: str, what: str, check: Callable[[float], bool], expectation: str,
               *, required: bool = True, value: Any = None) -> float | None:
        if value is None:
            value = self._get(key, what, required)
            if value is None and not required:
                return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected {what}: a number {expectation}, got {_describe(value)}")
        if not math.isfinite(value) or not check(value):
            raise self.error(key, f"expected {what}: a number {expectation}, got {value!r}")
        return float(value)

    def quantity(self, base: str, units: Mapping[str, float], what: str,
                 check: Callable[[float], bool], expectation: str) -> float:
        """Exactly one of ``<base>_<unit>`` for the units given; returns SI."""
        keys = [f"{base}_{u}" for u in units]
        self.allowed.extend(keys)
        present = [k for k in keys if k in self.data]
        if not present:
            raise self.error(keys[-1] if len(keys) == 1 else base,
                             f"missing key: expected {what} as one of {keys}")
        if len(present) > 1:
            raise self.error(present[1], f"{what} is given twice ({present}); keep one")
        key = present[0]
        raw = self.number(key, what, check, expectation, value=self.data[key])
        assert raw is not None
        return raw * units[key[len(base) + 1:]]

    def mapping(self, key: str, what: str, *, required: bool = True) -> "_Section | None":
        value = self._get(key, what, required)
        if value is None and not required:
            return None
        return _Section(value, self.file, self.at(key), what)

    def listing(self, key: str, what: str, *, required: bool = True) -> list[Any]:
        value = self._get(key, what, required)
        if value is None and not required:
            return []
        if not isinstance(value, list):
            raise self.error(key, f"expected {what} (a list), got {_describe(value)}")
        return value

    def choice(self, key: str, enum_cls: type[enum.Enum], what: str) -> Any:
        value = self._get(key, what, True)
        options = [m.value for m in enum_cls]
        if value not in options:
            raise self.error(key, f"expected {what}: one of {options}, got {_describe(value)}")
        return enum_cls(value)

    def finish(self) -> None:
        unknown = sorted(str(k) for k in set(self.data) - set(self.allowed))
        if unknown:
            raise self.error(unknown[0], f"unknown key(s) {unknown} in {self.what}; "
                                         f"expected keys {sorted(set(self.allowed))}")


def _describe(value: Any, limit: int = 60) -> str:
    """``value`` for an error message: its type for a mapping or list, its repr cut to
    ``limit`` characters otherwise (a whole file read as one string is not quoted whole)."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__}"
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" of {len(value)} characters" if isinstance(value, str) else ""
    return f"{type(value).__name__}{size} beginning {text[:limit]}..."


def _positive(x: float) -> bool:
    return x > 0


def _nonnegative(x: float) -> bool:
    return x >= 0


def _fraction(x: float) -> bool:
    return 0 < x <= 1


def _build(cls: type, section: _Section, **kwargs: Any) -> Any:
    """Construct a record; a constructor check failing becomes a ProfileError at the section."""
    try:
        return cls(**kwargs)
    except ProfileError as exc:
        raise ProfileError(getattr(exc, "detail", str(exc)), file=section.file,
                           path=section.at(exc.path) if exc.path else section.path) from None


def _parse_efficiency_table(sec: _Section) -> EfficiencyTable:
    raw = sec.listing("points", "[flops_per_matmul, efficiency] pairs")
    points = []
    for i, pair in enumerate(raw):
        where = f"points[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise sec.error(where, f"expected a pair [flops_per_matmul, efficiency], got {_describe(pair)}")
        flops = sec.number(where, "matmul FLOPs", _positive, "> 0", value=pair[0])
        eff = sec.number(where, "efficiency", _fraction, "in (0, 1]", value=pair[1])
        points.append((flops, eff))
    source = sec.text("source", "where the efficiencies come from")
    sec.finish()
    return _build(EfficiencyTable, sec, points=tuple(points), source=source)


def _parse_device(sec: _Section) -> DeviceType:
    name = sec.text("name", "the device name")
    peaks_key = [k for k in (f"peak_{u}" for u in _FLOPS) if k in sec.data]
    sec.allowed.extend(f"peak_{u}" for u in _FLOPS)
    if len(peaks_key) != 1:
        raise sec.error("peak", f"expected exactly one of {[f'peak_{u}' for u in _FLOPS]} "
                                f"(dense peak per dtype), found {peaks_key or 'none'}")
    peaks_sec = _Section(sec.data[peaks_key[0]], sec.file, sec.at(peaks_key[0]),
                         "peak FLOP/s per dtype")
    factor = _FLOPS[peaks_key[0][len("peak_"):]]
    peaks = {}
    for dtype in DTYPES:
        value = peaks_sec.number(dtype, f"the {dtype} peak", _positive, "> 0", required=False)
        if value is not None:
            peaks[dtype] = value * factor
    peaks_sec.finish()
    if not peaks:
        raise sec.error(peaks_key[0], f"expected a peak for at least one dtype of {list(DTYPES)}")
    memory = sec.quantity("memory", _BYTES, "the memory capacity", _positive, "> 0")
    memory_bw = sec.quantity("memory_bw", _BW_BYTES, "the memory bandwidth", _positive, "> 0")
    tables_sec = sec.mapping("matmul_efficiency", "efficiency tables per dtype or 'default'")
    assert tables_sec is not None
    tables = {}
    for key in [*DTYPES, _DEFAULT_TABLE_KEY, *VARIANT_TABLES]:
        table_sec = tables_sec.mapping(key, "an efficiency table", required=False)
        if table_sec is not None:
            tables[key] = _parse_efficiency_table(table_sec)
    tables_sec.finish()
    source = sec.text("source", "where the peak, memory and bandwidth figures come from")
    architecture = sec.text("architecture", "the device architecture (e.g. hopper)",
                            required=False) or ""
    overhead_sec = sec.mapping("op_overhead", "host time per operator", required=False)
    overhead = _parse_op_overhead(overhead_sec) if overhead_sec is not None else None
    measured = sec.data.get("measured", False)
    sec.allowed.append("measured")
    if not isinstance(measured, bool):
        raise sec.error("measured", f"expected true or false, got {_describe(measured)}")
    attention_sec = sec.mapping("attention_efficiency", "a measured fused-attention table",
                                required=False)
    attention = _parse_efficiency_table(attention_sec) if attention_sec is not None else None
    rates_sec = sec.mapping("elementwise_rates", "memory-bound operators' measured speed by kind",
                            required=False)
    rates = _parse_elementwise_rates(rates_sec) if rates_sec is not None else None
    grouped_sec = sec.mapping("grouped_matmul_efficiency",
                              "measured grouped-GEMM tables per dtype", required=False)
    grouped = None
    if grouped_sec is not None:
        grouped = {}
        for key in DTYPES:
            table_sec = grouped_sec.mapping(key, "an efficiency table", required=False)
            if table_sec is not None:
                grouped[key] = _parse_efficiency_table(table_sec)
        grouped_sec.finish()
    sec.finish()
    return _build(DeviceType, sec, name=name, peak_flops_per_s=peaks, memory_bytes=int(round(memory)),
                  memory_bw_bytes_per_s=memory_bw, matmul_efficiency=tables, source=source,
                  architecture=architecture, op_overhead=overhead, measured=measured,
                  attention_efficiency=attention, elementwise_rates=rates,
                  grouped_matmul_efficiency=grouped)


def _parse_elementwise_rates(sec: _Section) -> ElementwiseRates:
    """``forward`` and ``backward``: bytes per second per operator kind
    (:data:`~autoplan.hardware.profile_records.RATE_KINDS`), and a ``source``."""
    rates: dict[str, dict[str, float]] = {}
    for direction in ("forward", "backward"):
        part = sec.mapping(direction, f"{direction} bytes per second per operator kind")
        assert part is not None
        rates[direction] = {}
        for kind in RATE_KINDS:
            value = part.number(kind, f"{kind}'s {direction} bytes per second", _positive,
                                "> 0", required=False)
            if value is not None:
                rates[direction][kind] = value
        part.finish()
    source = sec.text("source", "how the rates were measured")
    sec.finish()
    return _build(ElementwiseRates, sec, forward_bytes_per_s=rates["forward"],
                  backward_bytes_per_s=rates["backward"], source=source)


def _parse_op_overhead(sec: _Section) -> OpOverhead:
    values = {f"{key}_s": sec.quantity(key, _LATENCY, what, _nonnegative, ">= 0")
              for key, what in (("forward", "seconds per captured operator in the forward"),
                                ("backward", "seconds per captured operator in the backward"),
                                ("tp_linear_forward", "extra seconds per tensor-parallel linear "
                                                      "in the forward"),
                                ("tp_linear_backward", "extra seconds per tensor-parallel linear "
                                                       "in the backward"))}
    for key, what in (("selective", "extra seconds per captured operator under selective "
                                    "recompute"),
                      ("selective_dispatch", "extra seconds per dispatched operator under "
                                             "selective recompute"),
                      ("selective_byte", "extra seconds per activation byte of a block under "
                                         "selective recompute"),
                      ("optimizer_param", "seconds per plain parameter tensor of an "
                                           "optimizer step"),
                      ("optimizer_dtensor_param", "seconds per DTensor parameter of an "
                                                   "optimizer step"),
                      ("forward_dispatch", "seconds per dispatched operator in the forward"),
                      ("backward_node", "seconds per autograd node in the backward"),
                      ("optimizer_element", "seconds per parameter element of an optimizer "
                                            "step"),
                      ("pipeline_action", "host seconds per pipeline stage action"),
                      ("pipeline_message", "host seconds per pipeline message end"),
                      ("zero_bubble_node", "extra seconds per autograd node of a split "
                                           "backward"),
                      ("tp_collective_byte", "extra seconds per byte of a tensor-parallel "
                                             "collective's payload"),
                      ("fsdp_gather_call", "FSDP2's extra seconds per all-gather of a "
                                           "unit"),
                      ("fsdp_gather_byte", "FSDP2's extra seconds per byte a unit's "
                                           "all-gather gathers"),
                      ("fsdp_reduce_call", "FSDP2's extra seconds per reduce-scatter of a "
                                           "unit"),
                      ("fsdp_reduce_byte", "FSDP2's extra seconds per byte a unit's "
                                           "reduce-scatter reduces"),
                      ("replicate_call", "replicate's extra seconds per all-reduce of a "
                                         "rank's gradients"),
                      ("replicate_byte", "replicate's extra seconds per byte of gradients "
                                         "it all-reduces"),
                      ("cp_gather_call", "extra seconds per context-parallel all-gather in "
                                         "a step"),
                      ("cp_gather_byte", "extra seconds per byte a context-parallel "
                                         "all-gather gathers"),
                      ("cp_scatter_call", "extra seconds per context-parallel "
                                          "reduce-scatter in a step"),
                      ("cp_scatter_byte", "extra seconds per byte a context-parallel "
                                          "reduce-scatter reduces"),
                      ("tp_shared_linear_forward", "extra seconds per column linear sharing "
                                                   "its region's input, in the forward"),
                      ("tp_shared_linear_backward", "extra seconds per column linear sharing "
                                                    "its region's input, in the backward")):
        if any(f"{key}_{unit}" in sec.data for unit in _LATENCY):   # older profiles lack some
            values[f"{key}_s"] = sec.quantity(key, _LATENCY, what, _nonnegative, ">= 0")
    for key, what in (("layer_forward_scale", "a layer's measured forward over its parts' sum"),
                      ("layer_backward_scale", "a layer's measured backward over its parts' "
                                               "sum"),
                      ("host_forward_scale", "a layer's host work in the forward over the "
                                             "tiny blocks' figures"),
                      ("host_backward_scale", "a layer's host work in the backward over the "
                                              "tiny blocks' figures")):
        value = sec.number(key, what, _positive, "> 0", required=False)
        if value is not None:
            values[key] = value
    source = sec.text("source", "how the overhead was measured")
    sec.finish()
    return _build(OpOverhead, sec, **values, source=source)


def _parse_collective_latency(sec: _Section) -> CollectiveLatency:
    values = {op: sec.quantity(op, _LATENCY, f"the {op} latency per ring step", _nonnegative,
                               ">= 0")
              for op in COLLECTIVE_OPS}
    source = sec.text("source", "where the latencies come from")
    sec.finish()
    return _build(CollectiveLatency, sec, **values, source=source)


def _parse_collective_efficiency(sec: _Section) -> CollectiveEfficiency:
    values = {op: sec.number(op, f"the {op} efficiency", _fraction, "in (0, 1]")
              for op in COLLECTIVE_OPS}
    source = sec.text("source", "where the efficiencies come from")
    sec.finish()
    return _build(CollectiveEfficiency, sec, **values, source=source)


_INTRA_BW = {"bw_unidir_bytes_per_s": 1.0, "bw_unidir_GBps": 1e9, "bw_bidir_GBps": 0.5e9}


def _intra_bw(sec: _Section, what: str) -> float:
    # Bidirectional figures (datasheets quote those) are halved: one direction.
    sec.allowed.extend(_INTRA_BW)
    present = [k for k in _INTRA_BW if k in sec.data]
    if len(present) != 1:
        raise sec.error("bw", f"expected {what} as exactly one of {list(_INTRA_BW)}, "
                              f"found {present or 'none'}")
    key = present[0]
    value = sec.number(key, what, _positive, "> 0", value=sec.data[key])
    assert value is not None
    return value * _INTRA_BW[key]


def _parse_node(sec: _Section) -> NodeSpec:
    devices = sec.integer("devices_per_node", "the number of devices per node")
    topology = sec.choice("topology", IntraNodeTopology, "the intra-node topology")
    bw = _intra_bw(sec, "the per-device intra-node bandwidth")
    latency = sec.quantity("latency", _LATENCY, "the per-hop intra-node latency",
                           _nonnegative, ">= 0")
    eff_sec = sec.mapping("collective_efficiency", "collective efficiency per operation")
    assert eff_sec is not None
    efficiency = _parse_collective_efficiency(eff_sec)
    links = []
    for i, raw in enumerate(sec.listing("links", "direct links (mesh topologies)", required=False)):
        link_sec = _Section(raw, sec.file, f"{sec.at('links')}[{i}]", "a mesh link")
        pair = link_sec.listing("devices", "two local device indices")
        if len(pair) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) for d in pair):
            raise link_sec.error("devices", f"expected two local device indices, got {pair!r}")
        link_bw = _intra_bw(link_sec, "the link bandwidth")
        link_sec.finish()
        links.append(_build(MeshLink, link_sec, devices=(pair[0], pair[1]),
                            bw_unidir_bytes_per_s=link_bw))
    source = sec.text("source", "where the topology and bandwidth come from")
    latency_source = sec.text("latency_source", "where the latency comes from")
    shared_cores = (sec.integer("shared_cores", "the cores the devices share")
                    if "shared_cores" in sec.data else None)
    sec.allowed.append("shared_cores")
    lat_sec = sec.mapping("collective_latency", "the per-step latency of each collective",
                          required=False)
    op_latency = _parse_collective_latency(lat_sec) if lat_sec is not None else None
    arrival, arrival_source = 0.0, None
    if any(f"arrival_{unit}" in sec.data for unit in _LATENCY):
        arrival = sec.quantity("arrival", _LATENCY, "what a collective call costs more after "
                               "compute (ranks that share cores)", _nonnegative, ">= 0")
        arrival_source = sec.text("arrival_source", "where the arrival cost comes from")
    sec.allowed.extend(f"arrival_{unit}" for unit in _LATENCY)
    sec.allowed.append("arrival_source")
    sec.finish()
    return _build(NodeSpec, sec, devices_per_node=devices, topology=topology,
                  bw_unidir_bytes_per_s=bw, latency_s=latency, collective_efficiency=efficiency,
                  source=source, latency_source=latency_source, links=tuple(links),
                  shared_cores=shared_cores, collective_latency=op_latency,
                  arrival_s=arrival, arrival_source=arrival_source)


def _parse_network(sec: _Section) -> NetworkSpec:
    nics = sec.integer("nics_per_node", "the number of NICs per node")
    bw = sec.quantity("bw_per_nic", _BW_BITS, "the bandwidth of one NIC (one direction)",
                      _positive, "> 0")
    latency = sec.quantity("latency", _LATENCY, "the inter-node latency", _nonnegative, ">= 0")
    topology = sec.choice("topology", NetworkTopology, "the network topology")
    oversub = sec.number("oversubscription", "the oversubscription ratio", lambda x: x >= 1,
                         ">= 1 (1 = non-blocking)")
    eff_sec = sec.mapping("collective_efficiency", "collective efficiency per operation")
    assert eff_sec is not None
    efficiency = _parse_collective_efficiency(eff_sec)
    source = sec.text("source", "where the NIC figures come from")
    latency_source = sec.text("latency_source", "where the latency comes from")
    sec.finish()
    return _build(NetworkSpec, sec, nics_per_node=nics, bw_per_nic_bytes_per_s=bw,
                  latency_s=latency, topology=topology, oversubscription=oversub,
                  collective_efficiency=efficiency, source=source, latency_source=latency_source)


def _parse_site_link(sec: _Section) -> SiteLink:
    sites = sec.listing("sites", "the two site names")
    if len(sites) != 2 or not all(isinstance(s, str) and s.strip() for s in sites):
        raise sec.error("sites", f"expected two site names, got {sites!r}")
    bw = sec.quantity("bw", _BW_BITS, "the link bandwidth (one direction)", _positive, "> 0")
    latency = sec.quantity("latency", _LATENCY, "the link latency", _nonnegative, ">= 0")
    eff_sec = sec.mapping("collective_efficiency", "collective efficiency per operation")
    assert eff_sec is not None
    efficiency = _parse_collective_efficiency(eff_sec)
    source = sec.text("source", "where the link figures come from")
    sec.finish()
    return _build(SiteLink, sec, sites=(sites[0], sites[1]), bw_bytes_per_s=bw, latency_s=latency,
                  collective_efficiency=efficiency, source=source)


def _parse_host(sec: _Section, *, devices: bool) -> HostSpec:
    """A node's ``host`` section (:class:`~autoplan.hardware.hosts.HostSpec`); a server's
    (``devices=False``) has no host link."""
    memory = sec.quantity("memory", _BYTES, "the host memory capacity of the node", _positive, "> 0")
    memory_bw = sec.quantity("memory_bw", _BW_BYTES, "the node's aggregate host memory bandwidth",
                             _positive, "> 0")
    cores = sec.integer("cores", "the node's physical CPU cores")
    pcie = None
    if devices and any(f"pcie_bw_{u}" in sec.data for u in _BW_BYTES):
        pcie = sec.quantity("pcie_bw", _BW_BYTES, "each device's host link (one direction)",
                            _positive, "> 0")
    elif devices:
        sec.allowed.extend(f"pcie_bw_{u}" for u in _BW_BYTES)
    source = sec.text("source", "where the host figures come from")
    sec.finish()
    return _build(HostSpec, sec, memory_bytes=int(round(memory)), memory_bw_bytes_per_s=memory_bw,
                  cores=cores, source=source, pcie_bw_bytes_per_s=pcie)


def _host_yaml(host: HostSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"memory_bytes": host.memory_bytes,
                           "memory_bw_bytes_per_s": host.memory_bw_bytes_per_s,
                           "cores": host.cores}
    if host.pcie_bw_bytes_per_s is not None:
        out["pcie_bw_bytes_per_s"] = host.pcie_bw_bytes_per_s
    out["source"] = host.source
    return out


def parse_profile(data: Any, file: str | None = None) -> Profile | CompositeProfile | ServerProfile:
    """Build a profile from parsed YAML ``data`` (``file`` only names it in errors).

    Raises
    ------
    ProfileError
        Naming ``file``, the field path and what was expected.
    """
    top = _Section(data, file, "", "a profile")
    kind = top.text("kind", "'node', 'composite' or 'server'")
    if kind not in ("node", "composite", "server"):
        raise top.error("kind", f"expected 'node', 'composite' or 'server', got {kind!r}")
    name = top.text("name", "the profile name")
    description = top.text("description", "a one-line description")
    if kind == "server":
        host_sec = top.mapping("host", "the server's host (memory, cores)")
        network_sec = top.mapping("network", "the server's network")
        assert host_sec is not None and network_sec is not None
        host = _parse_host(host_sec, devices=False)
        network = _parse_network(network_sec)
        top.finish()
        return _build(ServerProfile, top, name=name, description=description, host=host,
                      network=network)
    if kind == "node":
        device_sec = top.mapping("device", "the device type")
        node_sec = top.mapping("node", "the intra-node fabric")
        network_sec = top.mapping("network", "the inter-node network", required=False)
        host_sec = top.mapping("host", "the node's host memory and host link", required=False)
        assert device_sec is not None and node_sec is not None
        device = _parse_device(device_sec)
        node = _parse_node(node_sec)
        network = _parse_network(network_sec) if network_sec is not None else None
        host = _parse_host(host_sec, devices=True) if host_sec is not None else None
        top.finish()
        return _build(Profile, top, name=name, description=description, device=device,
                      node=node, network=network, host=host)
    groups = []
    for i, raw in enumerate(top.listing("groups", "node groups")):
        sec = _Section(raw, file, f"groups[{i}]", "a node group")
        profile = sec.text("profile", "a profile name")
        nodes = sec.integer("nodes", "the number of nodes")
        site = sec.text("site", "a site name")
        sec.finish()
        groups.append(_build(NodeGroup, sec, profile=profile, nodes=nodes, site=site))
    links = [_parse_site_link(_Section(raw, file, f"site_links[{i}]", "a site link"))
             for i, raw in enumerate(top.listing("site_links", "links between sites", required=False))]
    top.finish()
    return _build(CompositeProfile, top, name=name, description=description,
                  groups=tuple(groups), site_links=tuple(links))


# --------------------------------------------------------------------------- dumping


class _Dumper(yaml.SafeDumper):
    """Writes short lists of numbers (``[flops, efficiency]``, ``devices``) on one line."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(isinstance(x, (int, float, str)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _represent_list)


def _collective_efficiency_yaml(eff: CollectiveEfficiency) -> dict[str, Any]:
    return {**{op: getattr(eff, op) for op in COLLECTIVE_OPS}, "source": eff.source}


def _network_yaml(w: NetworkSpec) -> dict[str, Any]:
    return {
        "nics_per_node": w.nics_per_node, "bw_per_nic_bytes_per_s": w.bw_per_nic_bytes_per_s,
        "latency_s": w.latency_s, "topology": w.topology.value,
        "oversubscription": w.oversubscription,
        "collective_efficiency": _collective_efficiency_yaml(w.collective_efficiency),
        "source": w.source, "latency_source": w.latency_source,
    }


def profile_to_yaml(profile: Profile | CompositeProfile | ServerProfile) -> str:
    """YAML text for ``profile`` in SI-suffixed keys; :func:`parse_profile` reads it back exactly."""
    if isinstance(profile, ServerProfile):
        data = {"kind": "server", "name": profile.name, "description": profile.description,
                "host": _host_yaml(profile.host), "network": _network_yaml(profile.network)}
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)
    if isinstance(profile, CompositeProfile):
        data: dict[str, Any] = {
            "kind": "composite", "name": profile.name, "description": profile.description,
            "groups": [{"profile": g.profile_name, "nodes": g.nodes, "site": g.site}
                       for g in profile.groups],
            "site_links": [{"sites": list(l.sites), "bw_bytes_per_s": l.bw_bytes_per_s,
                            "latency_s": l.latency_s,
                            "collective_efficiency": _collective_efficiency_yaml(l.collective_efficiency),
                            "source": l.source} for l in profile.site_links],
        }
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)
    d, n, w = profile.device, profile.node, profile.network
    device = {
        "name": d.name,
        "peak_flops_per_s": {k: d.peak_flops_per_s[k] for k in DTYPES if k in d.peak_flops_per_s},
        "memory_bytes": d.memory_bytes,
        "memory_bw_bytes_per_s": d.memory_bw_bytes_per_s,
        "matmul_efficiency": {k: {"points": [list(p) for p in t.points], "source": t.source}
                              for k, t in d.matmul_efficiency.items()},
        "source": d.source,
    }
    if d.architecture:
        device["architecture"] = d.architecture
    if d.measured:
        device["measured"] = True
    if d.attention_efficiency is not None:
        t = d.attention_efficiency
        device["attention_efficiency"] = {"points": [list(p) for p in t.points],
                                          "source": t.source}
    if d.grouped_matmul_efficiency:
        device["grouped_matmul_efficiency"] = {
            k: {"points": [list(p) for p in t.points], "source": t.source}
            for k, t in d.grouped_matmul_efficiency.items()}
    if d.elementwise_rates is not None:
        r = d.elementwise_rates
        device["elementwise_rates"] = {"forward": dict(r.forward_bytes_per_s),
                                       "backward": dict(r.backward_bytes_per_s),
                                       "source": r.source}
    if d.op_overhead is not None:
        o = d.op_overhead
        device["op_overhead"] = {"forward_s": o.forward_s, "backward_s": o.backward_s,
                                 "tp_linear_forward_s": o.tp_linear_forward_s,
                                 "tp_linear_backward_s": o.tp_linear_backward_s,
                                 "selective_s": o.selective_s,
                                 "selective_dispatch_s": o.selective_dispatch_s,
                                 "optimizer_param_s": o.optimizer_param_s,
                                 "optimizer_dtensor_param_s": o.optimizer_dtensor_param_s,
                                 "forward_dispatch_s": o.forward_dispatch_s,
                                 "backward_node_s": o.backward_node_s,
                                 "optimizer_element_s": o.optimizer_element_s,
                                 **({"selective_byte_s": o.selective_byte_s}
                                    if o.selective_byte_s else {}),
                                 **({"pipeline_action_s": o.pipeline_action_s,
                                     "pipeline_message_s": o.pipeline_message_s}
                                    if o.pipeline_action_s or o.pipeline_message_s else {}),
                                 **({"zero_bubble_node_s": o.zero_bubble_node_s}
                                    if o.zero_bubble_node_s else {}),
                                 **({"tp_collective_byte_s": o.tp_collective_byte_s}
                                    if o.tp_collective_byte_s else {}),
                                 **({"fsdp_gather_call_s": o.fsdp_gather_call_s,
                                     "fsdp_gather_byte_s": o.fsdp_gather_byte_s,
                                     "fsdp_reduce_call_s": o.fsdp_reduce_call_s,
                                     "fsdp_reduce_byte_s": o.fsdp_reduce_byte_s}
                                    if o.fsdp_measured else {}),
                                 **({"replicate_call_s": o.replicate_call_s,
                                     "replicate_byte_s": o.replicate_byte_s}
                                    if o.replicate_measured else {}),
                                 **({"cp_gather_call_s": o.cp_gather_call_s,
                                     "cp_gather_byte_s": o.cp_gather_byte_s,
                                     "cp_scatter_call_s": o.cp_scatter_call_s,
                                     "cp_scatter_byte_s": o.cp_scatter_byte_s}
                                    if o.cp_measured else {}),
                                 **({"tp_shared_linear_forward_s": o.tp_shared_linear_forward_s,
                                     "tp_shared_linear_backward_s": o.tp_shared_linear_backward_s}
                                    if o.tp_shared_linear_forward_s is not None else {}),
                                 **({"layer_forward_scale": o.layer_forward_scale,
                                     "layer_backward_scale": o.layer_backward_scale}
                                    if o.layer_forward_scale is not None else {}),
                                 **({"host_forward_scale": o.host_forward_scale,
                                     "host_backward_scale": o.host_backward_scale}
                                    if o.host_forward_scale is not None else {}),
                                 "source": o.source}
    node: dict[str, Any] = {
        "devices_per_node": n.devices_per_node, "topology": n.topology.value,
        "bw_unidir_bytes_per_s": n.bw_unidir_bytes_per_s, "latency_s": n.latency_s,
        "collective_efficiency": _collective_efficiency_yaml(n.collective_efficiency),
        "source": n.source, "latency_source": n.latency_source,
    }
    if n.links:
        node["links"] = [{"devices": list(l.devices), "bw_unidir_bytes_per_s": l.bw_unidir_bytes_per_s}
                         for l in n.links]
    if n.shared_cores is not None:
        node["shared_cores"] = n.shared_cores
    if n.collective_latency is not None:
        lat = n.collective_latency
        node["collective_latency"] = {**{f"{op}_s": getattr(lat, op) for op in COLLECTIVE_OPS},
                                      "source": lat.source}
    if n.arrival_s:
        node["arrival_s"] = n.arrival_s
        node["arrival_source"] = n.arrival_source
    data = {"kind": "node", "name": profile.name, "description": profile.description,
            "device": device, "node": node}
    if w is not None:
        data["network"] = _network_yaml(w)
    if profile.host is not None:
        data["host"] = _host_yaml(profile.host)
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)
