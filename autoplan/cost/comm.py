"""Communication terms of the cost engine: collectives per layer and micro-batch.

* :func:`collective_time`: one collective over a group of devices
  (:meth:`Cluster.collective_time <autoplan.hardware.Cluster.collective_time>`, cached).
* :func:`rank_groups`: the tensor-, data-, context- and expert-parallel groups of a
  replica on a pipeline rank.
* :func:`layer_terms`: everything one layer adds to its rank per micro-batch, its
  compute (:mod:`autoplan.cost.compute`) with the collectives around it: tensor
  parallelism's (Shoeybi et al. 2019, Sec. 3; Korthikanti et al. 2022, Sec. 4.2.2) and
  the vocabulary-parallel loss's, context parallelism's key/value all-gathers and
  reduce-scatters (Dubey et al. 2024, Sec. 3.3.2), expert parallelism's token
  all-to-alls (Lepikhin et al. 2021; :func:`dispatch_bytes`, :func:`dispatch_share`),
  ZeRO-2/3's per-micro-batch gathers and reduce-scatters (Rajbhandari et al. 2020,
  Sec. 5.3; Zhao et al. 2023, Sec. 3.3) with the prefetch overlap
  (:func:`prefetch_exposed`), and what is exposed of each.
* :func:`fp8_step_scales`: torchao's per-step scale all-reduces of FP8 all-gathers;
  :func:`loss_reduce_s`: the step's closing loss all-reduce.

The module docstring of :mod:`autoplan.cost.engine` says where each figure comes from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..graph import LayerKind
from ..precision import DTYPE_BYTES
from ..strategy import Precision, Recompute
from . import fp8 as _fp8
from .compute import _host_s, _selective_dispatch_s, host_runs_ahead
from .layout import Layout, PrecisionCosts, Segment, _ledger_dtypes
from .ledger import LedgerBuilder
from .memory import _largest_module_local, _local_params
from .summary import LayerCost

if TYPE_CHECKING:
    from .engine import CostEngine

__all__ = ["prefetch_exposed", "collective_time", "rank_groups", "layer_terms",
           "layer_time_bound", "module_shares", "dispatch_bytes", "routing_weight_bytes",
           "dispatch_share", "fp8_step_scales", "loss_reduce_s", "LOSS_REDUCE_BYTES"]


#: Bytes of the step's closing loss all-reduce (:attr:`CostOptions.step_loss_all_reduce`):
#: the loss sum and the sequence count, float64 (``ParallelModel.step``).
LOSS_REDUCE_BYTES = 16


#: Bytes of one count of the token counts a MoE layer's ranks exchange before each
#: dispatch (int64, one per expert: ``autoplan.runtime.ep``, step 1)
COUNT_BYTES = 8


#: The vocabulary-parallel loss (``CostOptions.loss_parallel``): all-reduces per micro-batch
#: over the tensor-parallel group (the logits' max, the sum of their exponentials, the
#: target's logit; torch's ``loss_parallel``, counted on 2 gloo ranks) and bytes per token
#: of each (one fp32 number)
LOSS_PARALLEL_REDUCES = 3


LOSS_PARALLEL_BYTES = 4


def _no_volume(_: tuple) -> None:
    """A ``volumes`` sink for a layer priced without a ledger."""


def prefetch_exposed(shares: tuple[float, ...], compute_s: float, comm_s: float) -> float:
    """Seconds a one-ahead prefetch leaves exposed over one layer's modules.

    Module ``i`` computes for ``compute_s * shares[i]`` while the next module's gather
    (``comm_s * shares[i + 1]``; after the last module, the first of the next layer, alike)
    runs; a gather issued when its predecessor starts, as DeepSpeed ZeRO-3 does with a
    prefetch bucket smaller than a module (``stage3_prefetch_bucket_size``, 5e7 elements by
    default), is waited for by the amount it outlasts that module.  Equal shares give
    ``max(0, comm_s - compute_s)``, the layer-wise overlap; unequal ones expose more: a
    large module's gather hides only under the small module before it.

    >>> round(prefetch_exposed((0.5, 0.5), 1.0, 1.2), 6)
    0.2
    >>> round(prefetch_exposed((0.25, 0.75), 1.0, 1.0), 6)
    0.5
    """
    k = len(shares)
    return sum(max(0.0, comm_s * shares[(i + 1) % k] - compute_s * shares[i]) for i in range(k))


class _LayerTerms(NamedTuple):
    """Everything one layer adds to its pipeline rank per micro-batch (see the module
    docstring; :meth:`CostEngine._layer_terms`).  ``<kind>_total_s`` are the seconds of
    that kind of communication, ``<kind>_exposed_s`` the part of them compute does not hide."""

    forward_compute_s: float
    backward_compute_s: float
    recompute_s: float
    weight_grad_s: float
    tp_total_s: float
    tp_exposed_s: float
    cp_total_s: float
    cp_exposed_s: float
    zero_total_s: float
    zero_exposed_s: float
    forward_s: float            # forward with its exposed communication
    backward_s: float           # backward, recompute included, with its exposed communication
    local_params: float         # parameters on this device outside the expert banks
    gather_unit_params: float   # parameters ZeRO-3 gathers at once (a layer or a module)
    saved_bytes: float          # activations saved for the backward (after recompute)
    working_bytes: float        # activations the layer holds while it is (re)computed
    ep_total_s: float
    ep_exposed_s: float
    local_expert_params: float  # parameters on this device in expert banks (ZeRO shards
                                # them over the edp group, the rest over dp x cp)
    cp_waits_s: float           # the part of cp_exposed_s that ranks sharing cores wait
                                # for each other's turn (OpOverhead.cp_gather_call_s)


class _RankGroups(NamedTuple):
    """The device groups of one replica on one pipeline rank, at tensor-parallel index 0
    (:meth:`CostEngine._groups`)."""

    replica: tuple[int, ...]        # the replica's devices on this rank (cp x tp)
    tp: tuple[int, ...]             # the tp group priced: the one spanning the most nodes
    dp: tuple[int, ...]             # same tp index on every replica: dp x cp members
    dp_concurrency: int | None      # concurrent_groups of data-parallel collectives
    dp_key: tuple                   # stands for the dp group in collective cache keys
    cp: tuple[int, ...]             # same tp index in this replica; () without cp
    ep: tuple[int, ...]             # the ep members sharing one copy of the experts
    edp: tuple[int, ...]            # the members holding the same experts (their gradients)
    ep_key: tuple                   # stands for the ep and edp groups in cache keys


def fp8_step_scales(engine: CostEngine, chunks, recipe: PrecisionCosts, groups: "_RankGroups",
                    ledger: LedgerBuilder | None) -> tuple[float, float]:
    """Seconds of the step's scale all-reduces of the weights torchao all-gathers in
    FP8 on a rank holding ``chunks`` (one per chunk over the data-parallel group, and one
    over the tensor-parallel group where it splits them too: 4 bytes a weight), and of
    reading those weights' shards for their maxima (``_foreach_norm``)."""
    shards = len(groups.dp)
    device = engine.device_of(groups.replica)
    seconds = read = 0.0
    for chunk in chunks:
        weights, params = 0, 0.0
        for seg in chunk:
            for template, count in engine.layer_counts(seg.lo, seg.hi):
                fp8 = engine._fp8_terms(engine._templates[template], seg, recipe, shards)
                if fp8 is not None and fp8.gathered_params:
                    weights += count * len(fp8.converted)
                    params += count * fp8.gathered_params
        if not weights:
            continue
        nbytes = weights * _fp8.SCALE_BYTES
        tp = chunk[0].tp
        seconds += engine.collective_time("all_reduce", groups.dp, nbytes)
        if tp > 1:
            tp_group = groups.tp if tp == len(groups.tp) else groups.replica[:tp]
            seconds += engine.collective_time("all_reduce", tp_group, nbytes)
        read += params / shards * DTYPE_BYTES["fp32"] / device.memory_bw_bytes_per_s
        if ledger is not None:
            ledger.per_step("all_reduce", "dp", "fp32", nbytes, 1, "fp8")
            if tp > 1:
                ledger.per_step("all_reduce", "tp", "fp32", nbytes, 1, "fp8")
    return seconds, read


