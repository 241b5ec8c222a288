"""Exhaustive enumeration: every layout of the search space priced, for verification.

:func:`autoplan.search.search` visits degree combinations best bound first and prices a
few of them; :func:`exhaustive` prices every uniform layout of the same space, with a
plain enumeration of its own (every device count of every pool, every degree whose
product fits and whose groups sit inside a node or over whole nodes, every ZeRO stage
and recompute option; the micro-batch sizes and schedules the space defines), without
bounds, so that the two can be compared: the search is never slower
(``tests/test_search_coverage.py``).  Its cost grows with the product of all the
choices: use it on small clusters and models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

from ..cost import CostEngine, CostOptions
from ..errors import StrategyError
from ..graph import LayerKind, ModelGraph
from ..plan import expert_counts
from ..strategy import Precision, Recompute, Schedule, schedule_problem
from .builder import _Builder, _Combo, micro_batch_counts
from .fleet import pools
from .space import SearchSpace, _micro_batches, _schedules

__all__ = ["exhaustive", "Priced"]


@dataclass(frozen=True)
class Priced:
    """One priced uniform layout."""

    combo: _Combo
    zero: int
    recompute: Recompute
    replica_batch: tuple[int, ...]
    step_time_s: float
    peak_bytes: float
    fits: bool


def exhaustive(graph: ModelGraph, cluster, *, global_batch: int, memory_fraction: float = 0.9,
               precision: Precision | str = Precision.BF16, options: CostOptions | None = None,
               space: SearchSpace | None = None,
               use_all_devices: bool = False) -> Iterator[Priced]:
    """Every uniform layout of ``graph`` on ``cluster`` the search space holds, priced.

    Yields one :class:`Priced` per layout the engine can price (fitting or not)."""
    precision = Precision(precision)
    space = space or SearchSpace()
    experts = expert_counts(graph)
    if experts:
        space = replace(space, sequence_parallel=(False,),
                        recompute=tuple(r for r in space.recompute if r is not Recompute.SELECTIVE))
    options = replace(options or CostOptions(), memory_fraction=memory_fraction)
    engine = CostEngine(graph, cluster, options=options)
    ps = pools(cluster, use_all_devices=use_all_devices)
    builder = _Builder(graph, engine, cluster, precision, ps)
    blocks = sum(1 for l in graph.layers if l.kind is LayerKind.BLOCK)
    tp_limit = 0
    for l in graph.layers:
        if l.kind is LayerKind.BLOCK:
            tp_limit = math.gcd(tp_limit, l.tp.max_degree())
    tp_limit = tp_limit or 1
    seq = graph.seq_len or 0
    attention = engine.summary.kv_bytes_per_token is not None
    seen: set[tuple[int, ...]] = set()
    for pi, pool in enumerate(ps):
        sizes = [pool.size] if use_all_devices else range(1, pool.size + 1)
        for n in sizes:
            devices = pool.devices[:n]
            if devices in seen or not pool.whole_nodes_first(n):
                continue               # the same devices in another pool
            seen.add(devices)
            for tp in range(1, n + 1):
                if tp_limit % tp or pool.domain(n) % tp or (
                        space.tensor_parallel is not None and tp not in space.tensor_parallel):
                    continue
                for cp in range(1, n // tp + 1):
                    if cp > 1 and not (attention and seq and seq % (2 * cp) == 0):
                        continue
                    if space.context_parallel is not None and cp not in space.context_parallel:
                        continue
                    if space.context_parallel is None and cp > 1 and \
                            seq // cp < space.min_context_tokens:
                        continue
                    g = tp * cp
                    whole = pool.whole_node(n)
                    if pool.domain(n) % g and not (whole and g % whole == 0 and n % g == 0):
                        continue
                    for pp in range(1, max(blocks, 1) + 1):
                        if n % (g * pp):
                            continue
                        if space.pipeline_parallel is not None and \
                                not space.pipeline_parallel[0] <= pp <= space.pipeline_parallel[1]:
                            continue
                        dp = n // (g * pp)
                        if dp > global_batch:
                            continue
                        yield from _priced(engine, builder, space, graph, global_batch, blocks,
                                           experts, pool, pi, n, tp, cp, pp, dp)


def _priced(engine: CostEngine, builder: _Builder, space: SearchSpace, graph: ModelGraph,
            global_batch: int, blocks: int, experts: tuple[int, ...], pool, pi: int, n: int,
            tp: int, cp: int, pp: int, dp: int) -> Iterator[Priced]:
    whole = pool.whole_node(n)
    for mb in _micro_batches(space, global_batch // dp):
        base = _Combo(tp, cp, pp, dp, mb, Schedule.ONE_F_ONE_B, 1, False, 1, pi)
        for split in builder.replica_splits(base, global_batch, even=space.even_batches):
            counts = micro_batch_counts(split, mb)
            for sched, v in _schedules(space, pp, max(1, global_batch // (dp * mb)), blocks):
                if any(schedule_problem(sched, pp, v, m) for m in set(counts)):
                    continue
                for sp in space.sequence_parallel:
                    if sp and tp == 1:
                        continue
                    eps = [1]
                    if experts:
                        eps = [ep for ep in range(1, dp * cp + 1)
                               if (dp * cp) % ep == 0 and all(e % ep == 0 for e in experts)
                               and (space.expert_parallel is None or ep in space.expert_parallel)
                               and (ep == 1 or pool.domain(n) % (ep * tp) == 0
                                    or (whole and (ep * tp) % whole == 0))] or [1]
                    for ep in eps:
                        c = _Combo(tp, cp, pp, dp, mb, sched, v, sp, ep, pi)
                        yield from _ladder_all(engine, builder, space, c, split, counts,
                                               global_batch)


def _ladder_all(engine: CostEngine, builder: _Builder, space: SearchSpace, c: _Combo,
                split: tuple[int, ...], counts: tuple[int, ...],
                global_batch: int) -> Iterator[Priced]:
    zbv = c.schedule is Schedule.ZERO_BUBBLE
    for zero in space.zero:
        if zbv and zero == 3:
            continue
        for rc in space.recompute:
            if zbv and rc is Recompute.SELECTIVE:
                continue
            try:
                q = engine.quick(builder.layout(c, zero, rc, counts, global_batch))
            except StrategyError:
                continue
            yield Priced(c, zero, rc, split, q.step_time_s, q.peak_memory_bytes, q.fits)
