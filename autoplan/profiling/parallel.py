"""The parallel runtime's host work beyond its collectives (``OpOverhead``): tensor-parallel
linears, a pipeline's stage actions and messages, FSDP2 and replicate around their
collectives, and context parallelism's collectives in a step."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from ..runtime import cp as cpm
from ..runtime.fsdp import apply_fsdp, apply_replicate, set_micro_batch_sync
from .overhead import OVERHEAD_WIDTH
from .timing import wall_per_call


def _sharded_extra(timed: Callable[[Callable[[], Any]], float], plain: Any, sharded: Any,
                   x: Any) -> tuple[float, float]:
    """Seconds ``sharded`` (a tensor-parallel module) takes beyond ``plain`` on ``x``,
    ``(forward, backward)``: each timed forward, then forward + backward, plain first
    (``timed(fn)`` is seconds per call).

    The sharded forward is timed to its row linear's all-reduce's end: that all-reduce is a
    functional collective whose output comes back in flight (an AsyncCollectiveTensor),
    waited for at its first use, so a forward timed without that use ends before its
    collective does (4 CPU ranks sharing 2 cores: 0.6-1.0 ms a call against 1.5-2.5 ms
    waited, 2026-11-25), and the wait landed in the backward figure, the forward reading
    0 in every profile."""
    import torch.distributed._functional_collectives as funcol

    def sharded_forward():
        out = sharded(x)
        return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out

    plain_fwd = timed(lambda: plain(x))
    plain_both = timed(lambda: plain(x).sum().backward())
    tp_fwd = timed(sharded_forward)
    tp_both = timed(lambda: sharded(x).sum().backward())
    return tp_fwd - plain_fwd, (tp_both - tp_fwd) - (plain_both - plain_fwd)


def measure_tp_overhead(torch, dist, timed: Callable[[Callable[[], Any]], float], own: Any,
                        pair: Any = None, rounds: int = 1) -> tuple[float, float]:
    """Extra seconds per tensor-parallel linear, ``(forward, backward)``, beyond its
    arithmetic and its collective, which the link model prices (``timed(fn)`` is seconds
    per call): a tiny MLP as ``ColwiseParallel`` + ``RowwiseParallel`` (what
    :mod:`autoplan.runtime.tp` builds) against the same MLP unsharded.

    * On each rank's own one-rank group ``own`` (``pair`` None; the caller measures so
      only where the ranks do not pair up, an odd number): no other rank to wait for
      inside a call.  There DTensor runs its sharding propagation and wrapping but skips
      the collectives, so the functional collective's Python side is added once each way
      (``funcol.all_reduce`` + wait against ``dist.all_reduce`` on the same group: the
      row linear's output all-reduce in the forward, the column linear's input-gradient
      all-reduce in the backward).  It misses what DTensor does only around a real
      collective (its redistribution, the wrapping of the in-flight result): on 2 ranks
      with cores of their own (a fresh VM, 2026-11-27) it read 175 + 335 us per linear
      where a pair in CPU time read 330-430 + 455-515 us and 0.5 ms per MiB of payload,
      and ``benchmarks/local_truth.py``'s 2-rank TP step was priced 14-19% fast with it
      (three runs), 3-10% with the pair's figures (an older VM had read it within 5%).
    * On a two-rank group ``pair`` (the caller passes one wherever the ranks pair up: the
      ranks in pairs, every pair at once, as a run's tensor-parallel groups are): the
      sharded MLP runs its real collectives, and each direction is measured less the
      plain MLP and less one ``dist.all_reduce`` of the same bytes on the same group.
      There the caller's ``timed`` reads the main thread's CPU time, times the ranks over
      the cores where they share them (:func:`core_seconds`): the host work a rank's
      cores must find time for while every rank is busy, the collective's wait left to
      the link model.  Its wall
      time, the earlier figure, carried each call's hand-overs to gloo's thread and its
      wait for the peer: on 4 CPU ranks sharing 2 cores it read 1.4-3.6 ms per linear
      (forward + backward; median 2.1) in nine profiles of two days, and the confirm
      pass's tensor-parallel layouts moved with it (within 5% of measured at 3.6, 15-25%
      fast at 1.8).  The CPU figure read 2.0-4.1 ms (median 2.9) in 23 runs of one day:
      no steadier, but what a step pays; re-pricing the three confirm passes before it at
      3.0-3.5 ms put 77, 64 and 77 of 81 within 15% (they read 76, 61 and 68), and the
      tensor-parallel layouts within 15% went from 14, 8 and 5 of 16-17 a pass to 13, 16,
      12, 15 and 6 in the five passes priced with it (the last one's runs slower than its
      profile throughout, 2026-11-26).

    Measured ``rounds`` times; the median of each direction is returned."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    h = OVERHEAD_WIDTH
    group = pair if pair is not None else own
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Linear(h, h))
    sharded = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Linear(h, h))
    sharded.load_state_dict(plain.state_dict())
    parallelize_module(sharded, DeviceMesh.from_group(group, "cpu"),
                       {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = torch.randn(1, 4, h).requires_grad_(True)
    flat = torch.randn(4 * h)    # the bytes of the MLP's output and of its input gradient

    def once() -> tuple[float, float]:
        extra_fwd, extra_bwd = _sharded_extra(timed, plain, sharded, x)
        bare = timed(lambda: dist.all_reduce(flat, group=group))
        if pair is not None:
            return max(0.0, extra_fwd - bare) / 2, max(0.0, extra_bwd - bare) / 2
        wrapped = timed(lambda: funcol.all_reduce(flat, "sum", group).wait())
        wrapper = max(0.0, wrapped - bare)
        return max(0.0, extra_fwd) / 2 + wrapper / 2, max(0.0, extra_bwd) / 2 + wrapper / 2

    readings = [once() for _ in range(rounds)]
    return (statistics.median(f for f, _ in readings),
            statistics.median(b for _, b in readings))


def measure_tp_shared_overhead(torch, dist, timed: Callable[[Callable[[], Any]], float],
                               pair: Any, rounds: int = 1) -> tuple[float, float]:
    """Extra seconds of a column linear that shares its region's input with the one before
    it, ``(forward, backward)``: q, k and v of an attention, gate and up of a gated MLP.
    :mod:`autoplan.runtime.tp` takes a region's input once, as one DTensor, where its
    module opens (``PrepareModuleInput``); its column linears run their DTensor matmuls on
    it and their input gradients add up as partial sums, reduced by one all-reduce where
    the input leaves the region.  So a second column linear adds its DTensor matmul's
    sharding propagation and wrapping, not the region's wrapping and collective that
    :func:`measure_tp_overhead`'s per-linear figure carries.

    Measured on the two-rank group ``pair`` (every pair at once, ``timed`` as there): a
    region of two column linears sharing its input (their outputs added) and a row linear,
    against a region of one, each less the same modules unsharded; the difference, the
    median of ``rounds``, at least 0.  Both run the same collectives (one all-reduce each
    way), which cancel."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, parallelize_module)
    nn = torch.nn
    h = OVERHEAD_WIDTH

    class Region(nn.Module):
        def __init__(self, columns: int) -> None:
            super().__init__()
            self.cols = nn.ModuleList(nn.Linear(h, h) for _ in range(columns))

        def forward(self, x):
            y = self.cols[0](x)
            for col in self.cols[1:]:
                y = y + col(x)
            return y

    def mlp(columns: int, sharded: bool):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            m = nn.Sequential(Region(columns), nn.Linear(h, h))
        if sharded:
            plan = {"0": PrepareModuleInput(input_layouts=(Replicate(),),
                                            desired_input_layouts=(Replicate(),)),
                    "1": RowwiseParallel()}
            plan.update({f"0.cols.{i}": ColwiseParallel() for i in range(columns)})
            parallelize_module(m, DeviceMesh.from_group(pair, "cpu"), plan)
        return m

    x = torch.randn(1, 4, h).requires_grad_(True)

    def once() -> tuple[float, float]:
        one, two = (_sharded_extra(timed, mlp(n, False), mlp(n, True), x) for n in (1, 2))
        return two[0] - one[0], two[1] - one[1]

    readings = [once() for _ in range(rounds)]
    return (max(0.0, statistics.median(f for f, _ in readings)),
            max(0.0, statistics.median(b for _, b in readings)))


#: Tokens and width of the tensor-parallel MLP the per-byte figure is measured at, besides
#: the tiny one: 512 KiB of fp32 payload each way, the activation of a micro-batch of a few
#: sequences of a small model
TP_BYTES_SHAPE = (512, 256)


def _tp_mlp_extra(torch, dist, timed: Callable[[Callable[[], Any]], float], pair: Any,
                  tokens: int, h: int) -> tuple[float, float]:
    """Extra seconds of one ``ColwiseParallel`` + ``RowwiseParallel`` MLP (``h`` wide, on
    ``tokens`` tokens) on the two-rank group ``pair``, ``(forward, backward)``, beyond the
    arithmetic a rank does (the same MLP with its inner width halved, unsharded) and one
    bare ``dist.all_reduce`` of its ``tokens x h`` output each way."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    nn = torch.nn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        local = nn.Sequential(nn.Linear(h, h // 2), nn.Linear(h // 2, h))
        sharded = nn.Sequential(nn.Linear(h, h), nn.Linear(h, h))
        x = torch.randn(1, tokens, h).requires_grad_(True)
        flat = torch.randn(tokens * h)
    parallelize_module(sharded, DeviceMesh.from_group(pair, "cpu"),
                       {"0": ColwiseParallel(), "1": RowwiseParallel()})

    extra_fwd, extra_bwd = _sharded_extra(timed, local, sharded, x)
    bare = timed(lambda: dist.all_reduce(flat, group=pair))
    return extra_fwd - bare, extra_bwd - bare


def measure_tp_byte_overhead(torch, dist, timed: Callable[[Callable[[], Any]], float],
                             pair: Any, rounds: int = 1) -> float:
    """Extra seconds per byte of a tensor-parallel collective's payload
    (``OpOverhead.tp_collective_byte_s``): :func:`_tp_mlp_extra` at
    :data:`TP_BYTES_SHAPE` less at :data:`OVERHEAD_WIDTH` on 4 tokens, over the
    difference of their payloads (one all-reduce of the MLP's output each way), forward
    and backward averaged; the median of ``rounds``, at least 0.

    What grows with the activation besides the transfer: the functional all-reduce's
    copy of its input, DTensor's wrapping of the result, the local shards' copies.  On 4
    CPU ranks sharing 2 cores, in main-thread CPU time times the share, the extra per
    linear (forward + backward) read 2.3, 2.7, 3.0, 3.3 and 3.7 ms at 4, 128, 256, 512
    and 1024 tokens of width 256 (0 to 1 MiB each way; the plain MLP's figure, 2.3 ms,
    is what the per-linear figure states), about 1.4 ms per MiB each way; this function
    read 1.6-2.3 ms per MiB in eight quick profiles, and the two confirm passes priced with
    it put the tensor-parallel layouts of one micro-batch of 8 sequences at -9% and -12% on
    average (-4% to -22% in the five passes before; 2026-11-26)."""
    small_tokens, small_h = 4, OVERHEAD_WIDTH
    tokens, h = TP_BYTES_SHAPE
    span = 4 * (tokens * h - small_tokens * small_h)   # fp32 bytes

    def once() -> float:
        big = _tp_mlp_extra(torch, dist, timed, pair, tokens, h)
        small = _tp_mlp_extra(torch, dist, timed, pair, small_tokens, small_h)
        return ((big[0] - small[0]) + (big[1] - small[1])) / 2 / span

    return max(0.0, statistics.median(once() for _ in range(rounds)))


#: Rounds of the tensor-parallel figure on pairs of ranks, of which the median is kept: one
#: round is a difference of differences of five timings, each with its collectives' waits
#: for a core.  On 4 CPU ranks sharing 2 cores single rounds read 0.45-2.7 ms per linear
#: (the mean of nine to twelve in one launch 1.2-2.3 ms over seven launches), and six quick
#: profiles keeping the median of five read 1.2-1.8 ms, where ten with one round had read
#: 0.9-2.1 ms (2026-11-24)
TP_PAIR_ROUNDS = 5
#: Calls per CPU-time reading of the tensor-parallel figure on pairs (:func:`core_seconds`)
_TP_CPU_CALLS = 20


#: The pipeline's host work (:func:`measure_pipeline_overhead`): micro-batches per step
#: of the two-stage 1F1B pipeline, steps per timed round, rounds (the median is kept).
PIPELINE_MICRO_BATCHES = 8
_PIPELINE_STEPS = 20
PIPELINE_ROUNDS = 3


def measure_pipeline_overhead(torch, dist, pair: Any, agreed_mean: Callable[[float], float],
                              share: float, rounds: int = PIPELINE_ROUNDS) -> tuple[float, float]:
    """Core seconds a pipeline stage action costs beyond its module's own work,
    ``(action, message)``, each times ``share`` (the ranks over the cores they share, 1
    where each rank has its own): a two-stage ``Schedule1F1B`` of
    ``PIPELINE_MICRO_BATCHES`` micro-batches over ``pair`` (every pair at once), each
    stage one tiny linear (width ``OVERHEAD_WIDTH``), against the same module's forward
    and backward run as often without a pipeline, per action (a micro-batch's forward or
    backward on one stage).

    * ``action``: the CPU time of the rank's main thread (the schedule's Python, the
      stage's input and output handling, posting the transfers and waiting on them).
    * ``message``: the CPU time of the rank's other threads (gloo's transport loops move
      every transfer over loopback TCP), per action, each of which receives or sends one
      message on a two-stage pipeline: per message end.

    Both are core time that competes with the ranks' compute where ranks share cores,
    which the link model's per-transfer latency (a wait) does not price: on 4 CPU ranks of
    2 cores they read 0.19-0.24 and 0.36-0.84 core-ms, where ``benchmarks/step_cpu.py``
    saw a one-sequence 1F1B step of the confirm GPT spend 0.25 and 0.75 core-ms more per
    action in its main threads and transport threads than the same layout at one
    micro-batch of 4 (2026-11-26).  Interleaved 1F1B's main thread read 0.35-0.41 per
    action on the same ranks in one run (1F1B's 0.19-0.24), alike in another (0.26-0.30
    against 0.16-0.33; ZB-V's 0.27): the 1F1B figure stands for every schedule.  Each is
    the ranks' mean, the median of ``rounds`` rounds."""
    import resource

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    h, m = OVERHEAD_WIDTH, PIPELINE_MICRO_BATCHES
    me = dist.get_rank(pair)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh())
    stage = PipelineStage(module, me, 2, torch.device("cpu"), group=pair)
    schedule = Schedule1F1B(stage, m, loss_fn=lambda y, t: ((y - t) ** 2).mean(),
                            scale_grads=False)
    x, target = torch.randn(m, 4, h), torch.randn(m, 4, h)
    one = torch.randn(1, 4, h).requires_grad_(True)

    def piped() -> None:
        if me == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)

    def plain() -> None:
        for _ in range(m):
            module(one).sum().backward()

    def cpu(fn: Callable[[], None]) -> tuple[float, float]:
        """(main thread, whole process) CPU seconds per call of ``fn``."""
        dist.barrier()
        usage, main = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        for _ in range(_PIPELINE_STEPS):
            fn()
        main = time.thread_time() - main
        after = resource.getrusage(resource.RUSAGE_SELF)
        total = (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime)
        return main / _PIPELINE_STEPS, total / _PIPELINE_STEPS

    for _ in range(3):
        piped()
        plain()
    actions, readings = 2 * m, []
    for _ in range(max(1, rounds)):
        (p_main, p_all), (q_main, q_all) = cpu(piped), cpu(plain)
        action = max(0.0, p_main - q_main) / actions
        message = max(0.0, (p_all - p_main) - (q_all - q_main)) / actions
        readings.append((agreed_mean(action), agreed_mean(message)))
    return (share * statistics.median(a for a, _ in readings),
            share * statistics.median(b for _, b in readings))