def collective_time(engine: CostEngine, op: str, group: tuple[int, ...], nbytes: float,
                    concurrent: int | None = None, group_key: tuple | None = None, *,
                    after_compute: bool = True) -> float:
    """Seconds of collective ``op`` sending ``nbytes`` per rank over ``group``
    (:meth:`Cluster.collective_time <autoplan.hardware.Cluster.collective_time>`,
    cached); ``concurrent`` its ``concurrent_groups``.  ``group_key`` stands for a
    large ``group`` in the cache key (``(first device, size, hash)``: hashing the
    group once per rank, not per call); ``after_compute=False``: without the node's
    arrival cost.  Zero for one device or no bytes."""
    if len(group) <= 1 or nbytes <= 0:
        return 0.0
    key = (op, group if group_key is None else group_key, nbytes, concurrent, after_compute)
    t = engine._collective_times.get(key)
    if t is None:
        t = engine.cluster.collective_time(op, group, nbytes, concurrent_groups=concurrent,
                                         after_compute=after_compute)
        engine._collective_times[key] = t
    return t


def loss_reduce_s(engine: CostEngine, lay: Layout) -> float:
    """Seconds of the step's closing all-reduce of its mean loss over every rank of
    the layout (:attr:`CostOptions.step_loss_all_reduce`): two float64 numbers."""
    devices = tuple(sorted({i for devs in lay.rank_devices for i in devs}))
    return engine.collective_time("all_reduce", devices, LOSS_REDUCE_BYTES,
                                group_key=("world", devices[0], len(devices),
                                           hash(devices)))


