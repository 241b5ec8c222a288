"""What the search may choose from, and its budget: :class:`SearchSpace`, the step budget
(:data:`WORK_LIMIT`, :class:`SearchLimit`) and the rules that list the degrees, micro-batch
sizes, schedules and memory ladder a combination may take (:mod:`autoplan.search.search`
says how they are searched)."""

from __future__ import annotations

import difflib
import enum
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError, RecordError
from ..graph import LayerKind, ModelGraph
from ..strategy import Recompute, Schedule
from .fleet import Pool

__all__ = ["SearchSpace", "SearchLimit", "WORK_LIMIT"]


#: The search's default budget, in steps: an entry of its queue expanded (the bounds of a
#: combination's children), a layout priced, or a candidate refined with CP-SAT.  Steps,
#: not seconds, so that the same inputs give the same plan however loaded the machine is.
#: The largest search benchmarked takes about 104,000 steps (DeepSeek-V3 on 1,024 H100s,
#: ``benchmarks/search_speed.py``; a 1T-parameter GPT on 3,072 A100s 65,000, GPT-3 175B on
#: 122 A100 nodes 27,000): the limit leaves it five times that, and stops a search of a far
#: larger space after a few minutes of CPU (2,500-3,500 steps a CPU second on those
#: searches) with its best plan so far.
WORK_LIMIT = 500_000


