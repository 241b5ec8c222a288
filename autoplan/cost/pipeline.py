"""Pipeline-rank terms of the cost engine: one pipeline rank of one replica, assembled.

:func:`rank_eval` sums a rank's layers (:func:`autoplan.cost.comm.layer_terms`) per
micro-batch, adds its pipeline point-to-point sends (each chunk sends its output
activation forward and its input's gradient backward; ``1/tp`` of it where the stack
scatters, Narayanan et al. 2021, Sec. 4.1) and a CPU's host work per stage action and
message, and prices the per-step terms: the data-parallel gradient reduction and
parameter gather (ZeRO-0/1/2, Rajbhandari et al. 2020, Sec. 5; FSDP2's flat buffers and
measured host work), the tied embeddings' all-reduce (Shoeybi et al. 2019), sequence
parallelism's partial gradients, torchao's FP8 scales and the optimizer step.  Its
memory is :func:`autoplan.cost.memory.rank_memory`'s; the schedule
(:mod:`autoplan.cost.schedules`) combines the ranks (``CostEngine._evaluate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..strategy import Precision, Schedule, uses_ddp
from .compute import host_runs_ahead
from .layout import Layout, PrecisionCosts, _fp8_scaling
from .ledger import LedgerBuilder
from .memory import RankHoldings, _largest_module_local, rank_memory
from .result import MemoryBreakdown
from .schedules import pipeline_time

if TYPE_CHECKING:
    from .engine import CostEngine

__all__ = ["rank_eval", "step_time", "stages_of", "tied_owned", "replica_devices"]


#: Gradient accumulation (:attr:`CostOptions.grad_accumulate_add`): a micro-batch's
#: gradient added to the accumulated one reads both and writes one, three times the
#: gradient's bytes per parameter
GRAD_ACCUMULATE_READS_WRITES = 3


@dataclass
class _RankEval:
    """One pipeline rank on one replica: per-micro-batch times and per-step terms."""

    device_type: str
    layers: int
    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    recompute: float = 0.0
    wgrad: float = 0.0
    tp_exposed: float = 0.0
    tp_total: float = 0.0
    cp_exposed: float = 0.0
    cp_total: float = 0.0
    cp_waits: float = 0.0         # of cp_exposed: the turns of ranks sharing cores
    ep_exposed: float = 0.0       # expert-parallel token all-to-alls (blocking: all exposed)
    ep_total: float = 0.0
    zero_exposed: float = 0.0     # ZeRO-2/3 per-micro-batch collectives, exposed
    zero_total: float = 0.0
    p2p: float = 0.0
    fwd: float = 0.0              # F_p: forward per micro-batch incl. exposed comm
    bwd: float = 0.0              # B_p
    dp_step_total: float = 0.0    # per-step gradient reduction / parameter gather
    dp_step_exposed: float = 0.0  # before the pipeline slack
    tp_step: float = 0.0          # of those, the per-step reduction over tp (exposed)
    optimizer: float = 0.0
    memory: MemoryBreakdown | None = None
    in_flight: float = 1.0
    capacity: float = 0.0
    peak_flops: float = 0.0

    @property
    def per_micro_batch(self) -> float:
        return self.fwd + self.bwd


def stages_of(engine: CostEngine, stage_ranks: tuple[int, ...]) -> dict[int, list[int]]:
    """The virtual stages of each pipeline rank, in order."""
    hit = engine._rank_stages.get(stage_ranks)
    if hit is None:
        hit = {}
        for k, p in enumerate(stage_ranks):
            hit.setdefault(p, []).append(k)
        engine._rank_stages[stage_ranks] = hit
    return hit


def tied_owned(engine: CostEngine, lay: Layout, chunks) -> float:
    """Parameters (on one device, after tp) of the tied weights the layers of
    ``chunks`` own and a layer of another pipeline rank holds a copy of."""
    s = engine.summary
    mine = {i: sg.tp for ch in chunks for sg in ch for i in range(sg.lo, sg.hi)}
    return sum(s.layers[idx].tied_params / mine[owner]
               for idx, owner in s.tied_owner.items()
               if owner in mine and idx not in mine and s.layers[idx].tied_params)


def replica_devices(lay: Layout, p: int, r: int) -> tuple[int, ...]:
    n = lay.cp * lay.rank_tp[p]
    return lay.rank_devices[p][r * n:(r + 1) * n]


def rank_eval(engine: CostEngine, lay: Layout, rank: int, replica: int, micro_batches: int,
              recipe: PrecisionCosts, ledger: LedgerBuilder | None = None) -> _RankEval:
    """Pipeline rank ``rank`` of replica ``replica``, which runs ``micro_batches``
    micro-batches per step, priced in ``recipe``; with ``ledger``, every collective
    and matmul priced is also written to it
    (:meth:`CostEngine.ledger <autoplan.cost.engine.CostEngine.ledger>`)."""
    s = engine.summary
    opts = engine.options
    pp, v, cp = lay.pp, lay.virtual_stages, lay.cp
    b = lay.micro_batch
    dtype, act_scale = recipe.dtype, recipe.activation_scale
    ep = lay.ep
    groups = engine._groups(lay.rank_devices[rank], lay.rank_tp[rank], cp, ep, replica)
    devices, dp_group, dp_concurrency = groups.replica, groups.dp, groups.dp_concurrency
    dp_key, cp_group, ep_key = groups.dp_key, groups.cp, groups.ep_key
    device = engine.device_of(devices)
    zero_degree = len(dp_group)
    edp = zero_degree // ep
    ev = _RankEval(device_type=device.name, layers=0)
    ev.capacity = float(device.memory_bytes)

    params_by_zero = [0.0, 0.0, 0.0, 0.0]   # local (after TP) parameters per ZeRO stage
    experts_by_zero = [0.0, 0.0, 0.0, 0.0]  # those of them in expert banks (after EP)
    act_per_mb = 0.0                        # saved activation bytes of one micro-batch
    work = 0.0                              # one layer's working set (full recompute)
    max_layer_params = 0.0
    # the largest module whose gradients accumulate over micro-batches (memory below)
    accumulates = opts.grad_accumulate_add and micro_batches > 1
    largest_accumulated = 0.0
    cut_out = 0.0                           # largest boundary, scattered over tp
    cut_whole = 0.0                         # ... and whole
    recv_per_micro_batch = 0.0              # pipeline receive buffers of one micro-batch
    p2p_fwd = p2p_bwd = 0.0                 # pipeline sends of one micro-batch
    shared = 0.0                            # inputs every layer shares (held once)
    tied_extra = 0.0
    # ZeRO-1/2 layers by wrapped unit (CostOptions.zero_step_per_layer): a block's
    # (zero, parameters, expert parameters) -> how many; the rest in one root unit
    step_units: dict[tuple[int, float, float], int] = {}
    # the other layers' parameters under ZeRO-1 and ZeRO-2, then their expert parameters
    root_unit = [0.0, 0.0, 0.0, 0.0]
    tensors = tp_tensors = 0                # parameter tensors (optimizer host time)
    sp_grads: dict[tuple, list[float]] = {}  # tp group -> [tensors, elements] (sequence
    # parallelism's partial gradients)
    mine = engine._stages_of(lay.stage_ranks)[rank]
    chunks = [lay.chunks[k] for k in mine]

    overhead = device.op_overhead
    # a CPU rank's send is its transport's core time per message end (the pipeline's
    # host work below); gloo's isend returns at once and the receiver's wait is the
    # schedule's own dependency, so no transfer time is added to the stage
    sends_on_host = (pp > 1 and overhead is not None and not host_runs_ahead(device)
                     and overhead.pipeline_message_s > 0)

    def send(to: int, whole: float, scattered: float) -> float:
        """Seconds of one send to virtual stage ``to``'s rank: the ``whole`` tensor from
        every tp rank, or its ``scattered`` share where the stack scatters it over the
        tp ranks (every pair sends at once); 0 when that stage is on this device, or
        where the send is the host's work (``sends_on_host``), counted as a message."""
        pair = (devices[0], engine._replica_devices(lay, lay.stage_ranks[to], replica)[0])
        if pair[0] == pair[1]:
            return 0.0
        nonlocal messages
        messages += 1
        if sends_on_host:
            return 0.0
        return engine.collective_time("p2p", pair,
                                    scattered if opts.pp_scatter_gather else whole)
    messages = 0                            # message ends of one forward (and backward)
    # per-micro-batch sums, in locals (the hot loop of a search)
    n_layers = 0
    forward_compute = backward_compute = recompute = weight_grad = 0.0
    tp_total = tp_exposed = cp_total = cp_exposed = cp_waits = 0.0
    ep_total = ep_exposed = zero_total = zero_exposed = 0.0
    forward = backward = 0.0
    for chunk, k in zip(chunks, mine):
        for seg in chunk:
            t = seg.tp
            tp_group = groups.tp if t == len(groups.tp) else devices[:t]
            if ledger is not None:
                engine._ledger_flops(ledger, seg, b, cp, ep)
            for template, count in engine.layer_counts(seg.lo, seg.hi):
                l = engine._templates[template]
                n_layers += count
                key = (template, seg.tp, seg.sequence_parallel, seg.zero, seg.recompute, b,
                       cp, device.name, dtype, act_scale, tp_group, dp_key, cp_group, ep_key)
                terms = engine._terms.get(key)
                if terms is None:
                    vols: list = []
                    terms = engine._terms[key] = tuple(
                        engine._layer_terms(l, seg, b, cp, device, recipe, groups, ep, vols))
                    engine._volumes[key] = tuple(vols)
                if ledger is not None:
                    ledger.volumes(engine._volumes[key], count)
                # the cached _LayerTerms tuple, unpacked in field order: this is a
                # search's hot loop, where 19 attribute reads would cost time
                (forward_compute_s, backward_compute_s, recompute_s, weight_grad_s,
                 tp_total_s, tp_exposed_s, cp_total_s, cp_exposed_s, zero_total_s,
                 zero_exposed_s, forward_s, backward_s, local_params, gather_unit_params,
                 saved_bytes, working_bytes, ep_total_s, ep_exposed_s,
                 local_expert_params, cp_waits_s) = terms
                forward_compute += count * forward_compute_s
                backward_compute += count * backward_compute_s
                recompute += count * recompute_s
                weight_grad += count * weight_grad_s
                tp_total += count * tp_total_s
                tp_exposed += count * tp_exposed_s
                cp_total += count * cp_total_s
                cp_exposed += count * cp_exposed_s
                cp_waits += count * cp_waits_s
                ep_total += count * ep_total_s
                ep_exposed += count * ep_exposed_s
                zero_total += count * zero_total_s
                zero_exposed += count * zero_exposed_s
                forward += count * forward_s
                backward += count * backward_s
                params_by_zero[seg.zero] += count * local_params
                experts_by_zero[seg.zero] += count * local_expert_params
                if seg.zero in (1, 2) and (local_params or local_expert_params):
                    if l.is_block:
                        unit = (seg.zero, local_params, local_expert_params)
                        step_units[unit] = step_units.get(unit, 0) + count
                    else:
                        root_unit[seg.zero - 1] += count * local_params
                        root_unit[seg.zero + 1] += count * local_expert_params
                tensors += count * l.param_tensors
                if t > 1:
                    tp_tensors += count * l.tp_param_tensors
                    if seg.sequence_parallel and l.sp_params:
                        acc = sp_grads.setdefault(tp_group, [0.0, 0.0])
                        acc[0] += count * len(l.sp_params)
                        acc[1] += count * sum(l.sp_params)
                max_layer_params = max(max_layer_params, gather_unit_params)
                if accumulates and seg.zero <= 1:
                    largest_accumulated = max(largest_accumulated,
                                              _largest_module_local(l, t, ep))
                act_per_mb += count * saved_bytes
                if working_bytes > saved_bytes:
                    work = max(work, working_bytes - saved_bytes)
                if l.shared_input_bytes:
                    shared = max(shared, l.shared_input_bytes * b * act_scale / cp)
                if l.tied_params and s.tied_owner.get(l.index) is not None:
                    owner = s.tied_owner[l.index]
                    if not any(sg.lo <= owner < sg.hi for ch in chunks for sg in ch):
                        tied_extra += l.tied_params / t
        # pipeline point-to-point at this chunk's boundaries (scatter/gather over tp)
        last = chunk[-1]
        cut = s.layers[last.hi - 1].send_bytes * b * act_scale / (cp * last.tp)
        cut_out = max(cut_out, cut)
        cut_whole = max(cut_whole, cut * last.tp)
        # torch's stages receive whole (replicated) activations on every tp rank.
        # Each rank pays for what it sends: its output activation in the forward, its
        # input's gradient in the backward
        if k > 0:       # this chunk's input activation arrives from the previous stage
            cut_in = s.layers[chunk[0].lo - 1].send_bytes * b * act_scale / cp
            recv_per_micro_batch += cut_in
            cut_out = max(cut_out, cut_in / chunk[0].tp)
            cut_whole = max(cut_whole, cut_in)
            p2p_bwd += send(k - 1, cut_in, cut_in / chunk[0].tp)
            if ledger is not None and lay.stage_ranks[k - 1] != rank:
                ledger.per_micro_batch("send", "pp", ledger.act_dtype,
                                       cut_in / chunk[0].tp if opts.pp_scatter_gather
                                       else cut_in, 1, "pp")
        if k < pp * v - 1:  # and its output's gradient from the next
            recv_per_micro_batch += s.layers[last.hi - 1].send_bytes * b * act_scale / cp
            p2p_fwd += send(k + 1, cut * last.tp, cut)
            if ledger is not None and lay.stage_ranks[k + 1] != rank:
                ledger.per_micro_batch("send", "pp", ledger.act_dtype,
                                       cut if opts.pp_scatter_gather else cut * last.tp,
                                       1, "pp")
    if pp > 1 and overhead is not None and not host_runs_ahead(device):
        # the pipeline's host work per stage action and message end (CPU devices):
        # each chunk's forward and backward of a micro-batch, and a zero-bubble
        # schedule's deferred weight backward; each sends or receives across its
        # chunk's boundaries
        actions = len(chunks) * overhead.pipeline_action_s
        host = actions + messages * overhead.pipeline_message_s
        split = deferred = 0.0
        if lay.schedule is Schedule.ZERO_BUBBLE:
            # torch splits the backward (input gradients, then the weights' in a pass
            # of their own): its walk of the graph and second pass, per autograd node,
            # half in each
            nodes = sum(s.total("autograd_nodes", seg.lo, seg.hi)
                        for chunk in chunks for seg in chunk)
            split = nodes * overhead.zero_bubble_node_s
            deferred = actions + split / 2
        forward_compute += host
        forward += host
        backward_compute += host + split / 2 + deferred
        backward += host + split / 2 + deferred
        weight_grad += deferred
    ev.layers = n_layers
    ev.fwd_compute, ev.bwd_compute = forward_compute, backward_compute
    ev.recompute, ev.wgrad = recompute, weight_grad
    ev.tp_total, ev.tp_exposed = tp_total, tp_exposed
    ev.cp_total, ev.cp_exposed, ev.cp_waits = cp_total, cp_exposed, cp_waits
    ev.ep_total, ev.ep_exposed = ep_total, ep_exposed
    ev.zero_total, ev.zero_exposed = zero_total, zero_exposed
    ev.fwd, ev.bwd = forward, backward
    if not opts.pp_comm_overlap:
        ev.p2p = p2p_fwd + p2p_bwd
        ev.fwd += p2p_fwd
        ev.bwd += p2p_bwd

    # per-step data-parallel reduction of the layers with ZeRO-0/1 (and ZeRO-2's gather)
    param_bytes, grad_bytes = recipe.param_bytes, recipe.grad_bytes   # per parameter
    reduced0 = params_by_zero[0] + tied_extra
    reduced1 = params_by_zero[1]
    gathered = reduced1 + params_by_zero[2]
    x0, x1, x2, x3 = experts_by_zero     # expert banks: over the edp group
    edp_group = groups.edp
    edp_key = ((edp_group[0], len(edp_group), ep_key[2])   # ep_key[2]: hash(edp_group)
               if edp_group else None)
    t_reduce = engine.collective_time("all_reduce", dp_group, reduced0 * grad_bytes,
                                    dp_concurrency, dp_key)
    if x0:
        t_reduce += engine.collective_time("all_reduce", edp_group, x0 * grad_bytes,
                                         dp_concurrency, edp_key)
    if ledger is not None and zero_degree > 1:
        ledger.per_step("all_reduce", "dp", ledger.grad_dtype, reduced0 * grad_bytes, 1,
                        "dp_step")
    if ledger is not None and edp > 1:
        ledger.per_step("all_reduce", "edp", ledger.grad_dtype, x0 * grad_bytes, 1,
                        "dp_step")
    # ZeRO-1's reduce-scatters and ZeRO-1/2's all-gathers: (parameters, expert
    # parameters, calls) each
    if opts.zero_step_per_layer:        # one of each per wrapped unit
        scatters = [(n, x, count) for (z, n, x), count in step_units.items() if z == 1]
        gathers = [(n, x, count) for (z, n, x), count in step_units.items()]
        for z in (1, 2):
            root = (root_unit[z - 1], root_unit[z + 1], 1)
            if root[0] or root[1]:
                gathers.append(root)
                if z == 1:
                    scatters.append(root)
    else:                               # one of each over all of them
        scatters, gathers = [(reduced1, x1, 1)], [(gathered, x1 + x2, 1)]

    def calls(op: str, units, nbytes: float) -> float:
        """``op`` over each unit's parameters (dp group) and expert parameters (edp
        group), ``count`` times a unit."""
        return sum(count * (
            engine.collective_time(op, dp_group, n * nbytes, dp_concurrency, dp_key)
            + engine.collective_time(op, edp_group, x * nbytes, dp_concurrency, edp_key))
            for n, x, count in units)

    t_reduce += calls("reduce_scatter", scatters, grad_bytes)
    t_gather = calls("all_gather", gathers, param_bytes)
    if ledger is not None:
        for op, units, nbytes, dtype in (("reduce_scatter", scatters, grad_bytes,
                                          ledger.grad_dtype),
                                         ("all_gather", gathers, param_bytes,
                                          ledger.param_dtype)):
            for n, x, count in units:
                if zero_degree > 1:
                    ledger.per_step(op, "dp", dtype, count * n * nbytes,
                                    count if n else 0, "dp_step")
                if edp > 1:
                    ledger.per_step(op, "edp", dtype, count * x * nbytes,
                                    count if x else 0, "dp_step")
    # autoplan.parallelize wraps a data-parallel rank's parameters as DTensors (FSDP2's
    # fully_shard or replicate) unless it uses DDP
    max_zero = max((z for z in range(4) if params_by_zero[z] or experts_by_zero[z]),
                   default=0)
    fsdp2 = zero_degree > 1 and not uses_ddp(pp=pp, tp=lay.rank_tp[rank], ep=ep,
                                             max_zero=max_zero, precision=recipe.dtype)
    # FSDP2's work beyond these collectives where the rank's cores run it (CPU
    # profiles measure it, its copies included, every rank busy): replicate's one
    # all-reduce a step (OpOverhead.replicate_call_s) and fully_shard's once-a-step
    # reduce-scatters and gathers per unit (OpOverhead.fsdp_reduce_call_s), each unit's
    # parameters and its expert banks' (over their edp group) a call of their own.
    # Not on pipelines whose ranks share cores: their step ends with the other
    # stages' ranks idle, faster than every rank busy (the replicate_call_s docstring)
    on_host = (fsdp2 and overhead is not None and not host_runs_ahead(device)
               and not (pp > 1 and engine._shared_cores(lay) is not None))
    replicated = on_host and max_zero == 0 and overhead.replicate_measured
    sharded = on_host and max_zero > 0 and overhead.fsdp_measured
    if replicated or sharded:
        assert overhead is not None

        def extra(per_call, units, nbytes: float) -> float:
            return sum(count * (per_call(n * nbytes, 1.0 if n else 0.0)
                                + (per_call(x * nbytes, 1.0 if x else 0.0)
                                   if edp > 1 else 0.0))
                       for n, x, count in units)
        if replicated:
            t_reduce += extra(overhead.replicate_s, [(reduced0, x0, 1)], grad_bytes)
        else:
            t_reduce += extra(overhead.fsdp_reduce_s, scatters, grad_bytes)
            t_gather += extra(overhead.fsdp_gather_s, gathers, param_bytes)
    if opts.zero_buffer_copies and zero_degree > 1:
        # once per step, memory-bound (read + write) on the device: DDP's buckets and
        # FSDP2's replicate copy the gradients in and the reduced ones back out;
        # FSDP2's reduce-scatter copies them in (its output is the shard); its
        # all-gather copies the shard in and the gathered parameters out (where the
        # figures above were priced, their copies are in them)
        bw = device.memory_bw_bytes_per_s
        reduce_copies = ((0.0 if replicated else 4 * reduced0)
                         + (0.0 if sharded else 2 * reduced1))
        t_reduce += reduce_copies * grad_bytes / bw
        if not sharded:
            t_gather += 2 * gathered * (1 + 1 / zero_degree) * param_bytes / bw
        if edp > 1:   # expert banks, over their edp group (none to reduce when edp is 1)
            t_reduce += ((0.0 if replicated else 4 * x0) + (0.0 if sharded else 2 * x1)
                         ) * grad_bytes / bw
            if not sharded:
                t_gather += 2 * (x1 + x2) * (1 + 1 / edp) * param_bytes / bw
    ev.dp_step_total = t_reduce + t_gather
    exposed_reduce = max(0.0, t_reduce - ev.bwd) if opts.overlap_grad_reduce else t_reduce
    exposed_gather = max(0.0, t_gather - ev.fwd) if opts.overlap_param_gather else t_gather
    ev.dp_step_exposed = exposed_reduce + exposed_gather
    # the tied parameters' all-reduce takes both stages: the one holding the copy
    # (tied_extra) and the one owning the parameter another stage copies
    tied_pair = tied_extra or (engine._tied_owned(lay, chunks) if pp > 1 else 0.0)
    if tied_pair and pp > 1:
        other = 0 if rank == pp - 1 else pp - 1
        pair = (devices[0], engine._replica_devices(lay, other, replica)[0])
        if pair[0] != pair[1]:
            t_tied = engine.collective_time("all_reduce", pair, tied_pair * grad_bytes)
            ev.dp_step_total += t_tied
            ev.dp_step_exposed += t_tied
            if ledger is not None:
                ledger.per_step("all_reduce", "tied", ledger.grad_dtype,
                                tied_pair * grad_bytes, 1, "tied")
    # sequence parallelism: the norms saw a sequence shard, their gradients are partial
    # sums over tp, reduced once per step after the backward: each in its own
    # all-reduce in FSDP2's post-backward (where it wraps the rank and the stack does
    # so), or all together in one (Megatron; autoplan.parallelize without FSDP2)
    # (under FSDP2's policy a gradient left as autograd made it, 16-bit, where one
    # micro-batch gives no accumulation in the reduction dtype first)
    sp_bytes, sp_dtype = grad_bytes, (ledger.grad_dtype if ledger is not None else "")
    if recipe.fsdp2_master and micro_batches == 1:
        sp_bytes, sp_dtype = param_bytes, (ledger.act_dtype if ledger is not None else "")
    for group, (n, elements) in sp_grads.items():
        per_tensor = ((fsdp2 or recipe.fsdp2_master)
                      and opts.sp_grads_per_tensor_under_fsdp2)
        if per_tensor:   # at their mean size
            t_sp = n * engine.collective_time("all_reduce", group, elements / n * sp_bytes)
        else:
            t_sp = engine.collective_time("all_reduce", group, elements * sp_bytes)
        if ledger is not None:
            ledger.per_step("all_reduce", "tp", sp_dtype, elements * sp_bytes,
                            n if per_tensor else 1, "sp_grads")
        ev.tp_step += t_sp
        ev.dp_step_total += t_sp
        ev.dp_step_exposed += t_sp
    # torchao's FP8 all-gathers: the next step's scales, after the optimizer step (the
    # read of the shards for their maxima is counted with the optimizer, below)
    t_read = 0.0
    if _fp8_scaling(recipe.dtype) and engine.options.fp8_library == "torchao":
        t_scales, t_read = engine._fp8_step_scales(chunks, recipe, groups, ledger)
        ev.dp_step_total += t_scales
        ev.dp_step_exposed += t_scales
    # Transformer Engine's FP8 weight casts, once a step (its weight cache): memory-bound
    # per-step work like the optimizer's, and counted with it
    t_read += engine._te_weight_cast_s(chunks, recipe, device, ep, micro_batches)
    # optimizer: memory-bound Adam over the parameters this device updates
    local_opt = params_by_zero[0] + tied_extra + sum(params_by_zero[1:]) / zero_degree
    local_opt += x0 + (x1 + x2 + x3) / edp
    if overhead is not None and overhead.optimizer_element_s > 0:
        # measured per fp32 element of the fused step (CPU profiles), the recipe's
        # bytes against fp32's
        fp32_accessed = engine.constants.optimizer.fp32_bytes_accessed_per_param
        ev.optimizer = (local_opt * overhead.optimizer_element_s
                        * recipe.optimizer_bytes_accessed / fp32_accessed)
    else:
        ev.optimizer = (local_opt * recipe.optimizer_bytes_accessed
                        / device.memory_bw_bytes_per_s)
    ev.optimizer += t_read
    if overhead is not None and tensors:
        # the host's time per parameter tensor (CPU devices): DTensors where FSDP2
        # wraps the rank (a 16-bit plan's policy wraps it without data parallelism
        # too); without it only the linears tensor parallelism shards
        dtensors = tensors if fsdp2 or recipe.fsdp2_master else tp_tensors
        ev.optimizer += ((tensors - dtensors) * overhead.optimizer_param_s
                         + dtensors * overhead.optimizer_dtensor_param_s)
    # torch.autocast over fp32 weights (CostOptions.autocast): fp32 gradients
    autocast = opts.autocast and recipe.dtype != "fp32"
    if opts.grad_accumulate_add and micro_batches > 1:
        # each micro-batch after the first adds its gradients to the accumulated ones
        # (read both, write one): whole under ZeRO-0/1, which reduce once a step, the
        # reduce-scattered shard under ZeRO-2/3; fp32 under autocast (the weights'
        # dtype); once a step, with the optimizer's share
        accumulated = (params_by_zero[0] + params_by_zero[1] + tied_extra
                       + (params_by_zero[2] + params_by_zero[3]) / zero_degree
                       + x0 + x1 + (x2 + x3) / edp)
        nbytes = GRAD_ACCUMULATE_READS_WRITES * (Precision.FP32.bytes if autocast
                                                 else grad_bytes)
        ev.optimizer += ((micro_batches - 1) * accumulated * nbytes
                         / device.memory_bw_bytes_per_s)

    # memory
    held = RankHoldings(params_by_zero, experts_by_zero, tied_extra, act_per_mb, shared,
                        work, max_layer_params, largest_accumulated, recv_per_micro_batch,
                        cut_out, cut_whole)
    ev.in_flight, ev.memory = rank_memory(engine, lay, rank, micro_batches, recipe, chunks,
                                          held, zero_degree)
    return ev