def layer_terms(engine: CostEngine, layer: LayerCost, seg: Segment, b: int, cp: int, device,
                recipe: PrecisionCosts, groups: _RankGroups, ep: int = 1,
                volumes: list | None = None) -> _LayerTerms:
    """Everything one layer of segment ``seg`` adds to its rank per micro-batch of
    ``b`` sequences on ``device`` (see the module docstring), its collectives over
    ``groups``.  ``volumes``: a list to append the collectives priced to, as
    ``(kind, group, dtype, bytes, calls, term)`` per micro-batch (:mod:`.ledger`)."""
    vol = volumes.append if volumes is not None else _no_volume
    act_dtype, grad_dtype, param_dtype = _ledger_dtypes(recipe)
    rc_full = seg.recompute is Recompute.FULL and layer.is_block
    s = engine.summary
    opts = engine.options
    t = seg.tp
    act_scale = recipe.activation_scale
    layer_time = engine.template_time(layer.template, b, t, cp, device, recipe.dtype,
                                    seg.sequence_parallel, ep if layer.expert_params else 1)
    forward, backward = layer_time.forward_s, layer_time.backward_s
    # an FP8 recipe that torchao runs: its FP8 all-gathers under ZeRO-3 replace the
    # GEMMs' weight casts by each rank's cast of its shard (autoplan.cost.fp8)
    fp8 = engine._fp8_terms(layer, seg, recipe, len(groups.dp))
    if fp8 is not None and fp8.gathered_params:
        forward -= fp8.weight_cast_s(device) / 2
        backward -= fp8.weight_cast_s(device) / 2
    core = layer_time.core_forward_s
    recompute = 0.0
    overhead = device.op_overhead
    ahead = overhead is not None and host_runs_ahead(device)
    selective = (seg.recompute is Recompute.SELECTIVE and layer.is_block
                 and not opts.fused_attention)
    # the bytes the block saves without recompute, for selective checkpointing's host
    unselected = (engine.activation_bytes(layer, t, seg.sequence_parallel, Recompute.NONE, cp)
                  * b * act_scale if selective and overhead is not None else 0.0)
    if seg.recompute is Recompute.FULL and layer.is_block:
        recompute = forward
    elif selective:
        recompute = core
        if overhead is not None and not ahead:
            recompute += _selective_dispatch_s(overhead, layer,
                                               s.op_counts[layer.template][0], unselected)
    if ahead:
        # a GPU's host dispatches ahead of it: each direction takes the longer of the
        # device's work and the host's (recompute and selective checkpointing's Python
        # mode included), the excess counted as recompute in the backward
        ops = s.op_counts[layer.template][0]
        host_fwd, host_bwd = _host_s(overhead, layer, ops, engine._host_counted)
        if seg.recompute is Recompute.FULL and layer.is_block:
            host_bwd += host_fwd
        elif selective:
            host_bwd += _selective_dispatch_s(overhead, layer, ops, unselected)
        forward = max(forward, host_fwd)
        recompute = max(backward + recompute, host_bwd) - backward
    # tensor-parallel collectives of one layer
    tp_forward = tp_backward = 0.0
    if t > 1:
        tp_group = groups.tp if t == len(groups.tp) else groups.replica[:t]
        colls = layer.sp_collectives if seg.sequence_parallel else layer.tp_collectives
        # a device that prices tensor-parallel linears' host time (CPU profiles) measured
        # it with the linears' own collectives on pairs of ranks, every pair at once
        # where they share cores, as the main thread's core time at every-rank-busy
        # speed: a rank waiting there for its peer lends its core to ranks at work, so
        # the link model's arrival cost is not added (three confirm passes re-priced at
        # 3 ms per linear with it added: 69, 66 and 78 of 81 within 15%, against 77, 64
        # and 77 without, 2026-11-26)
        host = device.op_overhead
        waits_priced = (host is not None and not host_runs_ahead(device)
                        and (host.tp_linear_forward_s > 0 or host.tp_linear_backward_s > 0))
        # and its host work that grows with the payload (OpOverhead.tp_collective_byte_s)
        per_byte = host.tp_collective_byte_s if host is not None and waits_priced else 0.0
        embedding_all_reduce = (seg.sequence_parallel and layer.kind is LayerKind.PRE
                                and opts.sp_embedding_all_reduce)
        for i, (op, phase, nbytes) in enumerate(colls):
            if embedding_all_reduce and op == "reduce_scatter" and phase == "forward":
                # the vocab-parallel embedding's partial sums all-reduced whole, each
                # rank then keeping its sequence shard (CostOptions.sp_embedding_all_reduce)
                op = "all_reduce"
            payload = nbytes * b * act_scale / cp
            dtype = act_dtype
            if (fp8 is not None and seg.sequence_parallel and op == "all_gather"
                    and fp8.gathers_fp8(layer, i, phase)):
                # torchao's float8 styles gather this activation (gradient) in FP8
                payload, dtype = payload * DTYPE_BYTES["fp8"] / DTYPE_BYTES[act_dtype], "fp8"
            seconds = (engine.collective_time(op, tp_group, payload,
                                            after_compute=not waits_priced)
                       + per_byte * payload)
            # (the recomputed forward runs its collectives again, below)
            vol((op, "tp", dtype, payload,
                 2 if rc_full and phase == "forward" else 1, "tp"))
            if phase == "forward":
                tp_forward += seconds
            else:
                tp_backward += seconds
        if layer.index == len(s.layers) - 1 and s.loss_logits:
            # the loss over the head's vocabulary-sharded logits: three all-reduces of
            # one fp32 number per token (max, sum of exponentials, the target's logit;
            # torch's loss_parallel, Megatron's vocab-parallel cross-entropy), or the
            # logits gathered whole on every rank
            tokens = b * (s.seq_len or 1) / cp
            if opts.loss_parallel:
                if s.loss_shifts and cp == 1:
                    tokens -= b         # the last token of a sequence predicts nothing
                nbytes = tokens * LOSS_PARALLEL_BYTES
                tp_forward += LOSS_PARALLEL_REDUCES * engine.collective_time(
                    "all_reduce", tp_group, nbytes, after_compute=not waits_priced)
                vol(("all_reduce", "tp", "fp32", nbytes, LOSS_PARALLEL_REDUCES, "tp"))
            else:
                nbytes = tokens * s.loss_logits * s.activation_bytes * act_scale
                tp_forward += engine.collective_time("all_gather", tp_group, nbytes,
                                                   after_compute=not waits_priced)
                vol(("all_gather", "tp", act_dtype, nbytes, 1, "tp"))
        if fp8 is not None:
            # torchao's scale all-reduces over the tp group (autoplan.cost.fp8)
            for phase, nbytes, n in fp8.amax_reduces(b, cp):
                seconds = n * engine.collective_time("all_reduce", tp_group, nbytes,
                                                   after_compute=not waits_priced)
                vol(("all_reduce", "tp", "float64", nbytes,
                     n * (2 if rc_full and phase == "forward" else 1), "fp8"))
                if phase == "forward":
                    tp_forward += seconds
                else:
                    tp_backward += seconds
    if seg.recompute is Recompute.FULL and layer.is_block:
        tp_backward += tp_forward   # the recomputed forward runs its collectives again
    if opts.tp_comm_overlap:
        tp_forward_exposed = max(0.0, tp_forward - forward)
        tp_backward_exposed = max(0.0, tp_backward - backward - recompute)
    else:
        tp_forward_exposed, tp_backward_exposed = tp_forward, tp_backward
    # context parallelism: all-gather of the block's keys/values (this rank's heads,
    # whole sequences) in the forward, reduce-scatter of their gradients in the
    # backward; the attention core depends on them, so they are exposed
    cp_forward = cp_backward = cp_exposed = cp_waits = 0.0
    if cp > 1 and core > 0 and layer.is_block:
        kv_bytes = s.kv_bytes_per_token * act_scale * s.seq_len * b / t  # type: ignore[operator]
        # and the runtime's copies around them (autoplan.runtime.cp.gather_sequence),
        # memory-bound, read + write: forward, the local keys and values stacked and the
        # gathered ones put in position order; backward, the gradients of keys and
        # values stacked and put back in the gathered layout for the reduce-scatter
        bw = device.memory_bw_bytes_per_s
        cp_forward = (engine.collective_time("all_gather", groups.cp, kv_bytes)
                      + (2 * kv_bytes / cp + 2 * kv_bytes) / bw)
        cp_backward = (engine.collective_time("reduce_scatter", groups.cp, kv_bytes)
                       + 4 * kv_bytes / bw)
        vol(("all_gather", "cp", act_dtype, kv_bytes, 2 if rc_full else 1, "cp"))
        vol(("reduce_scatter", "cp", act_dtype, kv_bytes, 1, "cp"))
        gather_waits = scatter_waits = 0.0
        if (overhead is not None and not ahead and overhead.cp_measured
                and len(groups.cp) < engine._node_devices(groups.cp[0])):
            # where ranks share cores, a collective between compute waits for its peers
            # to be scheduled while the node's other ranks compute: what a step pays
            # beyond the back-to-back time, measured in place on pairs of ranks
            # (OpOverhead.cp_gather_call_s).  Not where the group holds every rank of
            # the node: none computes meanwhile.  (The 18 stored confirm passes of
            # 2026-11-27/28, re-priced with the figures measured on 2026-11-28
            # written into their profiles: the layouts of cp = 4 on 4 ranks 4-6% fast
            # on average without them, 3-10% slow with them; those of cp pairs 4-12%
            # fast without them, -2% to +5% with them but tp2 cp2 5-8% fast.)
            gather_waits, scatter_waits = overhead.cp_collectives_s(kv_bytes)
        cp_forward += gather_waits
        cp_backward += scatter_waits
        cp_waits = gather_waits + scatter_waits
        if seg.recompute is Recompute.FULL:
            cp_backward += cp_forward   # the recomputed forward gathers again
            cp_waits += gather_waits
        cp_exposed = cp_forward + cp_backward
    # expert parallelism: the token dispatch and combine all-to-alls over the ep group
    # in the forward, their transposes in the backward (again under full recompute);
    # blocking, so exposed
    ep_forward = ep_backward = 0.0
    if ep > 1 and layer.expert_tokens:
        combine = engine.dispatch_bytes(layer, b, cp, act_scale, t, groups.ep)
        dispatch = combine + engine.routing_weight_bytes(layer, b, cp, act_scale, t, groups.ep)
        counts = layer.num_experts * COUNT_BYTES
        ep_forward = (engine.collective_time("all_to_all", groups.ep, dispatch)
                      + engine.collective_time("all_to_all", groups.ep, combine)
                      + engine.collective_time("all_to_all", groups.ep, counts))
        ep_backward = (engine.collective_time("all_to_all", groups.ep, dispatch)
                       + engine.collective_time("all_to_all", groups.ep, combine))
        if rc_full:
            ep_backward += ep_forward   # the recomputed forward dispatches again
        runs = 2 if rc_full else 1
        vol(("all_to_all", "ep", act_dtype, dispatch, runs + 1, "ep"))
        vol(("all_to_all", "ep", act_dtype, combine, runs + 1, "ep"))
        vol(("all_to_all", "ep", "int64", counts, runs, "ep"))
    # ZeRO: parameters of this layer on this device (the expert banks' 1/ep of them
    # are sharded over the ep-replicas of the same experts, edp = dp x cp / ep)
    local_params, local_expert_params = _local_params(layer, t, ep)
    if opts.zero3_gather_unit == "module":
        gather_unit = _largest_module_local(layer, t, ep)
    else:
        gather_unit = local_params + local_expert_params
    forward_with_comm = forward + tp_forward_exposed + cp_forward + ep_forward
    backward_with_comm = backward + recompute + tp_backward_exposed + cp_backward + ep_backward
    zero_forward_exposed = zero_backward_exposed = zero_total = 0.0
    zero_degree = len(groups.dp)
    if seg.zero >= 2 and zero_degree > 1 and local_params + local_expert_params > 0:
        dp, edp, concurrent = groups.dp, groups.edp, groups.dp_concurrency
        grads = local_params * recipe.grad_bytes            # reduce-scattered
        expert_grads = local_expert_params * recipe.grad_bytes
        weights = local_params * recipe.param_bytes         # all-gathered (ZeRO-3)
        expert_weights = local_expert_params * recipe.param_bytes
        gather_dtype = param_dtype
        if fp8 is not None and fp8.gathered_params:
            # torchao's FP8 all-gather: the converted weights at one byte, the rest of
            # the unit with them (one byte buffer where dtypes mix)
            weights -= fp8.gathered_params * (recipe.param_bytes - DTYPE_BYTES["fp8"])
            gather_dtype = "uint8" if fp8.gathered_params < local_params else "fp8"
        reduce_scatter = engine.collective_time("reduce_scatter", dp, grads, concurrent) + \
            engine.collective_time("reduce_scatter", edp, expert_grads, concurrent)
        all_gather = engine.collective_time("all_gather", dp, weights, concurrent) + \
            engine.collective_time("all_gather", edp, expert_weights, concurrent) \
            if seg.zero == 3 else 0.0
        if fp8 is not None and fp8.gathered_params:
            # each rank casts its fp32 shard to FP8 before the gather, on its stream
            all_gather += fp8.shard_cast_s(device, zero_degree)
        copy_out = host_gather = host_reduce = 0.0
        fsdp_host = overhead is not None and not ahead and overhead.fsdp_measured
        if fsdp_host:
            # FSDP2's work beyond the collectives where the rank's cores run it (CPU
            # profiles measure it, its copies included): per call (one unit, a layer
            # here) and per byte of what it gathers or reduces; never hidden.  Not on
            # the once-a-step collectives (OpOverhead.fsdp_gather_call_s says why)
            host_reduce = overhead.fsdp_reduce_s(grads + expert_grads)
            if seg.zero == 3:
                host_gather = overhead.fsdp_gather_s(weights + expert_weights)
        elif opts.zero_buffer_copies:
            # FSDP2's flat buffers, memory-bound on the device (read + write): on the
            # collectives' streams the gradients into the reduce-scatter input and the
            # shard into the all-gather input; on the compute stream, once the gather
            # lands, its output into the parameters
            bw = device.memory_bw_bytes_per_s
            reduce_scatter += 2 * (grads + expert_grads) / bw
            if seg.zero == 3:
                gathered = weights + expert_weights
                all_gather += 2 * gathered / zero_degree / bw
                copy_out = 2 * gathered / bw
        # backward: one gather, or two when the recomputed forward gathers again
        gathers_backward = 2 if (opts.zero3_regather_for_recompute and
                                 seg.recompute is Recompute.FULL and layer.is_block) else 1
        all_gather_backward = all_gather * gathers_backward
        vol(("reduce_scatter", "dp", grad_dtype, grads, 1, "zero"))
        if len(edp) > 1:
            vol(("reduce_scatter", "edp", grad_dtype, expert_grads, 1, "zero"))
        if seg.zero == 3:
            vol(("all_gather", "dp", gather_dtype, weights, 1 + gathers_backward, "zero"))
            if len(edp) > 1:
                vol(("all_gather", "edp", param_dtype, expert_weights,
                     1 + gathers_backward, "zero"))
        if opts.overlap_param_gather and seg.zero == 3 and opts.zero3_gather_unit == "module":
            # one module's gather prefetched under the module before it (module_shares)
            shares = engine.module_shares(layer.template)
            zero_forward_exposed = prefetch_exposed(shares, forward_with_comm, all_gather)
            backward_only = backward_with_comm
            if gathers_backward == 2:   # the recomputed forward's gathers, in order
                zero_backward_exposed = prefetch_exposed(shares, recompute, all_gather)
                backward_only -= recompute
            zero_backward_exposed += prefetch_exposed(shares[::-1], backward_only,
                                                      all_gather + reduce_scatter)
        elif opts.overlap_param_gather:
            zero_forward_exposed = max(0.0, all_gather - forward_with_comm)
            zero_backward_exposed = max(0.0, all_gather_backward + reduce_scatter
                                        - backward_with_comm)
        else:
            zero_forward_exposed = all_gather
            zero_backward_exposed = all_gather_backward + reduce_scatter
        zero_forward_exposed += copy_out + host_gather
        zero_backward_exposed += (copy_out + host_gather) * gathers_backward + host_reduce
        zero_total = all_gather + all_gather_backward + reduce_scatter \
            + (copy_out + host_gather) * (1 + gathers_backward) + host_reduce
    # activations
    saved = engine.activation_bytes(layer, t, seg.sequence_parallel, seg.recompute, cp) \
        * b * act_scale
    working = saved
    if seg.recompute is Recompute.FULL and layer.is_block:
        # the layer being recomputed holds all it saves, its checkpoint included
        working = engine.activation_bytes(layer, t, seg.sequence_parallel, Recompute.NONE, cp) \
            * b * act_scale
    return _LayerTerms(   # positional, in field order (keywords cost a search time)
        forward, backward, recompute, layer_time.weight_grad_s,
        tp_forward + tp_backward, tp_forward_exposed + tp_backward_exposed,
        cp_forward + cp_backward, cp_exposed,
        zero_total, zero_forward_exposed + zero_backward_exposed,
        forward_with_comm + zero_forward_exposed, backward_with_comm + zero_backward_exposed,
        local_params, gather_unit, saved, working,
        ep_forward + ep_backward, ep_forward + ep_backward, local_expert_params, cp_waits)


