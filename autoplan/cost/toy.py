"""Hand-built graphs and clusters with round numbers, for exact cost-model checks.

:func:`toy_graph` is a stack of identical blocks, each one weight-carrying
matmul (``fwd_flops`` forward, twice that backward) whose parameters are split
by tensor parallelism; :func:`toy_cluster` is one kind of node with a flat
efficiency, no latency and perfect collective efficiency, so every time the
cost model predicts can be computed by hand.

Examples
--------
>>> g = toy_graph(layers=2, fwd_flops=1e9, params=1000)
>>> [l.name for l in g.layers], g.num_params
(['blocks.0', 'blocks.1'], 2000)
>>> c = toy_cluster(devices_per_node=2)
>>> c.device_type_of(0).efficiency(1e9, "bf16")
0.5
"""

from __future__ import annotations

from ..graph import (
    CollectiveRecord,
    LayerKind,
    LayerRecord,
    LinearRecord,
    LinearRole,
    ModelGraph,
    NodeRecord,
    TPStructure,
)

__all__ = ["toy_graph", "toy_cluster", "toy_profile"]


def toy_graph(*, layers: int = 2, fwd_flops: int = 10**9, params: int = 1000,
              saved_bytes: int = 0, stream_bytes: int = 0, seq_len: int = 16,
              tp_allreduce_bytes: int = 0) -> ModelGraph:
    """``layers`` identical blocks of one matmul each (per micro-batch of one sequence).

    Parameters
    ----------
    fwd_flops : int
        Forward FLOPs of each block (backward: twice that).
    params : int
        Parameters of each block (bf16: 2 bytes each), all in one column-parallel linear.
    saved_bytes : int
        Activation bytes each block saves, all inside the tensor-parallel region.
    stream_bytes : int
        Bytes of each block's output (what a pipeline boundary sends).
    tp_allreduce_bytes : int
        Size of one forward all-reduce per block under tensor parallelism.
    """
    node = NodeRecord(
        name="mm", target="aten.mm.default", module="fc", inputs=("x",), shape=(seq_len, 1),
        dtype="bfloat16", out_bytes=stream_bytes, fwd_flops=fwd_flops, bwd_flops=2 * fwd_flops,
        param_bytes=2 * params, saved_bytes=saved_bytes, saved_tp_sharded_bytes=saved_bytes,
        saved_quadratic_bytes=0, tp_region=True)
    colls = ((CollectiveRecord("all_reduce", "forward", tp_allreduce_bytes, "fc"),)
             if tp_allreduce_bytes else ())
    tp = TPStructure(linears=(LinearRecord("fc", LinearRole.COLUMN, params, 1),),
                     tp_collectives=colls, divisors=(params,))
    recs = tuple(LayerRecord(
        name=f"blocks.{i}", kind=LayerKind.BLOCK, stack="blocks", index=i, template="blocks.0",
        modules=(f"blocks.{i}",), fwd_flops=fwd_flops, bwd_flops=2 * fwd_flops,
        param_count=params, param_bytes=2 * params, saved_bytes=saved_bytes,
        saved_tp_sharded_bytes=saved_bytes, saved_quadratic_bytes=0, selective_recompute_flops=0,
        input_bytes=stream_bytes, output_bytes=stream_bytes, cut_bytes=stream_bytes, tp=tp)
        for i in range(layers))
    return ModelGraph(
        model="Toy", capture="hand-built", objective="sum of outputs (no loss_fn given)",
        micro_batch=1, seq_len=seq_len, inputs=(("input0", (1, seq_len), "float32"),),
        param_dtype="bfloat16", num_params=layers * params, param_bytes=2 * layers * params,
        attributes={}, layers=recs, templates={"blocks.0": (node,)})


def toy_profile(*, name: str = "toy", devices_per_node: int = 2, peak_flops_per_s: float = 1e12,
                efficiency: float = 0.5, memory_bytes: int = 2**34,
                memory_bw_bytes_per_s: float = 1e12, intra_bw_bytes_per_s: float = 1e11,
                inter_bw_bytes_per_s: float | None = None, latency_s: float = 0.0):
    """A node profile with round numbers (flat efficiency, perfect collectives)."""
    from ..hardware import (CollectiveEfficiency, DeviceType, EfficiencyTable, IntraNodeTopology,
                            NetworkSpec, NetworkTopology, NodeSpec, Profile)
    perfect = CollectiveEfficiency.uniform(1.0, "toy: perfect")
    device = DeviceType(
        name=name.upper(), peak_flops_per_s={"bf16": peak_flops_per_s, "fp32": peak_flops_per_s},
        memory_bytes=memory_bytes, memory_bw_bytes_per_s=memory_bw_bytes_per_s,
        matmul_efficiency={"default": EfficiencyTable(((1.0, efficiency),), "toy: flat")},
        source="toy")
    node = NodeSpec(devices_per_node=devices_per_node, topology=IntraNodeTopology.NVSWITCH,
                    bw_unidir_bytes_per_s=intra_bw_bytes_per_s, latency_s=latency_s,
                    collective_efficiency=perfect, source="toy", latency_source="toy")
    network = None
    if inter_bw_bytes_per_s is not None:
        network = NetworkSpec(nics_per_node=devices_per_node,
                              bw_per_nic_bytes_per_s=inter_bw_bytes_per_s, latency_s=latency_s,
                              topology=NetworkTopology.FAT_TREE, oversubscription=1.0,
                              collective_efficiency=perfect, source="toy", latency_source="toy")
    return Profile(name=name, description="hand-built toy node", device=device, node=node,
                   network=network)


def toy_cluster(*, nodes: int = 1, **profile_kwargs):
    """A cluster of ``nodes`` :func:`toy_profile` nodes (keywords go to the profile)."""
    from ..hardware import NodeGroup, compose_cluster
    if nodes > 1 and profile_kwargs.get("inter_bw_bytes_per_s") is None:
        profile_kwargs["inter_bw_bytes_per_s"] = 1e10
    return compose_cluster([NodeGroup(toy_profile(**profile_kwargs), nodes)], name="toy")
