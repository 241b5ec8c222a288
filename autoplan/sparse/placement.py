"""Placing embedding tables: OR-Tools CP-SAT, and a TorchRec-style greedy baseline.

Both choose, for every table, one placement (:class:`~.plan.TablePlacement`) among the
same options (:func:`~.options.table_options`), priced by the same cost model
(:class:`~.cost.SparseCostModel`, all options of all tables at once: :class:`~.options.Problem`),
and the dense part's ZeRO stage.

* :func:`greedy_plan` is TorchRec's planner in miniature (``GreedyProposer`` +
  ``GreedyPerfPartitioner``, torchrec/distributed/planner/): tables sorted by the cost of
  their cheapest option, each placed in turn on its cheapest kind of option that fits,
  on the least loaded device.
* :func:`plan_sparse` starts from hill climbs (:func:`_climb`: one table moved at a time
  to the option that lowers the step most, every table's moves scored at once) from
  greedy placements, then solves CP-SAT: a boolean per (table, option), one per table;
  every device's, node's host and server's memory bound what they hold; the objective is
  the step (``dense + busiest worker + busiest server``, :mod:`.cost`), or with prices the
  cost per sample (one solve per number of servers rented).  The climb is its hint.

CP-SAT first solves without the memory constraints and without the options no faster
anywhere than another of the same table (host memory where the device's would do: they
only save memory).  Every plan maps onto that smaller model no slower, so its bound
bounds the whole problem; when its answer fits in memory it is the answer, and only
when memory binds is the whole model solved.  Up to ``window`` tables are solved at
once; beyond, CP-SAT improves windows of half as many tables around the busiest device
in turn (until a window improves nothing: the next would free the same tables), the
others fixed.  The time CP-SAT gets grows with the number of tables (deterministic time:
a plan does not depend on the machine's load).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from ortools.sat.python import cp_model

from ..cost.calibration import DEFAULT_CALIBRATION, Calibration
from ..cost.constants import CostOptions
from ..errors import ConfigError, InfeasiblePlan
from ..hardware.cluster import Cluster, as_cluster
from ..records import Record
from ..strategy import Precision
from .cost import SparseConstants, SparseCostModel
from .options import KINDS, Problem, table_options
from .plan import SparseOptimizer, SparsePlan, Storage, TablePlacement
from .tables import SparseGraph

__all__ = ["Prices", "table_options", "plan_sparse", "greedy_plan", "estimate_sparse"]

#: Integer units of the CP-SAT model: time in 10 ns ticks, memory in bytes.
_TICKS_PER_S = 1e8
_ZERO_STAGES = (0, 1, 2, 3)
#: The share of free device memory TorchRec's planner keeps from tables
#: (``HeuristicalStorageReservation(percentage=0.15)``, torchrec/distributed/planner/
#: storage_reservations.py); the greedy baseline does the same.
_TORCHREC_HBM_RESERVE = 0.15
#: CP-SAT's deterministic seconds when the caller states none: a base and a share per
#: table, capped (measured on 2 shared cores: DLRM-DCNv2's 26 tables on 8 and 16 A100s
#: reach their best plan within 0.5; windows of 2,000 tables improve little beyond 2).
_BUDGET_BASE_S = 0.5
_BUDGET_PER_TABLE_S = 0.001
_BUDGET_MAX_S = 2.5
#: Deterministic seconds a window of a large problem gets (measured on 2,000 synthetic
#: tables, 16 A100s, 2 servers: windows of 32 tables improve the hint as much with 0.1 as
#: with 0.25, windows of 64 less with either: their models do not close in that time).
_WINDOW_TIME_S = 0.1
#: Passes of the hill climb over every table at most.
_CLIMB_PASSES = 10
#: Passes of the short climbs that rank the hint's starts (:func:`_hint`).
_SCREEN_PASSES = 3


@dataclass(frozen=True)
class Prices(Record):
    """Rental prices for the ``cost`` objective, with where they come from."""

    device_hour: float     # one device (GPU) for an hour
    server_hour: float     # one CPU server for an hour
    source: str

    def __post_init__(self) -> None:
        if not (self.device_hour > 0 and self.server_hour >= 0):
            raise ConfigError(f"prices must be > 0 per device hour and >= 0 per server hour, "
                              f"got {self.device_hour!r}, {self.server_hour!r}")

    def per_hour(self, devices: int, servers: int) -> float:
        return devices * self.device_hour + servers * self.server_hour


# ---------------------------------------------------------------------------- greedy
def _greedy(prob: Problem, storages: frozenset[Storage] | None = None) -> np.ndarray:
    """TorchRec-style greedy: tables by the perf of their cheapest option, largest first;
    each on its cheapest kind of option that fits, on the least loaded devices (options
    storing rows in ``storages`` only, when given)."""
    hbm, host, srv = prob.capacities(0)
    # as TorchRec's planner, tables take at most (1 - reserve) of the free device memory;
    # the reserve is the last resort of a table that fits nowhere else
    reserve = hbm * _TORCHREC_HBM_RESERVE
    table_hbm = hbm - reserve
    load = np.zeros(len(prob.model.workers))
    sload = np.zeros(len(prob.model.servers))
    allowed = prob.storage_in(storages)
    # (the order is TorchRec's: by the cheapest option of any storage)
    lowest = prob.perf.min(axis=1)
    order = sorted(range(len(prob)), key=lambda i: (-float(lowest[i]), i))
    chosen = np.full(len(prob), -1, dtype=np.int64)
    for i in order:
        n = prob.count[i]
        dev_hbm = prob.device_hbm[i, :n]
        rest = ((prob.host[i, :n] <= host).all(axis=1) & (prob.smem[i, :n] <= srv).all(axis=1)
                & allowed[i, :n])
        fits = (dev_hbm <= table_hbm).all(axis=1) & rest
        if not fits.any():
            fits = (dev_hbm <= table_hbm + reserve).all(axis=1) & rest
        for group in prob.groups[i]:
            fitting = group[fits[group]]
            if not len(fitting):
                continue
            # the least loaded of the devices (or servers) each option would use
            busy = np.maximum(
                np.where(prob.own[i, fitting] > 0, load, 0.0).max(axis=1, initial=0.0),
                np.where(prob.srv[i, fitting] > 0, sload, 0.0).max(axis=1, initial=0.0))
            o = int(fitting[int(np.argmin(busy))])
            load += prob.device_s[i, o]
            sload += prob.srv[i, o]
            table_hbm -= dev_hbm[o]
            reserve += np.minimum(table_hbm, 0.0)       # what the reserve lent
            table_hbm = np.maximum(table_hbm, 0.0)
            host -= prob.host[i, o]
            srv -= prob.smem[i, o]
            chosen[i] = o
            break
        if chosen[i] < 0:
            tb = prob.model.graph.tables[i]
            raise InfeasiblePlan(
                f"no placement of table {tb.name!r} ({tb.weight_bytes / 2**30:.2f} GiB) fits what "
                "the tables placed before it left: add devices, host memory or servers",
                required_bytes=float(tb.weight_bytes), binding="memory")
    return chosen


# ---------------------------------------------------------------------------- hill climbing
def _climb(prob: Problem, chosen: np.ndarray, zero: int, allowed: np.ndarray,
           max_passes: int = _CLIMB_PASSES) -> np.ndarray:
    """Hill climbing from ``chosen``: move one table at a time to the option that lowers
    the step most while every memory fits (``allowed`` options only, which hold every
    device-memory twin of a host-stored option they hold), table after table, until a
    pass over them all moves none.

    A host-stored option no faster than its device twin (:attr:`~.options.Problem.slower_twin`)
    improves on nothing its twin does not, so the climb first leaves those out; only
    when memory then keeps a table from a move that would help are they let in.
    """
    chosen, blocked = _descend(prob, chosen, zero, allowed & ~prob.slower_twin, max_passes)
    if blocked:
        chosen, _ = _descend(prob, chosen, zero, allowed, max_passes)
    return chosen


def _descend(prob: Problem, chosen: np.ndarray, zero: int, allowed: np.ndarray,
             max_passes: int) -> tuple[np.ndarray, bool]:
    """:func:`_climb` over ``allowed`` options (and each table's current one); returns the
    options and whether memory kept a table from an improving move in the last pass (or
    the passes ran out).

    A move improves when it lowers the step (the busiest device's and server's loads) or
    keeps it and lowers the spread of the loads (the sum of their squares), so that a
    move off one of several equally busy devices counts (a plateau of the max otherwise).
    """
    n_t, n_d = len(prob), prob.device_s.shape[2]
    t = np.arange(n_t)
    chosen = np.array(chosen, dtype=np.int64)
    # each table's options the climb may take, first in a row (tables x width)
    keep = allowed.copy()
    keep[t, chosen] = True
    width = int(keep.sum(axis=1).max())
    cols = np.argsort(~keep, axis=1, kind="stable")[:, :width]
    mask = np.take_along_axis(keep, cols, axis=1)
    pos = np.argmax(cols == chosen[:, None], axis=1)
    # seconds on devices then servers; bytes on devices, hosts, servers; masked out: 0
    load = np.where(mask[:, :, None], np.concatenate(
        [prob.device_s[t[:, None], cols], prob.srv[t[:, None], cols]], axis=2), 0.0)
    mem = np.where(mask[:, :, None], np.concatenate(
        [prob.device_hbm[t[:, None], cols], prob.host[t[:, None], cols],
         prob.smem[t[:, None], cols]], axis=2), 0.0)
    square = (load ** 2).sum(axis=2)
    mem_max = mem.max(axis=1)
    cap = np.concatenate(prob.capacities(zero))
    total = load[t, pos].sum(axis=0)
    used = mem[t, pos].sum(axis=0)
    has_servers = load.shape[2] > n_d
    blocked = True
    for _ in range(max_passes):
        moved = blocked = False
        for i in range(n_t):
            c = pos[i]
            li, mi = load[i], mem[i]
            rest = total - li[c]
            after = rest + li                             # options x resources
            step = after[:, :n_d].max(axis=1)
            if has_servers:
                step = step + after[:, n_d:].max(axis=1)
            spread = li @ (2 * rest) + square[i] + rest @ rest
            ok = mask[i]
            slack = cap - (used - mi[c])
            if not (mem_max[i] <= slack).all():           # some option may not fit
                ok = ok & (mi <= slack).all(axis=1)
            now = step[c] if ok[c] else np.inf
            tol = now * 1e-9
            better = (step < now - tol) | ((step <= now + tol)
                                           & (spread < spread[c] * (1 - 1e-9)))
            better &= mask[i]
            if not (better & ok).any():
                blocked |= bool(better.any())
                continue
            opts = np.flatnonzero(better & ok)
            best = int(opts[np.lexsort((spread[opts], step[opts]))[0]])
            total = after[best]
            used = used - mi[c] + mi[best]
            pos[i] = best
            moved = True
        if not moved:
            break
    return cols[t, pos], blocked


def _hint(prob: Problem) -> tuple[np.ndarray, int]:
    """The CP-SAT hint and its ZeRO stage: the best of hill climbs from greedy placements
    that keep rows in device memory, and in host memory or on servers or both.  One
    move changes one table, so a climb from a start that uses servers rarely empties
    them (each table moved off costs the workers before the last one frees the servers);
    starting without them finds the plans that do not rent them.  The dense part then
    takes the fastest ZeRO stage that leaves the tables their memory, and the climb
    goes on there."""
    present = {s for s, used in zip(Storage, np.bincount(prob.storage[prob.valid],
                                                          minlength=len(Storage))) if used}
    families = [frozenset({Storage.HOST, Storage.HOST_CACHED}) & present,
                frozenset({Storage.SERVER}) & present]
    families = [f for f in families if f]
    best: tuple[float, np.ndarray, frozenset[Storage]] | None = None
    seen: set[bytes] = set()
    for r in range(len(families) + 1):
        for extra in itertools.combinations(families, r):
            allowed = frozenset({Storage.HBM}.union(*extra))
            try:
                start = _greedy(prob, allowed)
            except InfeasiblePlan:
                continue
            if start.tobytes() in seen:     # the greedy left the new storages unused
                continue
            seen.add(start.tobytes())
            # a short climb ranks the starts; the best one climbs on to the end
            chosen = _climb(prob, start, 0, prob.storage_in(allowed), _SCREEN_PASSES)
            score = prob.objective(chosen, 0)
            if best is None or score < best[0]:
                best = (score, chosen, allowed)
    if best is None:        # no greedy start fits: CP-SAT starts from the cheapest options
        return np.argmin(prob.perf, axis=1), 0
    chosen = _climb(prob, _climb(prob, best[1], 0, prob.storage_in(best[2])), 0, prob.valid)
    zero = min((z for z in _ZERO_STAGES if prob.fits(chosen, z)),
               key=lambda z: (prob.objective(chosen, z), z))
    if zero:
        chosen = _climb(prob, chosen, zero, prob.valid)
    return chosen, zero


# ---------------------------------------------------------------------------- CP-SAT
def _ticks(values: np.ndarray) -> np.ndarray:
    return np.rint(values * _TICKS_PER_S).astype(np.int64)


def _bytes(values: np.ndarray) -> np.ndarray:
    return np.ceil(values).astype(np.int64)


def _efficient(prob: Problem, i: int) -> np.ndarray:
    """The options of table ``i`` that no other of its options beats on time: no faster
    on every device and server (ties: the first).  The others only save memory."""
    n = prob.count[i]
    t = np.concatenate([prob.device_s[i, :n], prob.srv[i, :n]], axis=1)
    le = (t[None, :, :] <= t[:, None, :]).all(axis=2)          # [o, p]: p no slower than o
    eq = (t[None, :, :] == t[:, None, :]).all(axis=2)
    earlier = np.arange(n)[None, :] < np.arange(n)[:, None]
    dominated = ((le & ~eq) | (eq & earlier)).any(axis=1)
    return np.flatnonzero(~dominated)


@dataclass
class _Solved:
    chosen: np.ndarray
    zero: int
    status: str          # CP-SAT's, lower case ("unknown": the hint stands)
    bound_s: float       # its proven lower bound on the step


def _solve(prob: Problem, hint: np.ndarray, hint_zero: int, free: Sequence[int],
           options: Sequence[np.ndarray], *, memory: bool, max_deterministic_time_s: float,
           seed: int, presolve: bool = True) -> _Solved:
    """CP-SAT over ``options[j]`` of each ``free[j]`` table (the others keep their
    ``hint`` option) and the dense ZeRO stage, with every memory's constraint or none."""
    m = prob.model
    n_dev, n_srv, n_node = len(m.workers), len(m.servers), m.cluster.num_nodes
    free = np.asarray(free, dtype=np.int64)
    fixed = np.setdiff1d(np.arange(len(prob)), free)

    # Data: what the fixed tables load every resource with; the free tables' options.
    def held(arr: np.ndarray) -> np.ndarray:
        return arr[fixed, hint[fixed]].sum(axis=0)

    fixed_dev, fixed_srv = _ticks(held(prob.device_s)), _ticks(held(prob.srv))
    fixed_hbm, fixed_host, fixed_smem = (_bytes(held(a)) for a in (prob.device_hbm, prob.host,
                                                                   prob.smem))
    kinds = [prob.kind[i, opts] for i, opts in zip(free, options)]
    own = [_ticks(prob.own[i, opts]) for i, opts in zip(free, options)]
    srv = [_ticks(prob.srv[i, opts]) for i, opts in zip(free, options)]
    base = [_ticks(prob.base[i]) for i in free]
    hbm = [_bytes(prob.device_hbm[i, opts] - prob.hbm_base[i, k])
           for i, opts, k in zip(free, options, kinds)]
    hbm_base = [_bytes(prob.hbm_base[i]) for i in free]
    host = [_bytes(prob.host[i, opts]) for i, opts in zip(free, options)]
    smem = [_bytes(prob.smem[i, opts]) for i, opts in zip(free, options)]
    at = [int(np.flatnonzero(opts == hint[i])[0]) for i, opts in zip(free, options)]

    model = cp_model.CpModel()
    # Variables: x[t, o] = table t takes option o; y[t, k] = its option is of kind k;
    # z[s] = the dense part runs ZeRO stage s; the busiest worker's and server's ticks.
    names = [prob.names[i] for i in free]
    x = [[model.new_bool_var(f"x[{names[j]},{o}]") for o in opts] for j, opts in enumerate(options)]
    y = [{k: model.new_bool_var(f"y[{names[j]},{KINDS[k]}]") for k in sorted(set(kinds[j].tolist()))}
         for j in range(len(free))]
    z = {s: model.new_bool_var(f"zero[{s}]") for s in _ZERO_STAGES}
    horizon = int(fixed_dev.max(initial=0) + fixed_srv.max(initial=0) + sum(
        int((own[j] + base[j][kinds[j]]).max() + srv[j].max(initial=0)) for j in range(len(free)))) + 1
    busiest_worker = model.new_int_var(0, horizon, "busiest_worker")
    busiest_server = model.new_int_var(0, horizon, "busiest_server")

    # Each table takes exactly one option, and y[t, k] says which kind it is.
    for j in range(len(free)):
        model.add_exactly_one(x[j])
        for k, yk in y[j].items():
            model.add(yk == sum(x[j][o] for o in np.flatnonzero(kinds[j] == k)))
    # The dense part runs one ZeRO stage.
    model.add_exactly_one(z.values())

    # Terms of every resource's time and memory, from the options' arrays.
    def collect(n_res: int, per_option: list[np.ndarray],
                per_kind: list[np.ndarray] | None = None) -> list[tuple[list, list]]:
        out: list[tuple[list, list]] = [([], []) for _ in range(n_res)]
        for j, arr in enumerate(per_option):
            for o, r in zip(*np.nonzero(arr)):
                out[r][0].append(x[j][o])
                out[r][1].append(int(arr[o, r]))
            if per_kind is not None:
                for k, yk in y[j].items():
                    for r in np.flatnonzero(per_kind[j][k]):
                        out[r][0].append(yk)
                        out[r][1].append(int(per_kind[j][k, r]))
        return out

    def total(terms: tuple[list, list]) -> cp_model.LinearExpr:
        return cp_model.LinearExpr.weighted_sum(*terms)

    dev_time = collect(n_dev, own, base)
    srv_time = collect(n_srv, srv)
    zs = [z[s] for s in _ZERO_STAGES]
    for d in range(n_dev):
        # Every worker's embedding time is at most the busiest worker's.
        model.add(total(dev_time[d]) + int(fixed_dev[d]) <= busiest_worker)
    for s in range(n_srv):
        # Every server's time is at most the busiest server's.
        model.add(total(srv_time[s]) + int(fixed_srv[s]) <= busiest_server)
    if memory:
        dev_mem = collect(n_dev, hbm, hbm_base)
        dense_bytes = [int(_bytes(np.array(prob.dense_hbm[s]))) for s in _ZERO_STAGES]
        for d in range(n_dev):
            # Every device holds the dense part's peak at its ZeRO stage and its shards.
            model.add(cp_model.LinearExpr.weighted_sum(dev_mem[d][0] + zs,
                                                       dev_mem[d][1] + dense_bytes)
                      + int(fixed_hbm[d]) <= int(m.devices[d].hbm_capacity))
        for n, terms in enumerate(collect(n_node, host)):
            # Every node's host memory holds its host-stored shards.
            model.add(total(terms) + int(fixed_host[n]) <= int(m.host_capacity(n)))
        for s, terms in enumerate(collect(n_srv, smem)):
            # Every server's memory holds its shards.
            model.add(total(terms) + int(fixed_smem[s]) <= int(m.servers[s].capacity))

    # Objective: the step (dense part + busiest worker + busiest server).
    dense_ticks = [int(_ticks(np.array(prob.dense_s[s]))) for s in _ZERO_STAGES]
    model.minimize(cp_model.LinearExpr.weighted_sum(zs, dense_ticks) + busiest_worker
                   + busiest_server)
    # The hint, complete: every variable (the busiest loads as the model sums them).
    hint_dev, hint_srv = fixed_dev.copy(), fixed_srv.copy()
    for j in range(len(free)):
        for o, xo in enumerate(x[j]):
            model.add_hint(xo, int(o == at[j]))
        for k, yk in y[j].items():
            model.add_hint(yk, int(kinds[j][at[j]] == k))
        hint_dev += own[j][at[j]] + base[j][kinds[j][at[j]]]
        hint_srv += srv[j][at[j]]
    for s in _ZERO_STAGES:
        model.add_hint(z[s], int(s == hint_zero))
    model.add_hint(busiest_worker, int(hint_dev.max(initial=0)))
    model.add_hint(busiest_server, int(hint_srv.max(initial=0)))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1                  # reproducible
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = max_deterministic_time_s
    solver.parameters.cp_model_presolve = presolve
    status = solver.solve(model)
    if status == cp_model.UNKNOWN:
        # out of time before a solution of its own: the hint (feasible) stands
        return _Solved(np.array(hint), hint_zero, "unknown", 0.0)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasiblePlan(f"no placement of the {len(prob)} tables fits the devices', "
                             f"hosts' and servers' memory ({solver.status_name(status)}): add "
                             "devices, host memory or servers", binding="memory")
    chosen = np.array(hint)
    for j, (i, opts) in enumerate(zip(free, options)):
        chosen[i] = opts[next(o for o in range(len(opts)) if solver.value(x[j][o]))]
    zero = next(s for s in _ZERO_STAGES if solver.value(z[s]))
    return _Solved(chosen, zero, solver.status_name(status).lower(),
                   solver.best_objective_bound / _TICKS_PER_S)


def _solve_scope(prob: Problem, hint: np.ndarray, zero: int, free: Sequence[int], *,
                 max_deterministic_time_s: float, seed: int, presolve: bool = True) -> _Solved:
    """CP-SAT over the ``free`` tables: first without memory constraints over their
    time-efficient options (:func:`_efficient`; every plan maps onto it no slower, so
    its bound bounds the whole problem); when its answer does not fit, the whole model
    from the hint (the bound the larger of the two)."""
    eff = [_efficient(prob, i) for i in free]
    start = np.array(hint)
    for i, opts in zip(free, eff):
        if hint[i] not in opts:         # the hint's option beaten on time: the one beating it
            faster = (prob.device_s[i, opts] <= prob.device_s[i, hint[i]]).all(axis=1) \
                & (prob.srv[i, opts] <= prob.srv[i, hint[i]]).all(axis=1)
            start[i] = opts[np.flatnonzero(faster)[0]]
    fast = _solve(prob, start, zero, free, eff, memory=False, seed=seed, presolve=presolve,
                  max_deterministic_time_s=max_deterministic_time_s)
    if fast.status != "unknown" and prob.fits(fast.chosen, fast.zero):
        return fast
    full = _solve(prob, hint, zero, free, [np.arange(prob.count[i]) for i in free], memory=True,
                  seed=seed, presolve=presolve, max_deterministic_time_s=max_deterministic_time_s)
    full.bound_s = max(full.bound_s, fast.bound_s)
    return full


def _search(prob: Problem, hint: np.ndarray, zero: int, *, window: int,
            max_deterministic_time_s: float, seed: int) -> tuple[_Solved, str]:
    """CP-SAT on the whole problem when it has at most ``window`` tables; otherwise on
    windows of ``window // 2`` tables at a time, the others fixed (a large-neighbourhood
    search), the time shared among the windows: the tables loading the busiest device
    most, with those loading the least busy least; the first window that improves
    nothing ends it (the next would be the same)."""
    n = len(prob)
    if n <= window:
        out = _solve_scope(prob, hint, zero, range(n), seed=seed,
                           max_deterministic_time_s=max_deterministic_time_s)
        return out, f"cp-sat {out.status}"
    size = max(1, window // 2)
    count = max(1, min(-(-n // size), int(max_deterministic_time_s / _WINDOW_TIME_S)))
    each = max_deterministic_time_s / count
    best = _Solved(np.array(hint), zero, "hint", 0.0)
    solved = 0
    for _ in range(count):
        w = _window(prob, best.chosen, size)
        # (presolving a window's model took its whole time in trials: 64 tables, 16 devices)
        out = _solve_scope(prob, best.chosen, best.zero, w, seed=seed, presolve=False,
                           max_deterministic_time_s=each)
        if not (prob.fits(out.chosen, out.zero) and
                prob.objective(out.chosen, out.zero) < prob.objective(best.chosen, best.zero)):
            break     # the next window would free the same tables from the same plan
        best, solved = out, solved + 1
    tried = min(count, solved + 1)
    return best, (f"cp-sat on {tried} window{'s' * (tried != 1)} of {size} "
                  f"table{'s' * (size != 1)} around the busiest device ({solved} improved on)")


def _window(prob: Problem, chosen: np.ndarray, size: int) -> np.ndarray:
    """The tables to free: half those loading the busiest device (or server) most, half
    those loading the least busy least (where the busiest one's work may go)."""
    t = np.arange(len(prob))
    dev = prob.device_s[t, chosen]
    srv = prob.srv[t, chosen]
    load = np.concatenate([dev, srv], axis=1)
    totals = load.sum(axis=0)
    busiest, idlest = int(np.argmax(totals)), int(np.argmin(totals))
    first = np.lexsort((t, -load[:, busiest]))[:size // 2]
    rest = np.setdiff1d(np.lexsort((t, load[:, idlest])), first, assume_unique=True)
    return np.sort(np.concatenate([first, rest[:size - len(first)]]))


def _budget(n_tables: int, stated: float | None) -> float:
    if stated is not None:
        return stated
    return min(_BUDGET_MAX_S, _BUDGET_BASE_S + _BUDGET_PER_TABLE_S * n_tables)


# ---------------------------------------------------------------------------- entry points
def _model(graph: SparseGraph, cluster: Cluster | str, global_batch: int, **kw) -> SparseCostModel:
    if not isinstance(graph, SparseGraph):
        raise ConfigError(f"expected a SparseGraph (autoplan.sparse.trace_sparse), got "
                          f"{type(graph).__name__}")
    return SparseCostModel(graph, as_cluster(cluster), global_batch=global_batch, **kw)


def _plan(prob: Problem, chosen: np.ndarray, zero: int, search: str,
          baseline: float | None = None, solve_s: float = 0.0,
          bound: float | None = None) -> SparsePlan:
    m = prob.model
    placements = tuple(prob.placement(t, int(o)) for t, o in enumerate(chosen))
    dense, _ = m.dense(zero)
    est = m.estimate(placements, dense)
    return SparsePlan(model=m.graph.model, title=m.graph.title, cluster=m.cluster.name,
                      num_devices=m.cluster.num_devices, num_servers=len(m.cluster.servers),
                      global_batch=m.global_batch, dense=dense, tables=placements,
                      optimizer=m.optimizer, estimate=est, search=search,
                      baseline_step_time_s=baseline, bound_step_time_s=bound,
                      solve_time_s=solve_s)


def greedy_plan(graph: SparseGraph, cluster: Cluster | str, *, global_batch: int,
                optimizer: SparseOptimizer | str = SparseOptimizer.ROWWISE_ADAGRAD,
                precision: Precision | str = Precision.BF16,
                storages: Iterable[Storage | str] | None = None, cache_fraction: float = 0.2,
                min_column_width: int = 32, options: CostOptions | None = None,
                constants: SparseConstants | None = None,
                calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> SparsePlan:
    """The TorchRec-style greedy placement (see the module docstring), priced by the same
    cost model as :func:`plan_sparse`; the dense part runs plain data parallelism (DDP)."""
    start = time.perf_counter()
    m = _model(graph, cluster, global_batch, optimizer=optimizer, precision=precision,
               options=options, constants=constants, calibration=calibration)
    prob = Problem.build(m, storages=_storages(storages), cache_fraction=cache_fraction,
                         min_column_width=min_column_width)
    return _plan(prob, _greedy(prob), 0, "greedy", solve_s=time.perf_counter() - start)


def plan_sparse(graph: SparseGraph, cluster: Cluster | str, *, global_batch: int,
                optimizer: SparseOptimizer | str = SparseOptimizer.ROWWISE_ADAGRAD,
                precision: Precision | str = Precision.BF16,
                storages: Iterable[Storage | str] | None = None, cache_fraction: float = 0.2,
                min_column_width: int = 32, objective: str = "time",
                prices: Prices | None = None, max_deterministic_time_s: float | None = None,
                window: int = 64, seed: int = 0, options: CostOptions | None = None,
                constants: SparseConstants | None = None,
                calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> SparsePlan:
    """Place every table and choose the dense part's ZeRO stage with CP-SAT.

    Parameters
    ----------
    graph : SparseGraph
        From :func:`~autoplan.sparse.trace_sparse`.
    cluster : Cluster or str
        Every device is a worker; servers (:meth:`~autoplan.Cluster.with_servers`) may hold
        tables.
    global_batch : int
        Samples per step, a multiple of the number of devices.
    optimizer : SparseOptimizer or str
        The embedding rows' optimizer (default row-wise Adagrad).
    precision : str
        The dense part's recipe.
    storages : iterable of Storage, optional
        Where rows may live (default: everywhere the cluster allows).
    cache_fraction : float
        The share of a host-stored shard's rows its device cache holds.
    min_column_width : int
        Narrowest column block a column-wise split may make.
    objective : {"time", "cost"}
        Minimise the step, or the cost per sample (``prices`` needed): one solve per
        number of servers rented (the first ones), the cheapest kept.
    prices : Prices, optional
    max_deterministic_time_s : float, optional
        CP-SAT's deterministic time limit per solve (a plan does not depend on the
        machine's load); by default 0.5 s plus 1 ms per table, at most 2.5 s.  The
        result says whether it proved optimality.
    window : int
        Up to this many tables, one CP-SAT model holds them all; beyond, CP-SAT improves
        the hill-climbed hint ``window // 2`` tables at a time, around the busiest device.
    seed : int

    Returns
    -------
    SparsePlan
        With the greedy baseline's step on the same cost model
        (:attr:`~.plan.SparsePlan.baseline_step_time_s`).

    Raises
    ------
    InfeasiblePlan
        When no placement fits every memory (the message says what to add).
    """
    if objective not in ("time", "cost"):
        raise ConfigError(f"objective must be 'time' or 'cost', got {objective!r}")
    if objective == "cost" and prices is None:
        raise ConfigError("objective='cost' needs prices=Prices(device_hour=..., server_hour=..., "
                          "source=...)")
    if max_deterministic_time_s is not None and not max_deterministic_time_s > 0:
        raise ConfigError(f"max_deterministic_time_s must be > 0 (or None: scaled with the "
                          f"tables), got {max_deterministic_time_s!r}")
    start = time.perf_counter()
    m = _model(graph, cluster, global_batch, optimizer=optimizer, precision=precision,
               options=options, constants=constants, calibration=calibration)
    kw = dict(storages=_storages(storages), cache_fraction=cache_fraction,
              min_column_width=min_column_width)
    budget = _budget(len(graph.tables), max_deterministic_time_s)
    counts = range(len(m.servers) + 1) if objective == "cost" else [len(m.servers)]
    best: tuple[float, SparsePlan] | None = None
    for n in counts:
        prob = Problem.build(m, servers=n, **kw)
        try:
            # its step from the priced arrays: the figures its estimate sums
            # (tests/test_sparse_placement.py checks every entry against the cost model)
            baseline_s: float | None = prob.objective(_greedy(prob), 0)
        except InfeasiblePlan:
            baseline_s = None     # the greedy baseline found no placement that fits
        hint, hint_zero = _hint(prob)
        try:
            out, status = _search(prob, hint, hint_zero, window=window, seed=seed,
                                  max_deterministic_time_s=budget)
        except InfeasiblePlan:
            if n != counts[-1]:
                continue          # too few servers rented: the next count may fit
            raise
        # CP-SAT's proven bound where one model held every table, and the relaxation's
        bound = prob.lower_bound()
        if len(prob) <= window and out.status != "unknown":
            bound = max(bound, out.bound_s)
        plan = _plan(prob, out.chosen, out.zero, status, baseline_s, bound=bound)
        if out.zero != hint_zero or not np.array_equal(out.chosen, hint):
            hinted = _plan(prob, hint, hint_zero, f"hill climbing ({status} found nothing better)",
                           baseline_s, bound=bound)
            if hinted.estimate.fits and (hinted.estimate.step_time_s < plan.estimate.step_time_s
                                         or not plan.estimate.fits):
                plan = hinted    # the integer model rounds: never return worse than its hint
        if not plan.estimate.fits:
            if n != counts[-1]:
                continue
            raise InfeasiblePlan(f"no placement of the {len(prob)} tables that fits was "
                                 f"found in {budget} deterministic seconds: add devices, host "
                                 "memory or servers, or give the search more time",
                                 binding="memory")
        score = plan.estimate.step_time_s * (prices.per_hour(m.cluster.num_devices, n)
                                             if objective == "cost" else 1.0)
        if best is None or score < best[0]:
            best = (score, plan)
    assert best is not None
    plan = best[1]
    object.__setattr__(plan, "solve_time_s", time.perf_counter() - start)
    return plan


def estimate_sparse(graph: SparseGraph, cluster: Cluster | str, placements: Iterable[TablePlacement],
                    *, global_batch: int, zero: int = 0,
                    optimizer: SparseOptimizer | str = SparseOptimizer.ROWWISE_ADAGRAD,
                    precision: Precision | str = Precision.BF16, options: CostOptions | None = None,
                    constants: SparseConstants | None = None,
                    calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> SparsePlan:
    """The :class:`~.plan.SparsePlan` of placements chosen by hand, with its estimate."""
    m = _model(graph, cluster, global_batch, optimizer=optimizer, precision=precision,
               options=options, constants=constants, calibration=calibration)
    dense, _ = m.dense(zero)
    placements = tuple(placements)
    est = m.estimate(placements, dense)
    order = {t.name: i for i, t in enumerate(graph.tables)}
    return SparsePlan(model=graph.model, title=graph.title, cluster=m.cluster.name,
                      num_devices=m.cluster.num_devices, num_servers=len(m.cluster.servers),
                      global_batch=global_batch, dense=dense,
                      tables=tuple(sorted(placements, key=lambda p: order[p.table])),
                      optimizer=m.optimizer, estimate=est, search="given")


def _storages(storages: Iterable[Storage | str] | None) -> frozenset[Storage] | None:
    if storages is None:
        return None
    out = []
    for s in storages:
        try:
            out.append(Storage(s))
        except ValueError:
            raise ConfigError(f"unknown storage {s!r}; expected some of "
                              f"{[x.value for x in Storage]}") from None
    return frozenset(out)