def module_shares(engine: CostEngine, template: str) -> tuple[float, ...]:
    """Each weight-carrying module's share of ``template``'s weight matmul FLOPs, in
    execution order (``(1.0,)`` for a layer with fewer than two): under a per-module
    ZeRO-3 gather (``zero3_gather_unit="module"``) both its gather's and its compute's
    share of the layer's (a linear's FLOPs and parameters are in proportion), the
    attention core and memory-bound operators spread in proportion."""
    hit = engine._module_shares.get(template)
    if hit is None:
        flops = [n.fwd_flops for n in engine.summary.templates[template] if n.weight]
        total = sum(flops)
        hit = tuple(f / total for f in flops) if len(flops) > 1 and total > 0 else (1.0,)
        engine._module_shares[template] = hit
    return hit


def dispatch_bytes(engine: CostEngine, l: LayerCost, b: int, cp: int, act_scale: float,
                   tp: int = 1, group: tuple[int, ...] = ()) -> float:
    """Bytes one rank sends into one token all-to-all of layer ``l`` per micro-batch
    of ``b`` sequences: ``tokens x top-k x hidden x bytes`` (tokens: this rank's
    ``b x seq / cp``, and ``/ tp`` when ``CostOptions.moe_tokens_split_over_tp``),
    its whole send buffer, times :func:`dispatch_share` over the ep ``group`` (its
    devices; none: 1); the collective model sends the ``(ep - 1) / ep`` of it bound for
    other ranks (:mod:`autoplan.hardware.collectives`, pairwise exchange)."""
    if engine.options.moe_tokens_split_over_tp:
        cp = cp * tp
    return (l.expert_tokens * b / cp * l.expert_hidden * engine.summary.activation_bytes
            * act_scale * engine.dispatch_share(l, group))