class SearchLimit(enum.Enum):
    """Which budget stopped a search before its bounds did (``SearchResult.limit``)."""

    WORK = "work"        # ``work_limit`` steps (deterministic)
    TIME = "time"        # ``time_limit_s`` of wall clock (asked for; depends on the load)


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose from (defaults: everything the cost model prices, all of
    which :func:`autoplan.parallelize` runs).

    ``context_parallel`` degrees (None: every degree that leaves each rank at least
    ``min_context_tokens`` of a sequence) are tried wherever the sequence splits into
    ``2 cp`` chunks (the load-balanced split the runtime uses); whether they pay is the
    cost model's call (memory of long sequences against the key/value all-gather).  ``even_batches`` keeps every replica's batch equal (no speed-proportional
    split, no shorter micro-batch).  ``expert_parallel`` degrees are tried for models with
    expert banks, where they divide ``dp x cp`` and every layer's experts and their groups
    (``ep x tp`` consecutive devices) fit one NVLink domain or span whole nodes; for those
    models the search also leaves out sequence parallelism and selective recompute, which
    the runtime does not run on MoE blocks.  ``refine``: at most this many candidates are
    refined with CP-SAT (None: every one whose bound is below the best plan)."""

    schedules: tuple[Schedule, ...] = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED,
                                       Schedule.ZERO_BUBBLE, Schedule.GPIPE)
    virtual_stages: tuple[int, ...] = (2, 4)
    micro_batches: tuple[int, ...] | None = None   # None: every divisor of the replica batch
    max_micro_batch: int = 64
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    sequence_parallel: tuple[bool, ...] = (True, False)
    context_parallel: tuple[int, ...] | None = None   # None: every degree the sequence allows
    min_context_tokens: int = 256  # (context_parallel=None) tokens of a sequence per cp rank
    refine: int | None = None      # candidates refined with CP-SAT (None: as the bound says)
    tensor_parallel: tuple[int, ...] | None = None    # None: every degree that fits a node
    expert_parallel: tuple[int, ...] | None = None    # None: every degree dividing the experts
    pipeline_parallel: tuple[int, int] | None = None  # (min, max) pp; None: any
    even_batches: bool = False     # True: every replica gets the same batch (no speed split)

    def recorded(self) -> dict[str, Any]:
        """What a plan records of this space (``Plan.search_space``): the fields that are
        not the defaults, as plain values; empty for the default space.

        >>> SearchSpace(zero=(0, 1), schedules=(Schedule.ONE_F_ONE_B,)).recorded()
        {'schedules': ['1f1b'], 'zero': [0, 1]}
        """
        default = SearchSpace()
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                out[f.name] = ([v.value if isinstance(v, enum.Enum) else v for v in value]
                               if isinstance(value, tuple) else value)
        return out

    @classmethod
    def from_recorded(cls, recorded: dict[str, Any]) -> "SearchSpace":
        """The space a plan recorded (:meth:`recorded`); a :class:`RecordError` naming what
        is wrong with a bad record."""
        kinds = {f.name: f for f in fields(cls)}
        out: dict[str, Any] = {}
        for name, value in recorded.items():
            if name not in kinds:
                near = difflib.get_close_matches(name, list(kinds), n=1)
                raise RecordError(f"unknown search space field {name!r}"
                                  + (f" (did you mean {near[0]!r}?)" if near else ""),
                                  "search_space")
            try:
                if name == "schedules":
                    value = tuple(Schedule(v) for v in value)
                elif name == "recompute":
                    value = tuple(Recompute(v) for v in value)
                elif isinstance(value, list):
                    value = tuple(value)
            except (TypeError, ValueError) as exc:
                raise RecordError(f"{name}: {exc}", "search_space") from None
            out[name] = value
        return cls(**out)


def _check_limits(time_limit_s: Any, work_limit: Any) -> None:
    """``time_limit_s``: None or positive seconds; ``work_limit``: None or a positive
    number of steps (ConfigError, one line, otherwise)."""
    if time_limit_s is not None and (isinstance(time_limit_s, bool)
                                     or not isinstance(time_limit_s, numbers.Real)
                                     or not time_limit_s > 0):
        raise ConfigError(f"time_limit_s must be positive seconds or None (no wall-clock "
                          f"cap, the default), got {time_limit_s!r}")
    if work_limit is not None and (isinstance(work_limit, bool)
                                   or not isinstance(work_limit, numbers.Integral)
                                   or work_limit < 1):
        raise ConfigError(f"work_limit must be a positive whole number of search steps or "
                          f"None (no limit), got {work_limit!r} (default {WORK_LIMIT})")


# ------------------------------------------------------------------ helpers
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _blocks_tp_limit(graph: ModelGraph) -> int:
    g = 0
    for l in graph.layers:
        if l.kind is LayerKind.BLOCK:
            g = math.gcd(g, l.tp.max_degree())
    return g or 1


def _domain_size(cluster) -> int:
    """The size of the device groups that tile every node's devices (its NVLink domain):
    the greatest common divisor of the nodes' device counts.

    Ranks are laid out over the cluster's device order, so groups of ``g`` consecutive
    devices start at multiples of ``g``; none straddles two nodes exactly when ``g``
    divides every node's device count, i.e. this number.  On clusters of whole 8-GPU
    nodes it is 8; on GB200 NVL72 racks 72 (whole racks), 64 (64 GPUs of each rack in
    use) or 8 (the first 128 GPUs of two racks: 72 + 56).

    >>> from autoplan.hardware import load_cluster
    >>> racks = load_cluster("gb200-nvl72", nodes=2)
    >>> _domain_size(racks), _domain_size(racks.subset(range(128)))
    (72, 8)
    """
    return math.gcd(*(len(n.local_ranks) for n in cluster.nodes))


def _placed(pool: Pool, n: int, span: int) -> bool:
    """Whether groups of ``span`` consecutive devices of the first ``n`` of ``pool`` sit
    alike: each inside one NVLink domain, or each over whole nodes of one size.

    >>> from autoplan.hardware import load_cluster
    >>> from autoplan.search.fleet import pools
    >>> racks = pools(load_cluster("gb200-nvl72", nodes=2))[0]
    >>> [_placed(racks, 144, g) for g in (8, 16, 72, 144)]
    [True, False, True, True]
    """
    if pool.domain(n) % span == 0:
        return True
    whole = pool.whole_node(n)
    return whole is not None and span % whole == 0 and n % span == 0


def _micro_batches(space: SearchSpace, per_replica: int) -> list[int]:
    """Micro-batch sizes tried for replicas of about ``per_replica`` sequences: every
    divisor (what an expert would try), and powers of two for batches that split
    unevenly."""
    if space.micro_batches is not None:
        return sorted({mb for mb in space.micro_batches if 1 <= mb <= per_replica})
    top = min(per_replica, space.max_micro_batch)
    return sorted({d for d in _divisors(per_replica) if d <= space.max_micro_batch}
                  | {2 ** i for i in range(7) if 2 ** i <= top})


def _schedules(space: SearchSpace, pp: int, m: int, blocks: int) -> list[tuple[Schedule, int]]:
    """Pipeline schedules and chunks per rank worth pricing with ``m`` micro-batches.

    GPipe only where 1F1B cannot run (fewer micro-batches than stages): the cost model
    times them alike ((m - 1) x the slowest rank + every rank once) and GPipe holds every
    micro-batch in flight where 1F1B holds at most pp, so GPipe is never the faster
    layout that fits."""
    if pp == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    one_f_one_b = Schedule.ONE_F_ONE_B in space.schedules and m >= pp
    out: list[tuple[Schedule, int]] = []
    for s in space.schedules:
        if s is Schedule.GPIPE and one_f_one_b:
            continue
        if s is Schedule.INTERLEAVED:
            out += [(s, v) for v in space.virtual_stages
                    if blocks >= pp * v and m >= pp and m % pp == 0]
        elif s is Schedule.ZERO_BUBBLE:
            if blocks >= 2 * pp and m >= 2 * pp:
                out.append((s, 2))
        elif s is Schedule.ONE_F_ONE_B:
            if m >= pp:
                out.append((s, 1))
        else:
            out.append((s, 1))
    return out


def _ladder(space: SearchSpace, schedule: Schedule) -> tuple[list[int], list[Recompute]]:
    """ZeRO stages and recompute options (least time first) a schedule may use: torch
    runs neither ZeRO-3 nor selective recompute under zero-bubble schedules
    (strategy.ZBV_ZERO3, ZBV_SELECTIVE)."""
    zbv = schedule is Schedule.ZERO_BUBBLE
    rcs = [r for r in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
           if r in space.recompute and not (zbv and r is Recompute.SELECTIVE)]
    return [z for z in sorted(set(space.zero)) if not (zbv and z == 3)], rcs
