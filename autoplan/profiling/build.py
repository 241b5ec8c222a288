"""Assembling the ranks' raw measurements into a :class:`~autoplan.hardware.profiles.Profile`
(:func:`build_profile`), the median of several runs (:func:`median_raw`), and the summary
``autoplan profile`` prints."""

from __future__ import annotations

import datetime as _dt
import re
import socket
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..hardware.collectives import CollectiveOp, ring_coefficients
from ..hardware.profile_records import cuda_architecture
from ..hardware.profiles import (COLLECTIVE_OPS, CollectiveEfficiency, CollectiveLatency,
                                 DeviceType, IntraNodeTopology, NodeSpec, OpOverhead, Profile)
from .attention import tabulate_attention
from .collectives import (ARRIVAL_LOOP, ARRIVAL_ROUNDS, ARRIVAL_WORK_CALLS, WORK_FLOPS,
                          fit_alpha_beta, one_device_node)
from .elementwise import tabulate_elementwise
from .fp8 import fp8_tables
from .grouped_gemm import tabulate_grouped_gemms
from .matmul import tabulate_matmuls
from .overhead import (OPTIMIZER_LARGE, OPTIMIZER_TENSORS, OVERHEAD_BLOCKS, OVERHEAD_BLOCK_OPS,
                       OVERHEAD_WIDTH)
from .parallel import (CP_BATCHES, CP_CALLS, CP_ROUNDS, FSDP_LINEARS, FSDP_ROUNDS, FSDP_WIDTHS,
                       PIPELINE_MICRO_BATCHES, PIPELINE_ROUNDS, TP_BYTES_SHAPE, TP_PAIR_ROUNDS,
                       cp_bytes)
from .reference import (HOST_SPLIT_NOT_APPLIED, REFERENCE_BLOCKS, REFERENCE_SHAPE,
                        REFERENCE_SMALL_SHAPE, reference_engine, reference_scales,
                        reference_selective_byte_s)
from .timing import ProfilingFailed, fmt_bytes, tp_measured_in_pairs


def median_raw(raws: list[Any]) -> Any:
    """The figure-by-figure median of several runs' raw measurements (``result.json``
    payloads of one machine and one plan): numbers by their median, dicts key by key,
    lists item by item; anything else (names, flags) as the first run has it.

    Raises
    ------
    ProfilingFailed
        When the runs' structures differ (a key or a list length), which one plan on one
        machine never gives."""
    first = raws[0]
    if isinstance(first, dict):
        if any(not isinstance(r, dict) or r.keys() != first.keys() for r in raws):
            raise ProfilingFailed("the profiling runs measured different things")
        return {k: median_raw([r[k] for r in raws]) for k in first}
    if isinstance(first, list):
        if any(not isinstance(r, list) or len(r) != len(first) for r in raws):
            raise ProfilingFailed("the profiling runs measured different things")
        return [median_raw(list(items)) for items in zip(*raws)]
    if (isinstance(first, (int, float)) and not isinstance(first, bool)
            and any(r != first for r in raws)):
        return statistics.median(raws)
    return first     # the same in every run (sizes, counts), or not a number


def profile_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    return name or "local"