def routing_weight_bytes(engine: CostEngine, l: LayerCost, b: int, cp: int, act_scale: float,
                         tp: int = 1, group: tuple[int, ...] = ()) -> float:
    """Bytes of the routing weights that travel with one dispatch of layer ``l``: one
    number per token-to-expert assignment sent, in the activations' dtype (the
    Hugging Face routers cast their weights to it; :mod:`autoplan.runtime.ep` sends
    them as one more column of the hidden states)."""
    if engine.options.moe_tokens_split_over_tp:
        cp = cp * tp
    return (l.expert_tokens * b / cp * engine.summary.activation_bytes * act_scale
            * engine.dispatch_share(l, group))


def dispatch_share(engine: CostEngine, l: LayerCost, group: tuple[int, ...]) -> float:
    """The share of a token's ``top-k`` copies that ``CostOptions.moe_dispatcher``
    sends over the ep ``group`` (device indices).

    ``"alltoall"``: 1 (a copy per token-to-expert assignment).  ``"deepep"``: a token
    crosses once to each destination holding any of its experts: the group's nodes
    when it spans several (the inter-node network, the slowest level, carries one copy
    per node; the NVLink fan-out inside a node is not priced apart), else its ranks.
    With ``u`` destinations of ``E / u`` experts each and ``k`` experts drawn uniformly
    without replacement, a destination is missed with probability ``C(E - E/u, k) /
    C(E, k)``, so a token reaches ``u (1 - that)`` of them on average; the share is that
    over ``k``.  (Uniform routing; a router limited to fewer nodes per token, as
    DeepSeek-V3's four, sends less.)
    """
    if engine.options.moe_dispatcher != "deepep" or len(group) < 2 or l.num_experts <= 1:
        return 1.0
    experts = l.num_experts
    k = min(experts, max(1, round(l.expert_tokens / (engine.summary.seq_len or 1))))
    nodes = len({engine._node_of[d] for d in group})
    units = nodes if nodes > 1 else len(group)
    per_unit = experts / units
    missed = 1.0
    for i in range(k):
        missed *= max(0.0, experts - per_unit - i) / (experts - i)
    return min(1.0, units * (1.0 - missed) / k)