def step_time(lay: Layout, ranks: list[_RankEval], m: int, shared: tuple[int, int] | None
              ) -> tuple[float, int, float, int, float]:
    """``(step, critical rank, pipeline, rank finishing last, shared cores' cost)`` seconds
    of one replica whose pipeline ranks ``ranks`` (:func:`rank_eval`) run ``m``
    micro-batches a step: the schedule's time (:func:`autoplan.cost.schedules.pipeline_time`),
    then the rank whose exposed per-step reduction and optimizer end last after its last
    backward (rank ``p`` finishes ``sum_{q<p} B_q`` before rank 0).  ``shared``:
    ``(ranks, cores)`` where the ranks share fewer cores
    (:func:`autoplan.cost.hetero.shared_cores`), else None."""
    pp, v = lay.pp, lay.virtual_stages
    times = [rk.per_micro_batch for rk in ranks]
    crit = max(range(pp), key=lambda p: times[p])
    zb_excess = 0.0
    if lay.schedule is Schedule.ZERO_BUBBLE:
        c = ranks[crit]
        zb_excess = max(0.0, c.fwd + (c.bwd - c.wgrad) - 2 * c.wgrad)
    t_pipe = pipeline_time(lay.schedule, times, m, virtual_stages=v, zb_excess_s=zb_excess)
    if shared is not None:
        # ranks sharing fewer cores: while a rank waits in the pipeline's bubble
        # the others run faster than measured (every rank busy at once).  The
        # step is bounded by the critical path at a whole core's speed and by
        # the busiest rank's work at the speed of the ranks that can run at once:
        # every rank where the pipeline fills (m >= pp); with fewer micro-batches
        # than stages only m stages ever run at once, and their ranks share the
        # cores with no others (one micro-batch: one stage's ranks, a core each
        # where they are no more than the cores).  (That bound at every rank's
        # speed whatever m: the four stored confirm passes of the 2-core AMD VM
        # re-priced read 268 of 324 runs within 15% against 278; all 22 stored
        # passes 1691 of 1782 against 1692, the Xeon's one-micro-batch ZeRO-2/3
        # pipelines measuring slower than either prices, 2026-11-28.  The total
        # work over the ranks, m x the ranks' mean, never exceeds the bound at
        # every rank's speed, which is pessimistic where the others idle and
        # lend the busiest rank their cores, but it offsets what the pipelines
        # leave unpriced: bounded by the total work instead, five confirm passes'
        # runs re-priced read 65, 70, 76, 55 and 68 of 81 within 15%, against
        # 60, 74, 72, 70 and 78, 2026-11-26.)  The exposed tensor, context and
        # expert-parallel collectives inside a stage's micro-batch are not CPU
        # work alone: their waits take as long with the other ranks idle, so the
        # critical path speeds up by the cores only over the rest of its time
        # (the critical rank's share; thirteen stored passes re-priced, FSDP2's
        # figures written into the older profiles: the one-micro-batch tp2 pp2 and
        # pp2 cp2 pipelines from 10% fast on average to within 8%, 1038 of 1053
        # within 15% to 1042, 2026-11-27)
        # Context parallelism's waits for the peers' turns on the cores
        # (OpOverhead.cp_gather_call_s) are paid only while the other ranks
        # compute: not on the critical path where they idle, but in the busiest
        # rank's work.
        ranks_on_node, cores = shared
        c = ranks[crit]
        alone, t_alone = times, t_pipe
        if any(rk.cp_waits for rk in ranks):
            alone = [t - rk.cp_waits for t, rk in zip(times, ranks)]
            t_alone = pipeline_time(lay.schedule, alone, m, virtual_stages=v,
                                    zb_excess_s=zb_excess)
        waits = min(1.0, (c.tp_exposed + c.cp_exposed - c.cp_waits + c.ep_exposed)
                    / alone[crit]) if alone[crit] > 0 else 0.0
        time_share = cores / ranks_on_node + (1 - cores / ranks_on_node) * waits
        busy = ranks_on_node * min(m, pp) / pp
        t_pipe = max(t_alone * time_share,
                     m * max(times) * max(cores, busy) / ranks_on_node)
    # rank p finishes its last backward sum_{q<p} B_q before rank 0 (1F1B drain)
    tail, slack, tail_rank, hidden = 0.0, 0.0, 0, 0.0
    for p, rk in enumerate(ranks):
        t = max(0.0, rk.dp_step_exposed - slack) + rk.optimizer
        if t > tail:
            tail, tail_rank = t, p
        hidden += min(rk.dp_step_exposed, slack)
        slack += rk.bwd
    shared_cost = 0.0
    if shared is not None:
        # ranks sharing fewer cores: a later stage's reduction under an earlier
        # stage's backward is hidden from the step but not from the cores.  While
        # it runs, the earlier stage's ranks compute at the every-rank-busy speed
        # rather than at a whole core's each (the pipeline bound above), so the
        # step pays its seconds times the share of the speed they lose
        ranks_on_node, cores = shared
        shared_cost = hidden * (1 - cores / ranks_on_node)
    step = t_pipe + tail + shared_cost
    return step, crit, t_pipe, tail_rank, shared_cost