def build_profile(name: str, raw: dict[str, Any], *, cuda: bool, nproc: int, threads: int,
                  devices_per_node: int, quick: bool, copy_bytes: int,
                  cores: int | None = None, runs: int = 1) -> tuple[Profile, dict[str, Any]]:
    host = socket.gethostname()
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    how = (f"measured by `autoplan profile{' --quick' if quick else ''}"
           f"{f' --repeat {runs}' if runs > 1 else ''}` on {host} at {when}, "
           f"{nproc} rank{'s' if nproc > 1 else ''} at once"
           + ("" if cuda else f", {threads} thread(s) per rank")
           + (f", each figure the median of {runs} runs" if runs > 1 else ""))
    ranks = raw["ranks"]

    # matmul: the slowest rank at each size; peak = best of those
    peaks, tables, throughput = tabulate_matmuls(ranks, how, bool(raw.get("shares_cores")))
    fp8_peak, fp8, fp8_points = fp8_tables(ranks, how)
    if fp8_peak is not None:          # FP8 GEMMs timed (CUDA, capability 8.9+)
        peaks["fp8"] = fp8_peak
        tables.update(fp8)
        throughput.update(fp8_points)
    copy_bytes_per_s = min(2.0 * copy_bytes / r["copy_s"] for r in ranks)
    memory = min(int(r["info"]["memory_bytes"]) for r in ranks)
    if not cuda:
        memory //= nproc  # the ranks share the RAM
    names = sorted({r["info"]["name"] for r in ranks})
    device_name = (" / ".join(names) if cuda
                   else f"CPU {names[0]} ({threads} thread{'s' if threads > 1 else ''} per rank)")
    # the architecture keys the fitted figures (autoplan.cost.calibration); the slowest
    # rank's capability stands for all (ranks of one profile are one device kind)
    architecture = (cuda_architecture(*min(tuple(r["info"].get("capability", (0, 0)))
                                           for r in ranks)) if cuda else "cpu")
    op_overhead = None
    # the slowest rank decides, as for the matmuls
    worst = ({k: max(r["overhead"][k] for r in ranks) for k in ranks[0]["overhead"]}
             if all(r.get("overhead") for r in ranks) else None)
    if cuda and worst is not None:
        op_overhead = OpOverhead(
            **worst,
            source=(f"{how}: the host's time, {OVERHEAD_BLOCKS} tiny transformer blocks on the "
                    f"GPU (modules, width {OVERHEAD_WIDTH}: each kernel takes less than its "
                    "launch), the forward per operator they dispatch and forward + backward "
                    "less the forward per autograd node; one block's extra of forward + "
                    "backward under torch's selective checkpoint, per operator its forward "
                    "dispatches; the optimizer, tensor-parallel and zero-bubble figures not "
                    "measured (0). "
                    "The host runs ahead of the GPU: the cost model takes the larger of the "
                    "two per layer"))
    elif worst is not None:
        tp_in_pairs = tp_measured_in_pairs(nproc)
        op_overhead = OpOverhead(
            **worst,
            source=(f"{how}: {OVERHEAD_BLOCKS} tiny transformer blocks (modules, width "
                    f"{OVERHEAD_WIDTH}, arithmetic negligible), the forward per operator they "
                    "dispatch and forward + backward less the forward per autograd node "
                    f"(and both per captured operator, {OVERHEAD_BLOCK_OPS} a block); one "
                    "block's extra of forward + backward under torch's selective checkpoint, "
                    "per operator its forward dispatches; "
                    + ("the blocks' extra of forward + backward with the backward split as "
                       "torch's zero-bubble schedules split it, per autograd node; "
                       if "zero_bubble_node_s" in worst else "")
                    + "tensor-parallel linears: a ColwiseParallel + "
                    "RowwiseParallel MLP less the same MLP unsharded, per linear: "
                    + ("on two-rank groups, every pair at once, in the main thread's CPU "
                       "time, less one all-reduce of the same bytes each way, the median of "
                       f"{TP_PAIR_ROUNDS} rounds"
                       + ("; per byte of a collective's payload: the MLP at width "
                          f"{TP_BYTES_SHAPE[1]} on {TP_BYTES_SHAPE[0]} tokens less at the "
                          "tiny width, each less the MLP a rank computes and one all-reduce, "
                          "over the payloads' difference"
                          if "tp_collective_byte_s" in worst else "")
                       + ("; a column linear sharing its region's input (q, k, v): a region "
                          "of two column linears and a row linear less a region of one, "
                          "each less the same modules unsharded"
                          if "tp_shared_linear_forward_s" in worst else "")
                       if tp_in_pairs else
                       "on a one-rank mesh, plus the functional all-reduce's own time once "
                       "each way")
                    + ("" if nproc > 1 else " (one rank: not measured, 0)")
                    + f"; optimizer: the fused AdamW step autoplan.parallelize builds, over "
                    f"{OPTIMIZER_TENSORS} tiny parameters, plain and as DTensors on a one-rank "
                    f"mesh, per tensor; over {OPTIMIZER_LARGE[0]} of {OPTIMIZER_LARGE[1]} fp32 "
                    "elements less that, per element"
                    + ("" if nproc > 1 else " (DTensor on one rank: not measured, 0)")
                    + ("" if "pipeline_action_s" not in worst else
                       f"; pipeline: a two-stage 1F1B of {PIPELINE_MICRO_BATCHES} "
                       "micro-batches of a tiny linear on pairs of ranks, every pair at once, "
                       "less the same module's forward and backward without it, per stage "
                       "action: the main thread's CPU time, and the other threads' (gloo's "
                       "transport) per message end, the ranks' mean, the median of "
                       f"{PIPELINE_ROUNDS} rounds"
                       + (f", times the {nproc} ranks over the cores they share"
                          if raw.get("shares_cores") else "")
                       if nproc % 2 == 0
                       else "; pipeline: not measured ("
                       + ("one rank" if nproc == 1 else "an odd number of ranks") + "), 0")
                    + ("; FSDP2 beyond its collectives: two units of "
                       f"{FSDP_LINEARS} linears at widths {FSDP_WIDTHS[0]} and "
                       f"{FSDP_WIDTHS[1]} on pairs of ranks, every pair at once, wall time: "
                       "ZeRO-2's forward + backward (a reduce-scatter each) less the units "
                       "without fully_shard, ZeRO-3's (two gathers more) less ZeRO-2's, "
                       "replicate's (one all-reduce of both units) less the units without "
                       "it, each less the raw collectives of the same bytes, per call and per "
                       "byte from the two widths, the median of "
                       f"{FSDP_ROUNDS} rounds" if "fsdp_gather_call_s" in worst else "")
                    + ("; context-parallel collectives in a step: linears then an attention "
                       "core over keys and values gathered by the runtime's "
                       "gather_sequence on pairs of ranks, every pair at once, each rank's "
                       f"clock over {CP_CALLS} calls, forward and forward + backward, less "
                       "the same with a local stand-in for the collective, less the raw "
                       "all-gather and reduce-scatter of the same bytes back to back, per "
                       "call and per byte gathered from "
                       + " and ".join(fmt_bytes(cp_bytes(b)) for b in CP_BATCHES)
                       + f", the medians of {CP_ROUNDS} rounds"
                       if "cp_gather_call_s" in worst else "")
                    + ("; the ranks share cores: all but the tensor-parallel figures timed "
                       "each rank free-running, every rank busy, the fastest of a few windows "
                       "of the ranks' mean" if raw.get("shares_cores") else "")))
    attention, attention_table = tabulate_attention(ranks, peaks, how)
    elementwise_rates = tabulate_elementwise(ranks, how, bool(raw.get("shares_cores")), cuda)
    grouped_tables = tabulate_grouped_gemms(ranks, peaks, how)
    device = DeviceType(
        name=device_name, architecture=architecture, peak_flops_per_s=peaks, memory_bytes=memory,
        memory_bw_bytes_per_s=copy_bytes_per_s, matmul_efficiency=tables, op_overhead=op_overhead,
        measured=True, attention_efficiency=attention_table, elementwise_rates=elementwise_rates,
        grouped_matmul_efficiency=grouped_tables or None,
        source=(f"{how}. Peaks are the best measured matmul throughput, not datasheet figures; "
                + ("memory is the smallest GPU's total memory; " if cuda else
                   f"memory is the physical RAM divided among the {nproc} ranks; ")
                + "bandwidth is tensor-copy bytes (read + write) per second per device"))
    reference = ([max(float(r["reference"][i]) for r in ranks)
                  for i in range(min(len(r["reference"]) for r in ranks))]
                 if op_overhead is not None and all(r.get("reference") for r in ranks) else None)
    if reference is not None and not (reference[0] > 0 and reference[1] > 0):
        # a timing that came out empty (a machine too busy to time the blocks apart):
        # the profile keeps its per-operator figures, without layer scales, and says so
        assert op_overhead is not None
        op_overhead = replace(op_overhead, source=op_overhead.source + (
            f"; no layer scales: the reference blocks' timing came out "
            f"{reference[0] * 1e3:.2f} ms forward, {reference[1] * 1e3:.2f} ms backward"))
        device = replace(device, op_overhead=op_overhead)
        reference = None
    if reference is not None:
        # the slowest rank's reference blocks against their price from the figures above
        assert op_overhead is not None
        engine = reference_engine(device)
        scale_fwd, scale_bwd, priced, _ = reference_scales(device, tuple(reference[:2]),
                                                           engine)
        # measurements taken before the second shape have three figures; its split is
        # stated, not applied (HOST_SPLIT_NOT_APPLIED)
        two = len(reference) > 4
        fit = (reference_scales(device, tuple(reference[:2]) + tuple(reference[3:5]), engine)
               if two else None)
        host_scales = fit[3] if fit else None
        b, seq, width = REFERENCE_SHAPE
        small_b, small_seq = REFERENCE_SMALL_SHAPE
        selective = ""
        if len(reference) > 2:      # measurements taken before it have two figures
            per_byte, ops_s, nbytes = reference_selective_byte_s(device, reference[2], engine)
            op_overhead = replace(op_overhead, selective_byte_s=per_byte)
            selective = (f"; selective recompute per activation byte: the same blocks, each "
                         f"under a selective checkpoint recomputing nothing, "
                         f"{reference[2] * 1e3:.2f} ms more forward + backward, less "
                         f"{ops_s * 1e3:.2f} ms for their operators at the per-operator figure, "
                         f"over the {nbytes / 2**20:.1f} MiB they save without recompute")
        if host_scales is not None:
            split = (f"; and on {small_b} x {small_seq} tokens timed whole "
                     f"({reference[3] * 1e3:.2f} ms forward, {reference[4] * 1e3:.2f} ms "
                     f"backward): the price's host work and the rest fitted to both would "
                     f"scale the layers x{fit[0]:.3f} forward, x{fit[1]:.3f} backward and "
                     f"their host work x{host_scales[0]:.3f}, x{host_scales[1]:.3f} (not applied: "
                     f"{HOST_SPLIT_NOT_APPLIED})")
        elif two:
            split = (f"; on {small_b} x {small_seq} tokens ({reference[3] * 1e3:.2f} "
                     f"ms forward, {reference[4] * 1e3:.2f} ms backward) no positive split of "
                     "host work and arithmetic")
        else:
            split = ""
        op_overhead = replace(
            op_overhead, layer_forward_scale=scale_fwd, layer_backward_scale=scale_bwd,
            source=op_overhead.source + (
                f"; layer scales: {REFERENCE_BLOCKS} such blocks at width {width} on "
                f"{b} x {seq} tokens timed whole ({reference[0] * 1e3:.2f} ms forward, "
                f"{reference[1] * 1e3:.2f} ms backward"
                + (", each rank free-running, every rank busy" if raw.get("shares_cores")
                   else "")
                + f") over the cost model's price for them from this profile's other figures "
                f"({priced[0] * 1e3:.2f} + {priced[1] * 1e3:.2f} ms){split}" + selective))
        device = replace(device, op_overhead=op_overhead)

    backend = "NCCL" if cuda else "gloo"
    if nproc == 1:
        node = one_device_node(copy_bytes_per_s, how, cuda)
        profile = Profile(name=name, description=f"Measured on {host}: {device_name}, 1 device",
                          device=device, node=node, network=None)
        return profile, {"matmul_flops_per_s": throughput, "copy_bytes_per_s": copy_bytes_per_s,
                         "attention": attention}

    # collectives: t = a + b S  ->  bus bandwidth factor / b, per-step latency a / steps
    fits: dict[str, dict[str, float]] = {}
    for op in COLLECTIVE_OPS:
        sizes = [float(s) for s, _ in raw["comm"][op]]
        times = [float(t) for _, t in raw["comm"][op]]
        a, b = fit_alpha_beta(sizes, times)
        factor, steps = ring_coefficients(CollectiveOp(op), 2 if op == "p2p" else nproc)
        fits[op] = {"alpha_s": a, "beta_s_per_byte": b, "bus_bw_bytes_per_s": factor / b,
                    "latency_per_step_s": a / steps}
    bus = max(f["bus_bw_bytes_per_s"] for f in fits.values())
    latency = statistics.median(f["latency_per_step_s"] for f in fits.values())
    fit_text = "; ".join(f"{op} {f['bus_bw_bytes_per_s'] / 1e9:.3g} GB/s, "
                         f"{f['latency_per_step_s'] * 1e6:.3g} us/step" for op, f in fits.items())
    efficiency = CollectiveEfficiency(
        **{op: max(1e-6, min(1.0, f["bus_bw_bytes_per_s"] / bus)) for op, f in fits.items()},
        source=f"{how}: each operation's fitted bus bandwidth over the best ({fit_text})")
    op_latency = CollectiveLatency(
        **{op: f["latency_per_step_s"] for op, f in fits.items()},
        source=f"{how}: each operation's fitted latency (t = a + b S, the mean of every timed call"
               + (f", each after a {WORK_FLOPS / 1e6:.0f}-MFLOP matmul, less the matmul"
                  if raw.get("comm_after_compute") else "")
               + (f"; the ranks share cores: p2p after a {WORK_FLOPS / 1e6:.0f}-MFLOP matmul, "
                  "every pair of ranks at once, less the matmul, the others back to back"
                  if raw.get("shares_cores") else "")
               + ") over its ring steps")
    # more ranks than cores: they share them (a rank runs faster while others wait)
    shared = cores if not cuda and cores is not None and cores < devices_per_node else None
    arrival = float(raw.get("arrival_s", 0.0)) if shared is not None else 0.0
    node = NodeSpec(
        devices_per_node=devices_per_node, shared_cores=shared,
        topology=IntraNodeTopology.UNIFORM if cuda else IntraNodeTopology.SHARED_MEMORY,
        bw_unidir_bytes_per_s=bus, latency_s=latency, collective_efficiency=efficiency,
        collective_latency=op_latency,
        arrival_s=arrival,
        arrival_source=(f"{how}: a 16-byte all-reduce after {ARRIVAL_WORK_CALLS} "
                        f"{WORK_FLOPS / 1e6:.0f}-MFLOP matmuls, over every rank and over "
                        "pairs of ranks, less the matmuls alone (free-running) less the "
                        f"all-reduce back to back, each the ranks' mean of {ARRIVAL_LOOP} "
                        f"calls; the mean of {ARRIVAL_ROUNDS} rounds")
                       if arrival else None,
        source=f"{how}: the best {backend} bus bandwidth of any collective (ring model fit)",
        latency_source=f"{how}: median over the collectives of the fitted per-step latency")
    profile = Profile(name=name,
                      description=f"Measured on {host}: {device_name}, {devices_per_node} devices",
                      device=device, node=node, network=None)
    measurements = {"matmul_flops_per_s": throughput, "copy_bytes_per_s": copy_bytes_per_s,
                    "collective_fits": fits, "collective_times_s": raw["comm"],
                    "attention": attention}
    return profile, measurements