def rank_groups(engine: CostEngine, all_devs: tuple[int, ...], tp: int, cp: int, ep: int,
                r: int) -> _RankGroups:
    """The device groups of replica ``r`` on a pipeline rank with devices ``all_devs``
    (rank order dp, cp, tp) at tensor-parallel index 0."""
    replica = all_devs[r * cp * tp:(r + 1) * cp * tp]
    tp_group = replica[:tp]
    cp_at = 0                                               # tp index of the cp group
    node = engine._node_of
    if node[replica[0]] != node[replica[-1]] or replica[-1] - replica[0] != len(replica) - 1:
        # a replica over several nodes: price the tp and cp groups that span the most
        # (a group straddling two NVLink domains is slower than one inside either)
        if tp > 1 and cp > 1:
            tp_group = max((replica[i * tp:(i + 1) * tp] for i in range(cp)),
                           key=lambda g: len({node[d] for d in g}))
        if cp > 1:
            cp_at = max(range(tp), key=lambda i: len({node[d] for d in replica[i::tp]}))
    dp_group = all_devs[0::tp]                              # same tp index: dp x cp members
    # expert parallelism: ep consecutive members of the flattened dp x cp index share
    # one copy of the experts (ep group); the members at the same position of every ep
    # group hold the same experts (edp group, what expert gradients reduce over)
    first = r * cp                                          # replica's first dp x cp index
    ep_group = dp_group[first - first % ep:first - first % ep + ep] if ep > 1 else ()
    edp_group = dp_group[first % ep::ep] if ep > 1 else ()
    cp_group = replica[cp_at::tp] if cp > 1 else ()        # same tp index
    return _RankGroups(replica, tp_group, dp_group, engine._dp_concurrency(dp_group),
                       (dp_group[0], len(dp_group), hash(dp_group)), cp_group,
                       ep_group, edp_group, (ep, ep_group, hash(edp_group)))


