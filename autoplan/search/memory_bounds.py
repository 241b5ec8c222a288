"""The memory model the search's bounds share (:class:`MemoryBounds`, a base of
:class:`autoplan.search.bounds.Bounds`; the module docstring of :mod:`.bounds` states
the model under "Memory").

A rank holds at least its layers' model states (per ZeRO stage) and the activations of
its micro-batches in flight, plus the runtime's reserve and the allocator's
fragmentation share of it; a uniform option fits only if the ranks can hold every block
between them, at least one per chunk.  These methods read what :class:`Bounds` sets up
(the engine, the precision's bytes per parameter, the block templates and their counts,
the reserve, fragmentation and memory fraction, the caches) and its per-layer terms
(:meth:`Bounds.sums`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..cost import in_flight
from ..cost.engine import AUTOCAST_COPY_BYTES
from ..cost.memory import fsdp2_state_bytes, model_state_bytes
from ..precision import DTYPE_BYTES
from ..strategy import Recompute, Schedule, stage_ranks

__all__ = ["MemoryBounds"]


class MemoryBounds:
    """What a rank holds and whether a uniform option fits (see the module docstring)."""

    engine: Any
    recompute: tuple[Recompute, ...]

    def capacities(self, pool: int, n: int, pp: int) -> tuple[float, ...]:
        """Each pipeline rank's usable memory for layers: the largest device memory among
        its devices (the engine's is one of them), less the reserve, over the
        fragmentation factor."""
        key = (pool, n, pp) if not self.engine.homogeneous else pp
        hit = self._caps.get(key)
        if hit is None and self.engine.homogeneous:
            mem = self.engine.cluster.device_types[0].memory_bytes
            hit = self._caps[key] = ((mem * self.fraction - self.reserve) / (1 + self.frag),) * pp
        if hit is None:
            cluster = self.engine.cluster
            devices = self.pools[pool].devices[:n]
            per_rank = n // pp
            caps = []
            for p in range(pp):
                mem = max(cluster.device_type_of(d).memory_bytes
                          for d in set(devices[p * per_rank:(p + 1) * per_rank]))
                caps.append((mem * self.fraction - self.reserve) / (1 + self.frag))
            hit = self._caps[key] = tuple(caps)
        return hit

    def _room(self, pool: int, n_devices: int, kind: tuple[int, ...], pp: int, v: int,
              tp: int, cp: int, ep: int, sp: bool, zero: int, b: int, schedule: Schedule,
              m: int, caps: Sequence[float] | None = None
              ) -> tuple[float, list[tuple[float, float]], tuple[float, ...]]:
        """The memory model the bounds share: each block's model states (and, under
        autocast, its cached 16-bit weight copy), and per rank the bytes left for its
        blocks and its micro-batches in flight.  A rank's fixed bytes: the embeddings or
        head it holds (states and activations) and its pipeline buffers (receive buffers
        of every micro-batch of the step where the stack keeps them, else a receive and a
        send buffer of a boundary); every other buffer of the engine is left out."""
        m = self._flight_count(schedule, pp, v, m)
        key = (pool, n_devices, id(kind), pp, v, tp, cp, ep, sp, zero, b, schedule, m,
               None if caps is None else tuple(caps))
        hit = self._rooms.get(key)
        if hit is not None and hit[0] is kind:
            return hit[1]
        out = self._room_of(pool, n_devices, kind, pp, v, tp, cp, ep, sp, zero, b, schedule,
                            m, caps)
        if len(self._rooms) > 65536:
            self._rooms.clear()
        self._rooms[key] = (kind, out)
        return out

    def _flight_count(self, schedule: Schedule, pp: int, v: int, m: int) -> int:
        """``m``, or a smaller count the memory model sees alike: past ``(v + 1) pp``
        micro-batches no rank holds more in flight (:func:`autoplan.cost.in_flight`;
        GPipe holds all of them), and only ``m > 1`` changes the states (gradients
        accumulate); the per-micro-batch pipeline buffers grow with every one."""
        if pp == 1:
            return min(m, 2)
        if schedule is Schedule.GPIPE or getattr(self.engine.options,
                                                 "pp_buffers_per_micro_batch", False):
            return m
        return min(m, (v + 1) * pp + 1)

    def _room_of(self, pool: int, n_devices: int, kind: tuple[int, ...], pp: int, v: int,
                 tp: int, cp: int, ep: int, sp: bool, zero: int, b: int, schedule: Schedule,
                 m: int, caps: Sequence[float] | None
                 ) -> tuple[float, list[tuple[float, float]], tuple[float, ...]]:
        x = self.sums(kind, tp, cp, ep, sp, 1, Recompute.NONE, b)   # (bytes: any stage)
        shards = n_devices // pp // tp          # dp x cp: what ZeRO shards over
        edp = max(1, shards // ep)
        opts = self.engine.options
        copy = AUTOCAST_COPY_BYTES if getattr(opts, "autocast", False) \
            and self.recipe.dtype != "fp32" else 0.0
        # bytes per parameter, outside and inside expert banks, as the engine holds them
        dense = self._state_bytes(zero, shards, m) + copy
        expert = self._state_bytes(zero, edp, m) + copy

        def held(counts) -> tuple[float, float]:
            """States, and activations per micro-batch in flight, of those layers."""
            return (sum(c * (x.params[t] * dense + x.expert_params[t] * expert)
                        for t, c in counts),
                    sum(c * x.saved[t] for t, c in counts))

        caps = caps or self.capacities(pool, n_devices, pp)
        ranks, ends = self._stage_ends(schedule, pp, v)
        first, last = ranks[0], ranks[-1]
        boundary = self.boundary_bytes * b * self.recipe.activation_scale / cp
        if pp > 1 and getattr(opts, "pp_buffers_per_micro_batch", False):
            buffers = m * boundary                  # per chunk end
        else:
            buffers = 2 * boundary / tp if pp > 1 else 0.0
        per_end = getattr(opts, "pp_buffers_per_micro_batch", False)
        if self.num_blocks:
            pre, post = held(self.pre), held(self.post)
        else:
            pre, post = held(self.layers), (0.0, 0.0)
        flights = self._flights(schedule, pp, m, v)
        if per_end:
            out = [(cap - buffers * e, f) for cap, e, f in zip(caps, ends, flights)]
        else:
            out = [(cap - buffers, f) for cap, f in zip(caps, flights)]
        free, f = out[first]
        out[first] = (free - pre[0] - f * pre[1], f)
        free, f = out[last]
        out[last] = (free - post[0] - f * post[1], f)
        states = tuple(x.params[t] * dense + x.expert_params[t] * expert
                       for t in self.block_templates)
        return min(states, default=0.0), out, states

    def _sizes(self, states: Sequence[float], saved: Sequence[float]
               ) -> list[tuple[float, float, int]]:
        """``(states, saved, blocks)`` of each kind of block, templates alike merged."""
        merged: dict[tuple[float, float], int] = {}
        for x, a, count in zip(states, saved, self.block_counts):
            merged[(x, a)] = merged.get((x, a), 0) + count
        return [(x, a, count) for (x, a), count in merged.items()]

    def _most_blocks(self, free: float, flight: float,
                     sizes: list[tuple[float, float, int]]) -> int:
        """The most blocks a rank holds in ``free`` bytes, each its template's model
        states and ``flight`` micro-batches of its saved bytes (:meth:`_sizes`): the
        smallest first, so no split of the blocks puts more on the rank (-1: ``free`` is
        negative)."""
        if free < 0:
            return -1
        if len(sizes) == 1:
            x, a, _ = sizes[0]
            size = x + flight * a
            return self.num_blocks if size <= 0 else math.floor(free / size)
        held = 0
        for size, count in sorted((x + flight * a, count) for x, a, count in sizes):
            if size <= 0:
                held += count
                continue
            take = min(count, max(0, math.floor(free / size)))
            held += take
            if take < count:
                break
            free -= take * size
        return held

    def _state_bytes(self, zero: int, shards: int, m: int) -> float:
        """Model-state bytes of one parameter at ZeRO stage ``zero`` over ``shards`` ranks,
        ``m`` micro-batches a step: what the engine holds (FSDP2's fp32 master weights
        and compute copies, :func:`~autoplan.cost.memory.fsdp2_state_bytes`, where the
        recipe runs them; else :func:`~autoplan.cost.memory.model_state_bytes`)."""
        key = (zero, shards, m > 1)
        hit = self._per_param_bytes.get(key)
        if hit is not None:
            return hit
        pb, gb, ob = self.per_param
        if getattr(self.recipe, "fsdp2_master", False):
            hit = sum(fsdp2_state_bytes(1.0, zero=zero, shards=shards,
                                        master_bytes=DTYPE_BYTES["fp32"], compute_bytes=pb,
                                        grad_bytes=gb, optimizer_bytes=ob, accumulates=m > 1))
        else:
            hit = sum(model_state_bytes(1.0, zero=zero, shards=shards, per_param=(pb, gb, ob)))
        self._per_param_bytes[key] = hit
        return hit

    def _flights(self, schedule: Schedule, pp: int, m: int, v: int) -> tuple[float, ...]:
        """Each rank's micro-batches in flight (:func:`autoplan.cost.in_flight`)."""
        key = (schedule, pp, m, v)
        hit = self._flight.get(key)
        if hit is None:
            hit = self._flight[key] = tuple(in_flight(schedule, p, pp, m, v) for p in range(pp))
        return hit

    def _stage_ends(self, schedule: Schedule, pp: int, v: int) -> tuple[tuple[int, ...], list[int]]:
        """The rank of each virtual stage, and each rank's chunk inputs and outputs that
        cross to another stage."""
        key = (schedule, pp, v)
        hit = self._ends.get(key)
        if hit is None:
            ranks = stage_ranks(schedule, pp, pp * v)
            ends = [0] * pp
            for k, p in enumerate(ranks):
                ends[p] += (k > 0) + (k < len(ranks) - 1)
            hit = self._ends[key] = (tuple(ranks), ends)
        return hit

    def fits(self, pool: int, n_devices: int, kind: tuple[int, ...], pp: int, v: int, tp: int,
             cp: int, ep: int, sp: bool, zero: int, rc: Recompute, b: int,
             schedule: Schedule, m: int, caps: Sequence[float] | None = None) -> bool:
        """Whether the uniform option ``(zero, rc)`` can fit some split of the blocks over
        the ranks (module docstring; blocks of several templates each at its own size,
        :meth:`_most_blocks`); False proves no layout of it fits."""
        _, ranks, states = self._room(pool, n_devices, kind, pp, v, tp, cp, ep, sp, zero, b,
                                      schedule, m, caps)
        n = self.num_blocks
        if not n:
            return ranks[0][0] >= 0
        x = self.sums(kind, tp, cp, ep, sp, 1, rc, b)
        return self._hold_blocks(ranks, self._sizes(states, [x.saved[t]
                                                            for t in self.block_templates]), v)

    def _hold_blocks(self, room_of: Sequence[tuple[float, float]],
                     sizes: list[tuple[float, float, int]], v: int) -> bool:
        """Whether ranks of ``(free bytes, micro-batches in flight)`` can hold every block
        between them (:meth:`_most_blocks` each), each at least ``v`` (a block per chunk)."""
        n, room = self.num_blocks, 0
        for free, flight in room_of:
            most = self._most_blocks(free, flight, sizes)
            if most < v:
                return False                 # each chunk holds at least one block
            room += min(n, most)
        return room >= n

    def allocated(self, pool: int, n_devices: int, kind: tuple[int, ...], pp: int, v: int,
                  tp: int, cp: int, ep: int, sp: bool, zero: int, rc: Recompute, b: int,
                  schedule: Schedule, m: int, blocks: Sequence[int]) -> list[float]:
        """The bytes the model above gives each rank of a uniform layout with ``blocks[p]``
        blocks on rank ``p`` (before the reserve and fragmentation)."""
        block, ranks, _ = self._room(pool, n_devices, kind, pp, v, tp, cp, ep, sp, zero, b,
                                     schedule, m)
        x = self.sums(kind, tp, cp, ep, sp, 1, rc, b)
        saved = min((x.saved[t] for t in self.block_templates), default=0.0)
        caps = self.capacities(pool, n_devices, pp)
        return [caps[p] - free + k * (block + flight * saved)
                for p, ((free, flight), k) in enumerate(zip(ranks, blocks))]

    def peak_bound(self, pool: int, n_devices: int, kind: tuple[int, ...], pp: int, v: int,
                   tp: int, cp: int, ep: int, sp: bool, zero: int, rc: Recompute, b: int,
                   schedule: Schedule, m: int, blocks: Sequence[int]) -> float:
        """The least peak memory the model above gives a uniform layout with ``blocks[p]``
        blocks on rank ``p``: what the search checks the engine against."""
        used = max(self.allocated(pool, n_devices, kind, pp, v, tp, cp, ep, sp, zero, rc, b,
                                  schedule, m, blocks))
        return self.reserve + (1 + self.frag) * used

    def least_memory(self, zero: int, schedule: Schedule) -> Recompute | None:
        """The recompute option that saves the most memory among those allowed (full,
        then selective, then none; zero-bubble schedules run no selective)."""
        for rc in (Recompute.FULL, Recompute.SELECTIVE, Recompute.NONE):
            if rc in self.recompute and not (schedule is Schedule.ZERO_BUBBLE
                                             and rc is Recompute.SELECTIVE):
                return rc
        return None
