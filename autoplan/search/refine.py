"""Refinement: blocks per pipeline rank and recompute per block (the per-stage problem).

For a priced candidate the per-stage problem (:mod:`autoplan.search.stage_solver`)
chooses how many blocks each pipeline rank holds and which recompute option each of
them uses, under each rank's memory.  Which candidates are refined is decided by a
bound, not a count: a refined layout keeps its candidate's degrees, schedule and ZeRO
stage, so it takes at least :func:`refine_bound` (the candidate's pipeline with the
ranks' work, recompute removed, shared evenly, plus the optimizer steps' mean), and a
candidate whose bound reaches the best plan found is left alone.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ..cost import CostEngine, in_flight
from ..errors import InfeasiblePlan
from ..strategy import Recompute
from .bounds import Bounds
from .builder import _Builder, _Candidate
from .stage_solver import StageProblem, solve_stage_problem

__all__ = ["refine", "refine_bound"]

_MiB = float(2**20)

#: CP-SAT's deterministic time budget per refinement (about seconds of one core), where
#: the per-stage problem has more options than the exact counting solves: the per-stage
#: problems of a search were solved to optimality in far less, but a few of the largest
#: (8 ranks, 80 blocks, 3 options) would spend seconds proving it; at this budget none of
#: the 30 slowest of a Llama-3-70B search on mixed-a100-v100 came out worse.
REFINE_SOLVER_S = 0.25


def refine(cand: _Candidate, builder: _Builder, global_batch: int,
           weight: float = 1.0) -> _Candidate | None:
    """Blocks per rank and recompute per block (:func:`solve_stage_problem`), from the
    candidate's layout."""
    c, engine, s = cand.combo, builder.engine, builder.summary
    if c.v != 1 or not builder.blocks:
        return None
    lay = cand.layout
    full = engine.estimate(lay, ledger=False)
    recipe = engine.precision_costs(lay.precision)
    act_scale = recipe.activation_scale
    m = max(lay.replica_micro_batches)
    opts = [r for r in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
            if r in builder.recompute
            and not (r is Recompute.SELECTIVE and engine.options.fused_attention)]
    mid = s.layers[builder.blocks[len(builder.blocks) // 2]]
    zero_deg = c.dp * c.cp

    def state_bytes_over(shards: int) -> float:
        """Weight, gradient and optimizer bytes per parameter under the candidate's ZeRO
        stage over ``shards`` ranks."""
        weights, grads, optimizer = recipe.param_bytes, recipe.grad_bytes, recipe.optimizer_bytes
        return {0: weights + grads + optimizer, 1: weights + grads + optimizer / shards,
                2: weights + (grads + optimizer) / shards,
                3: (weights + grads + optimizer) / shards}[cand.zero]

    state_bytes = state_bytes_over(zero_deg)
    # expert banks: 1/ep of them per device, their states sharded over dp x cp / ep
    ep = c.ep if mid.expert_params else 1
    x = mid.expert_params if ep > 1 else 0
    local_params = mid.sharded_params / c.tp + (mid.params - mid.sharded_params - x)
    local_x, state_x = x / ep, state_bytes_over(zero_deg // c.ep)
    time_us, mem_mib, fixed_t, fixed_m, cap = [], [], [], [], []
    counts_now = []
    for p in range(c.pp):
        chunk = lay.chunks[p]
        nblocks = sum(seg.hi - seg.lo for seg in chunk if s.layers[seg.lo].is_block)
        counts_now.append(nblocks)
        device = engine.device_of(lay.rank_devices[p][:c.cp * c.tp])
        layer_time = engine.template_time(mid.template, c.micro_batch, c.tp, c.cp, device,
                                          recipe.dtype, False, ep)
        forward, backward = layer_time.forward_s, layer_time.backward_s
        # the token all-to-alls: dispatch and combine, forward and backward
        ep_group = lay.rank_devices[p][0::c.tp][:ep]
        a2a = engine.collective_time("all_to_all", ep_group,
                                     engine.dispatch_bytes(mid, c.micro_batch, c.cp, act_scale,
                                                           c.tp, ep_group)) \
            if ep > 1 else 0.0
        flight = in_flight(c.schedule, p, c.pp, m, 1)
        t_row, m_row = [], []
        for rc in opts:
            extra = forward if rc is Recompute.FULL else \
                (layer_time.core_forward_s if rc is Recompute.SELECTIVE else 0.0)
            comm = a2a * (6 if rc is Recompute.FULL else 4)
            t_row.append(max(1, round((forward + backward + extra + comm) * 1e6)))
            act = engine.activation_bytes(mid, c.tp, c.sp, rc, c.cp) * c.micro_batch * act_scale \
                * flight
            m_row.append(max(1, math.ceil((act + local_params * state_bytes
                                           + local_x * state_x) / _MiB)))
        time_us.append(tuple(t_row))
        mem_mib.append(tuple(m_row))
        st = full.stages[p]
        per_mb = st.forward_s + st.backward_s
        base_rc = opts.index(cand.recompute) if cand.recompute in opts else 0
        fixed_t.append(max(0, round(per_mb * 1e6) - nblocks * t_row[base_rc]))
        fixed_m.append(max(0, math.ceil(st.memory.total_bytes / _MiB) - nblocks * m_row[base_rc]))
        cap.append(int(st.memory_capacity_bytes * engine.options.memory_fraction / _MiB))
    base = opts.index(cand.recompute) if cand.recompute in opts else 0
    hint = tuple(tuple(counts_now[p] if o == base else 0 for o in range(len(opts)))
                 for p in range(c.pp))
    problem = StageProblem(num_blocks=len(builder.blocks), options=tuple(o.value for o in opts),
                           time_us=tuple(time_us), memory_mib=tuple(mem_mib),
                           fixed_time_us=tuple(fixed_t), fixed_memory_mib=tuple(fixed_m),
                           capacity_mib=tuple(cap), hint=hint)
    best: _Candidate | None = None
    for _ in range(3):   # tighten the budget if the engine disagrees on memory
        try:
            sol = solve_stage_problem(problem, max_deterministic_time_s=REFINE_SOLVER_S)
        except InfeasiblePlan:
            return best
        counts = [sum(row) for row in sol.counts]
        # within a rank: the most memory-saving options first (earliest layers live longest)
        runs = [[(row[o], opts[o]) for o in reversed(range(len(opts))) if row[o]] for row in sol.counts]
        bounds = builder.bounds_from_counts(counts)
        new = builder.layout(c, cand.zero, cand.recompute, lay.replica_micro_batches, global_batch,
                             bounds=bounds, options=runs)
        q = engine.quick(new)
        if q.fits:
            rcs = {r for run in runs for _, r in run}
            best = _Candidate(q.step_time_s * weight, q.step_time_s, q.peak_memory_bytes,
                              cand.key + ("refined",), c, cand.zero,
                              cand.recompute if len(rcs) != 1 else next(iter(rcs)), new,
                              cand.replica_batch)
            break
        over = math.ceil((q.peak_memory_bytes - min(cap) * _MiB) / _MiB) + 1
        problem = replace(problem, capacity_mib=tuple(max(1, x - max(over, 1)) for x in problem.capacity_mib))
    return best


def refine_bound(cand: _Candidate, engine: CostEngine, bounds: Bounds,
                 kinds: tuple[tuple[int, ...], ...], homogeneous: bool, m: int | None = None,
                 caps: Any = None, estimate: Any = None) -> float:
    """A lower bound of the step time of every refinement of ``cand`` (any blocks per
    rank, any recompute per block; its degrees, schedule and ZeRO stage).

    :meth:`Bounds.zero_bound` with what the priced candidate shows beyond the bounds'
    model and does not depend on the split: each rank's bytes beyond the model's (the
    working set of a recomputed layer, inputs every layer shares, the loss, ZeRO's
    gathered layers; less the gradient buckets, which grow with the rank's parameters),
    which it holds whatever its blocks, and the ranks' work beyond their layers'
    (pipeline sends of as many boundaries, of equal size).  Its data-parallel step and
    optimizer add at least the mean of the ranks' optimizer steps (the slowest rank's is
    at least the mean, and the sum, linear in the parameters, is the same however the
    blocks split).  The priced ranks are those of the slowest replicas, which run the
    most micro-batches.  Ranks of several device types: for the replica class of
    ``kinds``, which run at most ``m`` micro-batches in ranks of ``caps`` usable bytes
    (:meth:`Bounds.classes`), with the priced ranks' bytes only (their work and optimizer
    steps may be another class's)."""
    c = cand.combo
    top = max(cand.layout.replica_micro_batches)
    m = m or top
    plain = bounds.zero_bound(c.pool, c.n, kinds, c.pp, c.v, c.tp, c.cp, c.ep, c.sp,
                              cand.zero, c.micro_batch, c.schedule, m, caps=caps)
    if plain is None:
        return 0.0
    est = estimate if estimate is not None else engine.estimate(cand.layout, ledger=False)
    layers = bounds.summary.layers
    none_time = bounds.sums(kinds[0], c.tp, c.cp, c.ep, c.sp, cand.zero, Recompute.NONE,
                            c.micro_batch)
    rc_time = bounds.sums(kinds[0], c.tp, c.cp, c.ep, c.sp, cand.zero, cand.recompute,
                          c.micro_batch)
    blocks = [0] * c.pp
    own = [0.0] * c.pp
    for k, p in enumerate(cand.layout.stage_ranks):
        for seg in cand.layout.chunks[k]:
            for i in range(seg.lo, seg.hi):
                block = layers[i].is_block
                blocks[p] += block
                own[p] += (rc_time if block else none_time).time_s[layers[i].template]
    # the bounds' model at the most micro-batches any replica runs (the priced ranks',
    # and at least any other's: what is left over is at most the priced ranks' extra)
    model = bounds.allocated(c.pool, c.n, kinds[0], c.pp, c.v, c.tp, c.cp, c.ep, c.sp,
                             cand.zero, cand.recompute, c.micro_batch, c.schedule, top, blocks)
    # blocks of several sizes (dense and MoE blocks): what a rank holds beyond the model
    # depends on which blocks it holds (the model counts each at the smallest's size, and a
    # recomputed layer's working set is its own), so another split may hold less: none of
    # it is kept (a looser bound, and a valid one)
    x = bounds.sums(kinds[0], c.tp, c.cp, c.ep, c.sp, 1, cand.recompute, c.micro_batch)
    alike = len({(x.params[t], x.expert_params[t], x.saved[t])
                 for t in bounds.block_templates}) <= 1
    extra, rest, optimizer = [], [], 0.0
    for p, st in enumerate(est.stages):
        mem = st.memory
        held = (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
                + mem.activations_bytes + mem.buffers_bytes)
        extra.append(max(0.0, held - model[p] - bounds.bucket_bytes) if alike else 0.0)
        if homogeneous:
            rest.append(max(0.0, st.forward_s + st.backward_s - own[p]))
            optimizer += max(0.0, st.busy_s - top * (st.forward_s + st.backward_s))
        else:       # the priced ranks' work and steps are another class's, maybe
            rest.append(0.0)
    bound = bounds.zero_bound(c.pool, c.n, kinds, c.pp, c.v, c.tp, c.cp, c.ep, c.sp,
                              cand.zero, c.micro_batch, c.schedule, m,
                              extra_bytes=extra, rest_s=sum(rest), rank_rest_s=rest, caps=caps,
                              tail=not homogeneous)
    if bound is None:
        return math.inf
    return max(plain, bound + optimizer / c.pp)