def layer_time_bound(engine: CostEngine, template: str, all_devs: tuple[int, ...], tp: int, cp: int,
                     ep: int, sp: bool, b: int, precision: Precision) -> float:
    """Forward plus backward seconds of one micro-batch of a ``template`` layer on the
    pipeline rank with devices ``all_devs`` (replica 0) without recompute or ZeRO-2/3:
    compute and the exposed tensor-, context- and expert-parallel collectives, the
    least any layout of these degrees spends on it (recompute and sharding add).
    What the search bounds step times with."""
    recipe = engine.precision_costs(precision)
    groups = engine._groups(all_devs, tp, cp, ep, 0)
    device = engine.device_of(groups.replica)
    seg = Segment(0, 0, tp, sp, 1, Recompute.NONE)
    key = (template, tp, sp, 1, Recompute.NONE, b, cp, device.name, recipe.dtype,
           recipe.activation_scale, groups.tp, groups.dp_key, groups.cp,
           groups.ep_key)
    terms = engine._terms.get(key)
    if terms is None:
        vols: list = []
        terms = engine._terms[key] = tuple(engine._layer_terms(engine._templates[template], seg, b,
                                                           cp, device, recipe, groups, ep,
                                                           vols))
        engine._volumes[key] = tuple(vols)
    named = _LayerTerms._make(terms)
    return named.forward_s + named.backward_s