#: FSDP2's figures (``OpOverhead.fsdp_*``): units of linears at these widths (4 linears a
#: unit, 1 and 4 MiB of fp32 parameters, the blocks of small models), two units a model,
#: on this many tokens; timed calls a reading, rounds of which the median is kept (three
#: 2-rank quick profiles with 3 rounds read a 3 MiB unit's reduce-scatter at 1.8-2.9 ms)
FSDP_WIDTHS = (256, 512)
FSDP_LINEARS = 4
_FSDP_TOKENS = 64
_FSDP_CALLS = 12
FSDP_ROUNDS = 5


def measure_fsdp_overhead(torch, dist, pair: Any, agreed_mean: Callable[[float], float],
                          rounds: int = FSDP_ROUNDS
                          ) -> tuple[float, float, float, float, float, float]:
    """FSDP2's seconds beyond its collectives, ``(gather per call, gather per byte, reduce
    per call, reduce per byte, replicate per call, replicate per byte)``
    (``OpOverhead.fsdp_*``, ``OpOverhead.replicate_*``): two units of
    :data:`FSDP_LINEARS` linears each at each of :data:`FSDP_WIDTHS`, on ``pair`` (every
    pair at once, every rank busy), wall time:

    * reduce: the units under ``fully_shard`` as ZeRO-2 runs a micro-batch that is not the
      step's last (parameters kept gathered, gradients reduce-scattered: forward +
      backward) less the same units without it, less a raw ``reduce_scatter_tensor`` of a
      unit's bytes, per unit;
    * gather: ZeRO-3's (gathered in the forward and again in the backward) less ZeRO-2's,
      less two raw ``all_gather_into_tensor``, per unit and gather;
    * replicate: the units under ``replicate`` (one all-reduce of both units' gradients a
      call, as the step's last micro-batch runs it) less the units without it, less a raw
      ``all_reduce`` of the same bytes;

    each per call and per byte from the two widths (a line through the bytes a call moves,
    at least 0), the ranks' mean, the median of ``rounds``.  The collectives alone are the
    link model's: this is what FSDP2 adds around them on the rank's cores (its buffers'
    copies and allocation, the unsharded parameters' set-up, the gradients' division and
    accumulation).  On 4 CPU ranks of 2 cores a gather read 1.7-2.7 ms per call at 1-2 MB
    and 6.3 at 4 MB, a reduce-scatter 4.2, 7.1 and 8.5 ms, against 0.9-3.8 ms for the raw
    gathers and 2.4-7.6 for the reduce-scatters (2026-11-27); on 2 ranks with cores of
    their own 1.2-3.2 ms either, against 0.7-6.7 ms raw.  ``replicate`` read 11.5 ms beyond
    the raw all-reduce's 4.6 at 2.1 MB and 34.6 beyond 9.0 at 8.4 MB (4 ranks of 2 cores).
    """
    from torch.distributed.device_mesh import DeviceMesh


    mesh = DeviceMesh.from_group(pair, "cpu")
    world = dist.get_world_size(pair)

    def wall(fn: Callable[[], Any]) -> float:
        return wall_per_call(fn, _FSDP_CALLS, dist.barrier, agreed_mean)

    def extras(width: int) -> tuple[float, float, float, float]:
        """(unit bytes, gather extra per call, reduce extra per call, replicate extra per
        call of both units) at ``width``."""
        def units() -> tuple[Any, list[Any]]:
            torch.manual_seed(0)
            blocks = [torch.nn.Sequential(*(torch.nn.Linear(width, width)
                                            for _ in range(FSDP_LINEARS))) for _ in range(2)]
            return torch.nn.Sequential(*blocks), blocks

        x = torch.randn(_FSDP_TOKENS, width)

        def step(model: Any) -> Callable[[], None]:
            return lambda: model(x).sum().backward()

        times = {}
        plain, _ = units()
        times["plain"] = wall(step(plain))
        for zero in (2, 3):
            model, blocks = units()
            apply_fsdp(model, [(b, zero) for b in blocks], mesh, root_zero=zero)
            set_micro_batch_sync(model, False)
            times[zero] = wall(step(model))
        model, _ = units()
        apply_replicate(model, mesh)
        set_micro_batch_sync(model, True)
        times["replicate"] = wall(step(model))
        n = FSDP_LINEARS * (width * width + width)      # a unit's parameters
        full, shard, both = torch.empty(n), torch.empty(n // world), torch.empty(2 * n)
        gather = wall(lambda: dist.all_gather_into_tensor(full, shard, group=pair))
        scatter = wall(lambda: dist.reduce_scatter_tensor(shard, full, group=pair))
        reduce = wall(lambda: dist.all_reduce(both, group=pair))
        reduce_extra = (times[2] - times["plain"]) / 2 - scatter
        gather_extra = (times[3] - times[2]) / 4 - gather
        replicate_extra = times["replicate"] - times["plain"] - reduce
        return 4.0 * n, gather_extra, reduce_extra, replicate_extra

    readings = []
    for _ in range(max(1, rounds)):
        (b0, g0, r0, a0), (b1, g1, r1, a1) = (extras(w) for w in FSDP_WIDTHS)
        readings.append(_line(b0, g0, b1, g1) + _line(b0, r0, b1, r1)
                        + _line(2 * b0, a0, 2 * b1, a1))
    return tuple(statistics.median(r[i] for r in readings)  # type: ignore[return-value]
                 for i in range(6))


#: Context parallelism's collectives in a step (:func:`measure_cp_overhead`): tokens per
#: sequence, heads and head width of the attention (the confirm models' GPT), the
#: sequences a call takes (512 KiB and 1 MiB of fp32 keys and values gathered), linears of
#: the attention's width run before it (a block's other work), calls per timed window and
#: rounds (the median is kept)
_CP_SHAPE = (128, 4, 64)
CP_BATCHES = (2, 4)
_CP_LINEARS = 6
CP_CALLS = 10
CP_ROUNDS = 5


def cp_bytes(batch: int) -> int:
    """Bytes of fp32 keys and values a pair gathers for ``batch`` sequences of
    :data:`_CP_SHAPE` (whole sequences, both ranks' tokens)."""
    seq, heads, head = _CP_SHAPE
    return 2 * 4 * batch * seq * heads * head


def measure_cp_overhead(torch, dist, pair: Any, agreed_mean: Callable[[float], float],
                        rounds: int = CP_ROUNDS) -> tuple[float, float, float, float]:
    """Context parallelism's collectives in a step beyond their back-to-back time,
    ``(all-gather per call, per byte, reduce-scatter per call, per byte)``
    (``OpOverhead.cp_*``), per byte of the keys and values gathered (whole sequences).

    On ``pair`` (every pair at once, every rank busy), each rank's clock over
    :data:`CP_CALLS` calls (the same count on both ranks of a pair: each call runs their
    collectives), the ranks' mean: :data:`_CP_LINEARS` linears, then an attention core
    over the keys and values that :func:`autoplan.runtime.cp.gather_sequence` gathers
    (local queries, causal mask of the global positions), as :mod:`autoplan.runtime.cp`
    runs a block; the forward, and forward + backward.  Less the same with a local
    stand-in for the collective (the same buffers and copies), less the raw
    ``all_gather_single`` (forward) and ``reduce_scatter_single`` (the backward's
    extra) of the same bytes timed back to back; per call and per byte from the two
    payloads of :data:`CP_BATCHES` (a line through the medians of ``rounds`` at each,
    at least 0).

    Where ranks share cores a collective between compute costs more than back to back:
    each transfer waits for its peer to be scheduled while the other ranks compute.
    On 4 CPU ranks of 2 cores the pairs' all-gather and reduce-scatter together read
    8.3-10.0 ms in a step at 512 KiB and 11.3-11.4 ms at 1 MiB, against 4.1 and 5.1 ms
    back to back (2026-11-28), where the stored confirm passes had priced the layouts
    with context parallelism in pairs 4-12% fast on average."""
    seq, heads, head = _CP_SHAPE
    width = heads * head
    ctx = cpm.CPContext(pair, 2, dist.get_rank(pair), seq)
    local = ctx.local_len

    class Stand(torch.autograd.Function):
        """The all-gather's stand-in: this rank's tensor in every rank's place."""
        @staticmethod
        def forward(_, x):
            out = x.new_empty((ctx.cp * x.shape[0], *x.shape[1:]))
            for i in range(ctx.cp):
                out[i * x.shape[0]:(i + 1) * x.shape[0]].copy_(x)
            return out.view(ctx.cp, *x.shape)

        @staticmethod
        def backward(_, grad):
            out = grad.new_empty(grad.shape[1:])
            out.copy_(grad[0])
            return out

    def wall(fn: Callable[[], Any], calls: int = CP_CALLS) -> float:
        return wall_per_call(fn, calls, dist.barrier, agreed_mean)

    def extras(batch: int) -> tuple[float, float, float]:
        """(bytes gathered, all-gather extra, reduce-scatter extra) at ``batch``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            linears = torch.nn.Sequential(*(torch.nn.Linear(width, width)
                                            for _ in range(_CP_LINEARS)))
            x = torch.randn(batch, local, width, requires_grad=True)
            q, k, v = (torch.randn(batch, heads, local, head, requires_grad=True)
                       for _ in range(3))
        blocked = ~ctx.allowed

        def step(gathered: bool, backward: bool) -> Callable[[], None]:
            def run() -> None:
                kv = torch.stack([k, v])
                if gathered:
                    kk, vv = cpm.gather_sequence(kv, ctx, 3).unbind(0)
                else:
                    kk, vv = cpm._PositionOrder.apply(Stand.apply(kv), 3, ctx.runs).unbind(0)
                scores = (q @ kk.transpose(-2, -1)).masked_fill(blocked, float("-inf"))
                loss = linears(x).sum() + (torch.softmax(scores, dim=-1) @ vv).sum()
                if backward:
                    loss.backward()
            return run

        t = {(g, b): wall(step(g, b)) for g in (True, False) for b in (False, True)}
        shard = torch.randn(2 * batch * heads * local * head)
        whole = torch.empty(ctx.cp * shard.numel())
        raw_gather = wall(lambda: dist.all_gather_single(whole, shard, group=pair),
                          4 * CP_CALLS)
        raw_scatter = wall(lambda: dist.reduce_scatter_single(shard, whole, group=pair),
                           4 * CP_CALLS)
        gather = t[True, False] - t[False, False]
        scatter = t[True, True] - t[False, True] - gather
        return float(cp_bytes(batch)), gather - raw_gather, scatter - raw_scatter

    readings = [[extras(n) for n in CP_BATCHES] for _ in range(max(1, rounds))]
    (b0, g0, s0), (b1, g1, s1) = (
        tuple(statistics.median(r[i][j] for r in readings) for j in range(3))
        for i in range(len(CP_BATCHES)))
    return _line(b0, g0, b1, g1) + _line(b0, s0, b1, s1)


def _line(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    """``(intercept, slope)`` of the line through two points, each at least 0 (a negative
    intercept: the line through the origin and the larger point)."""
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    intercept = y0 - slope * x0
    if intercept < 0:
        return 0.0, max(0.0, y1 / x1)
    return intercept, slope


def core_seconds(dist, agreed_mean: Callable[[float], float], share: float,
                 fn: Callable[[], Any], calls: int = _TP_CPU_CALLS) -> float:
    """The CPU time of this rank's main thread per call of ``fn`` (after a warm-up call),
    every rank at once, the ranks' mean, times ``share`` (the ranks over the cores they
    share: the seconds a rank's own work takes when every rank is busy)."""
    fn()
    dist.barrier()
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return share * agreed_mean((time.thread_time() - start) / calls)