def profile_summary(profile: Profile, path: Path, elapsed: float) -> str:
    d, n = profile.device, profile.node
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in d.peak_flops_per_s.items())
    effs = ", ".join(f"{op} {getattr(n.collective_efficiency, op):.2f}" for op in COLLECTIVE_OPS)
    return "\n".join([
        f"wrote {path} in {elapsed:.1f} s (load it with autoplan.load_cluster({str(path)!r}))",
        f"  device   {d.name} x {n.devices_per_node}",
        f"  matmul   best GFLOP/s: {peaks}",
        f"  memory   {d.memory_bytes / 2**30:.2f} GiB per device, copy {d.memory_bw_bytes_per_s / 1e9:.2f} GB/s",
        *([f"  memory-bound operators (forward/backward GB/s of their bytes): " + ", ".join(
            f"{k} {d.elementwise_rates.forward_bytes_per_s[k] / 1e9:.1f}/"
            f"{d.elementwise_rates.backward_bytes_per_s[k] / 1e9:.1f}"
            for k in d.elementwise_rates.forward_bytes_per_s)]
          if d.elementwise_rates is not None else []),
        *([f"  link     {n.bw_unidir_bytes_per_s / 1e9:.3f} GB/s bus bandwidth, "
           f"{n.latency_s * 1e6:.1f} us per step",
           f"  collective efficiency: {effs}"] if n.devices_per_node > 1 else
          ["  link     none: one device, no collective measured"]),
        *(["  latency per step: " + ", ".join(
            f"{op} {n.collective_latency.of(op) * 1e6:.0f} us" for op in COLLECTIVE_OPS)]
          if n.collective_latency is not None else []),
        *([f"  attention {len(d.attention_efficiency.points)} points, "
           + ", ".join(f"{e:.2f}" for _, e in d.attention_efficiency.points)
           + " of the 16-bit peak (causal SDPA, forward + backward)"]
          if d.attention_efficiency is not None else []),
        *([f"  grouped GEMM {dtype} {len(t.points)} points, "
           + ", ".join(f"{e:.2f}" for _, e in t.points)
           + " of the peak (MoE experts, by rows per expert)"
           for dtype, t in (d.grouped_matmul_efficiency or {}).items()]),
        *([f"  after compute: +{n.arrival_s * 1e6:.0f} us per collective call (ranks share "
           f"{n.shared_cores} cores)"] if n.arrival_s else []),
        *([f"  overhead {d.op_overhead.forward_dispatch_s * 1e6:.1f} us per dispatched operator "
           f"forward, {d.op_overhead.backward_node_s * 1e6:.1f} us per autograd node backward; "
           f"tensor-parallel linear "
           f"+{d.op_overhead.tp_linear_forward_s * 1e6:.0f} + "
           f"{d.op_overhead.tp_linear_backward_s * 1e6:.0f} us"
           + (f" + {d.op_overhead.tp_collective_byte_s * 2**20 * 1e3:.2f} ms per MiB of its "
              "collectives" if d.op_overhead.tp_collective_byte_s else "")
           + (f", one sharing its region's input "
              f"+{d.op_overhead.tp_shared_linear_forward_s * 1e6:.0f} + "
              f"{d.op_overhead.tp_shared_linear_backward_s * 1e6:.0f} us"
              if d.op_overhead.tp_shared_linear_forward_s is not None
              and d.op_overhead.tp_shared_linear_backward_s is not None else "")
           + "; optimizer "
           f"{d.op_overhead.optimizer_param_s * 1e6:.0f} us per parameter tensor, "
           f"{d.op_overhead.optimizer_dtensor_param_s * 1e6:.0f} us per DTensor, "
           f"{d.op_overhead.optimizer_element_s * 1e9:.2f} ns per element; zero-bubble "
           f"split backward +{d.op_overhead.zero_bubble_node_s * 1e6:.1f} us per autograd "
           f"node; pipeline "
           f"{d.op_overhead.pipeline_action_s * 1e6:.0f} us per stage action + "
           f"{d.op_overhead.pipeline_message_s * 1e6:.0f} us per message end"
           + (f"; layers x{d.op_overhead.layer_forward_scale:.2f} forward, "
              f"x{d.op_overhead.layer_backward_scale:.2f} backward their parts' sum"
              if d.op_overhead.layer_forward_scale is not None
              and d.op_overhead.layer_backward_scale is not None else "")
           + (f", their host work x{d.op_overhead.host_forward_scale:.2f}, "
              f"x{d.op_overhead.host_backward_scale:.2f}"
              if d.op_overhead.host_forward_scale is not None
              and d.op_overhead.host_backward_scale is not None else "")
           + (f"; selective recompute +{d.op_overhead.selective_byte_s * 1e9:.2f} ns per "
              "activation byte" if d.op_overhead.selective_byte_s else "")
           + (f"; FSDP2 +{d.op_overhead.fsdp_gather_call_s * 1e3:.2f} ms + "
              f"{d.op_overhead.fsdp_gather_byte_s * 2**20 * 1e3:.2f} ms/MiB a gather, "
              f"+{d.op_overhead.fsdp_reduce_call_s * 1e3:.2f} ms + "
              f"{d.op_overhead.fsdp_reduce_byte_s * 2**20 * 1e3:.2f} ms/MiB a reduce-scatter"
              if d.op_overhead.fsdp_measured else "")
           + (f"; replicate +{d.op_overhead.replicate_call_s * 1e3:.2f} ms + "
              f"{d.op_overhead.replicate_byte_s * 2**20 * 1e3:.2f} ms/MiB an all-reduce"
              if d.op_overhead.replicate_measured else "")
           + (f"; context parallelism in a step +{d.op_overhead.cp_gather_call_s * 1e3:.2f} "
              f"ms + {d.op_overhead.cp_gather_byte_s * 2**20 * 1e3:.2f} ms/MiB an all-gather, "
              f"+{d.op_overhead.cp_scatter_call_s * 1e3:.2f} ms + "
              f"{d.op_overhead.cp_scatter_byte_s * 2**20 * 1e3:.2f} ms/MiB a reduce-scatter"
              if d.op_overhead.cp_measured else "")]
          if d.op_overhead else []),
    ])
