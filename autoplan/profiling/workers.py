"""Spawning the ranks and the worker body: each rank runs every measurement in turn and rank 0
writes the gathered raw measurements (:func:`run_ranks`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

from ..hardware.profile_records import RATE_KINDS
from ..records import atomic_write_text
from ..runtime.cpu_heap import keep_cpu_heap
from .attention import ATTENTION_FLOPS_PER_QK, attention_call, qk_flops
from .collectives import ARRIVAL_WORK_CALLS, WORK_SHAPE, measure_arrival, measure_collectives
from .elementwise import ELEMENTWISE_SHAPE_CUDA, measure_elementwise
from .fp8 import fp8_capable, measure_fp8_gemms
from .grouped_gemm import measure_grouped_gemms
from .host import cpu_name, physical_memory_bytes
from .matmul import COLD_BYTES, measure_matmuls
from .overhead import measure_op_overhead, measure_optimizer_overhead
from .parallel import (TP_PAIR_ROUNDS, core_seconds, measure_cp_overhead, measure_fsdp_overhead,
                       measure_pipeline_overhead, measure_tp_byte_overhead, measure_tp_overhead,
                       measure_tp_shared_overhead)
from .plan import MeasurementPlan
from .reference import (REFERENCE_SHAPE, REFERENCE_SMALL_SHAPE, REFERENCE_TARGET_S,
                        measure_reference_layers)
from .timing import (CALIBRATION_CALLS, OVERRUN, ProfilingFailed, WARMUP_CALLS, calls_per_batch,
                     fmt_bytes, free_running, progress, ranks_share_cores, time_local,
                     tp_measured_in_pairs, usable_cores)


#: Seconds between a rank's looks at whether the process that started it is still there.
_PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int) -> None:
    """End this rank once the process that started it (pid ``parent``) is gone: killed
    without the chance to stop its ranks (SIGKILL, a scheduler's hard limit), it would
    leave them measuring, all cores busy, for minutes.  A daemon thread, waking every
    :data:`_PARENT_POLL_S` seconds."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="autoplan-parent-watch", daemon=True).start()


def _worker(rank: int, world: int, init_method: str, backend: str, cuda: bool, threads: int,
            plan: MeasurementPlan, result_dir: str, start: float, parent: int) -> None:
    """One rank: measure compute, memory and collectives; rank 0 writes ``result.json``.
    It ends itself if ``parent`` (the launching process's pid) goes away."""
    _exit_with_parent(parent)
    try:
        _worker_body(rank, world, init_method, backend, cuda, threads, plan, result_dir, start)
    except BaseException:  # report to the parent, which tears the others down
        Path(result_dir, f"error-{rank}.txt").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: after gloo it aborts (SIGABRT, "terminate called
    # without an active exception") in 5-20% of runs once the work is done
    os._exit(0)


def _worker_body(rank: int, world: int, init_method: str, backend: str, cuda: bool, threads: int,
                 plan: MeasurementPlan, result_dir: str, start: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        sync: Callable[[], None] = torch.cuda.synchronize
    else:
        keep_cpu_heap()   # the heap as autoplan.parallelize runs its CPU ranks
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731 - gloo and CPU ops are synchronous
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            **({"device_id": device} if cuda else {}))
    say = (lambda m: progress(m, start)) if rank == 0 else (lambda m: None)
    say(f"{world} rank{'s' if world > 1 else ''} up ({backend}); measuring matmul throughput")

    # timed together: every repeat starts on all ranks at once (a barrier) and lasts from the
    # first rank's start to the last rank's end, on the host's monotonic clock (the ranks are
    # processes of this one host).  Not each rank's own elapsed time: ranks that share cores
    # leave the barrier apart, and a rank that starts only once another has finished its
    # batch would time itself at a whole core's speed.  The ranks agree on iteration counts
    # through a max-reduction.
    def agreed(value: float, op=dist.ReduceOp.MAX) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        return float(t.item())

    def agreed_max(value: float) -> float:
        return agreed(value)

    def agreed_mean(value: float) -> float:
        return agreed(value, dist.ReduceOp.SUM) / world

    def agreed_span(start: float, end: float) -> float:
        t = torch.tensor([-start, end], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0].item() + t[1].item())

    shares_cores = ranks_share_cores(cuda, world, threads)

    def timed(fn: Callable[[], Any], target_s: float = plan.comm_target_s,
              mean: bool = False, local: bool = False) -> float:
        # the best batch for compute on a device of its own (other work only ever adds
        # time); the mean of every call for a collective (``mean``): its waits are part of
        # what a step pays; and the mean of everything where ranks share cores -- there
        # a rank's own work (``local``: no collective inside ``fn``) in free-running
        # windows, the fastest (:func:`free_running`)
        if local and shares_cores:
            return free_running(fn, sync, target_s, agreed_mean, dist.barrier,
                                windows=plan.repeats)
        mean = mean or shares_cores
        for _ in range(WARMUP_CALLS):
            fn()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(CALIBRATION_CALLS):
            fn()
        sync()
        first = agreed_max((time.perf_counter() - t0) / CALIBRATION_CALLS)
        iters = calls_per_batch(target_s, plan.repeats, first, shares_cores)
        best, spent, calls = math.inf, 0.0, 0
        for _ in range(plan.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            elapsed = agreed_span(t0, time.perf_counter())  # the same on every rank
            best, spent, calls = min(best, elapsed / iters), spent + elapsed, calls + iters
            if spent > OVERRUN * target_s:  # every rank decides alike
                break
        return spent / calls if mean else best


    # compute: every rank at once, each on its own device / thread share
    # (on CPU timed together: ranks that share cores are measured all busy, as in training;
    # timed alone, a rank that finishes first idles and lends its core to the others)
    dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
              "fp16": torch.float16}
    cold_bytes = COLD_BYTES
    if cuda:
        cold_bytes = max(cold_bytes, 2 * int(getattr(torch.cuda.get_device_properties(device),
                                                     "L2_cache_size", 0)))
    matmul = measure_matmuls(torch, dist, device, dtypes, plan, cuda, cold_bytes, sync, timed,
                             say)
    # grouped GEMMs, as MoE experts run them (autoplan.hardware.grouped_gemm)
    grouped = measure_grouped_gemms(torch, dist, device, dtypes, plan, cuda, sync, timed, say)
    # FP8 GEMMs (tensorwise and rowwise torch._scaled_mm) where the GPU has them (fp8.py);
    # their sizes are the 16-bit matmuls'
    fp8_matmul = (measure_fp8_gemms(
        torch, device, plan.matmul_sizes.get("bf16", ()), cold_bytes,
        lambda call: time_local(call, sync, plan.matmul_target_s, plan.repeats), say)
        if cuda and fp8_capable(torch, device) else {})

    elems = plan.copy_bytes // 4
    src = torch.ones(elems, device=device)
    dst = torch.empty_like(src)
    dist.barrier()
    copy_s = (time_local(lambda: dst.copy_(src), sync, plan.copy_target_s, plan.repeats) if cuda
              else timed(lambda: dst.copy_(src), plan.copy_target_s, local=True))
    say(f"memory copy {fmt_bytes(plan.copy_bytes)}: {2 * plan.copy_bytes / copy_s / 1e9:.2f} GB/s")
    del src, dst
    # memory-bound operators of a kind, at their own speed (CPU: arithmetic per byte; on a
    # GPU the vectorized ones stream at about the copy bandwidth, broadcasts and layout
    # copies take a slower path)
    dist.barrier()
    if cuda:
        elementwise = measure_elementwise(
            torch, lambda fn: time_local(fn, sync, plan.copy_target_s, plan.repeats), device,
            cold_bytes, RATE_KINDS, ELEMENTWISE_SHAPE_CUDA)
    else:
        elementwise = measure_elementwise(
            torch, lambda fn: timed(fn, plan.copy_target_s, local=True), device, cold_bytes)
    if elementwise:
        say("memory-bound operators: " + ", ".join(
            f"{k} {v[2] / v[0] / 1e9:.1f}/{v[2] / v[1] / 1e9:.1f} GB/s"
            for k, v in elementwise.items()) + " (forward/backward, per counted byte)")

    attention: list[tuple[int, int, int, int, float]] = []
    if cuda:   # torch's fused attention (SDPA), as models call it, forward and backward
        for batch, heads, seq, head_dim in plan.attention_shapes:
            call = attention_call(torch, batch, heads, seq, head_dim, device)
            sec = time_local(call, sync, plan.matmul_target_s, plan.repeats)
            del call
            attention.append((batch, heads, seq, head_dim, sec))
            say(f"attention b{batch} h{heads} s{seq} d{head_dim} forward+backward: "
                f"{sec * 1e3:.2f} ms ({ATTENTION_FLOPS_PER_QK * qk_flops(batch, heads, seq, head_dim) / sec / 1e12:.0f} TFLOP/s priced)")

    # operator overhead: on CPU the host is the device; on CUDA the host's dispatch runs
    # ahead of the device, and the cost model takes the larger of the two per layer
    overhead = None
    dist.barrier()
    if cuda:
        overhead = measure_op_overhead(
            torch, lambda fn: time_local(fn, sync, plan.overhead_target_s, plan.repeats),
            device=device)
    else:
        overhead = measure_op_overhead(torch, lambda fn: timed(fn, plan.overhead_target_s,
                                                               local=True))
    say(f"operator overhead{' (the host)' if cuda else ''}: "
        f"{overhead['forward_dispatch_s'] * 1e6:.1f} us per dispatched "
        f"operator forward, {overhead['backward_node_s'] * 1e6:.1f} us per autograd node "
        f"backward, {overhead['selective_dispatch_s'] * 1e6:.1f} us more per dispatched "
        "operator under selective recompute")
    # a CPU's layers whole, against the sum of the parts the profile times (GPUs: the host
    # runs ahead of the device, and the parts are priced as they are)
    reference = None
    if not cuda:
        dist.barrier()
        reference = measure_reference_layers(
            torch, lambda fn: timed(fn, max(plan.overhead_target_s, REFERENCE_TARGET_S),
                                    local=True))
        say(f"reference blocks {'x'.join(map(str, REFERENCE_SHAPE))}: "
            f"{reference[0] * 1e3:.2f} ms forward, {reference[1] * 1e3:.2f} ms backward, "
            f"{reference[2] * 1e3:.2f} ms more under selective checkpoints; at "
            f"{'x'.join(map(str, REFERENCE_SMALL_SHAPE))}: {reference[3] * 1e3:.2f} ms forward, "
            f"{reference[4] * 1e3:.2f} ms backward")

    # On a CPU host a step's collectives follow compute: the ranks arrive apart and a
    # waiting rank's threads have gone idle, which costs more than calls back to back
    # (on this kind of 2-core VM ~1-1.5 ms more per call).  Each collective is timed
    # after a matmul of about a millisecond, less that matmul timed alone -- where every
    # rank has cores of its own: ranks that share cores lend them to each other while one
    # waits, so the loop is not the matmul's time plus the collective's (back to back there).
    after_compute = not cuda and not shares_cores
    # Where ranks share cores, a pipeline's send waits for its receiver to get a core among
    # busy ranks: on 4 ranks over 2 cores a one-way 128 KiB message after compute, every
    # rank busy, took 2.3 ms, against 0.08 ms back to back with the other ranks idle.  There
    # p2p is timed after compute, every pair of ranks (0-1, 2-3, ...) at once, as the stages
    # of data-parallel pipelines exchange; the other collectives back to back, as above
    # (over all the ranks, a 16 B all-reduce after compute took 1% more than back to back,
    # 1 MiB 16% more; the fitted model already prices them above either).
    if not cuda:   # after compute (above), or p2p after compute where the ranks share cores
        work_a = torch.randn(*WORK_SHAPE[:2], device=device)
        work_b = torch.randn(*WORK_SHAPE[1:], device=device)

        def work() -> None:
            torch.matmul(work_a, work_b)

    comm = measure_collectives(torch, dist, rank, world, device, plan, timed, say, cuda=cuda,
                               shares_cores=shares_cores, after_compute=after_compute,
                               work=work if not cuda else None,
                               copy_bytes_per_s=2 * plan.copy_bytes / copy_s)

    # where the CPU ranks pair up, this rank's pair (every pair at once), for the
    # tensor-parallel figure and, where ranks share cores, the arrival cost
    # (new_subgroups is collective: every rank)
    pair = (dist.new_subgroups(group_size=2)[0]
            if not cuda and tp_measured_in_pairs(world) else None)
    arrival = 0.0
    if shares_cores and world > 1:
        # a tiny all-reduce after compute, over every rank and over pairs of ranks (the
        # groups of a 4-rank layout's parallelism); the collectives above ran back to back
        tiny = torch.ones(4, device=device)
        groups: list[Any] = [None]
        if pair is not None and world > 2:
            groups.append(pair)
        dist.barrier()
        arrival = measure_arrival(
            lambda: [work() for _ in range(ARRIVAL_WORK_CALLS)],
            [lambda g=g: dist.all_reduce(tiny, group=g) for g in groups],
            dist.barrier, agreed_mean)
        say(f"a collective after compute: {arrival * 1e6:.0f} us more per call than back to back")

    if cuda:
        # the optimizer's step is the device's memory-bound work there (one fused launch
        # per group of tensors); tensor parallelism's host work is not measured on one rank
        overhead.update(optimizer_param_s=0.0, optimizer_dtensor_param_s=0.0,
                        optimizer_element_s=0.0, tp_linear_forward_s=0.0,
                        tp_linear_backward_s=0.0)
    elif overhead is not None:
        # each rank's own one-rank group, for the DTensor figures (new_subgroups is collective)
        own = dist.new_subgroups(group_size=1)[0] if world > 1 else None
        opt_plain, opt_dtensor, opt_element = measure_optimizer_overhead(
            torch, lambda fn: timed(fn, plan.overhead_target_s, local=True), own)
        overhead.update(optimizer_param_s=opt_plain, optimizer_dtensor_param_s=opt_dtensor,
                        optimizer_element_s=opt_element)
        say(f"optimizer step overhead: {opt_plain * 1e6:.1f} us per parameter tensor, "
            f"{opt_dtensor * 1e6:.1f} us per DTensor parameter, "
            f"{opt_element * 1e9:.2f} ns per parameter element")
        # a rank's core time becomes seconds at this factor when every rank is busy
        share = max(1.0, world * threads / usable_cores()) if shares_cores else 1.0
        overhead["tp_linear_forward_s"] = overhead["tp_linear_backward_s"] = 0.0
        if world > 1:
            # on pairs of ranks in main-thread CPU time (times the share where ranks share
            # cores); on one-rank meshes, timed, where the ranks do not pair up
            tp_timed = (partial(core_seconds, dist, agreed_mean, share)
                        if pair is not None else
                        (lambda fn: timed(fn, plan.overhead_target_s)))
            tp_fwd, tp_bwd = measure_tp_overhead(torch, dist, tp_timed, own, pair,
                                                 TP_PAIR_ROUNDS if pair is not None else 1)
            overhead.update(tp_linear_forward_s=tp_fwd, tp_linear_backward_s=tp_bwd)
            say(f"tensor-parallel linear overhead: {tp_fwd * 1e6:.1f} us forward, "
                f"{tp_bwd * 1e6:.1f} us backward")
            if pair is not None:
                # and what grows with the activation (on one-rank groups DTensor skips the
                # collectives and their copies: not measured there, 0)
                per_byte = measure_tp_byte_overhead(torch, dist, tp_timed, pair,
                                                    TP_PAIR_ROUNDS)
                overhead["tp_collective_byte_s"] = per_byte
                say(f"tensor-parallel collective host work: {per_byte * 2**20 * 1e3:.2f} ms "
                    "per MiB of payload")
                shared_fwd, shared_bwd = measure_tp_shared_overhead(
                    torch, dist, tp_timed, pair, TP_PAIR_ROUNDS)
                overhead.update(tp_shared_linear_forward_s=shared_fwd,
                                tp_shared_linear_backward_s=shared_bwd)
                say(f"a column linear sharing its region's input: {shared_fwd * 1e6:.1f} us "
                    f"forward, {shared_bwd * 1e6:.1f} us backward")
        overhead["pipeline_action_s"] = overhead["pipeline_message_s"] = 0.0
        if world % 2 == 0:
            # a two-stage pipeline on pairs of ranks, every pair at once
            pp_pair = pair if pair is not None else dist.new_subgroups(group_size=2)[0]
            action, message = measure_pipeline_overhead(torch, dist, pp_pair, agreed_mean,
                                                        share)
            overhead.update(pipeline_action_s=action, pipeline_message_s=message)
            say(f"pipeline host work: {action * 1e6:.0f} us per stage action, "
                f"{message * 1e6:.0f} us per message end")
        if pair is not None:
            # FSDP2 around its collectives, on pairs of ranks as the tensor-parallel figures
            g_call, g_byte, r_call, r_byte, a_call, a_byte = measure_fsdp_overhead(
                torch, dist, pair, agreed_mean)
            overhead.update(fsdp_gather_call_s=g_call, fsdp_gather_byte_s=g_byte,
                            fsdp_reduce_call_s=r_call, fsdp_reduce_byte_s=r_byte,
                            replicate_call_s=a_call, replicate_byte_s=a_byte)
            say(f"FSDP2 beyond its collectives: all-gather {g_call * 1e3:.2f} ms per call + "
                f"{g_byte * 2**20 * 1e3:.2f} ms per MiB, reduce-scatter {r_call * 1e3:.2f} ms "
                f"+ {r_byte * 2**20 * 1e3:.2f} ms per MiB, replicate's all-reduce "
                f"{a_call * 1e3:.2f} ms + {a_byte * 2**20 * 1e3:.2f} ms per MiB")
            # context parallelism's collectives in a step, on the same pairs
            cg_call, cg_byte, cs_call, cs_byte = measure_cp_overhead(torch, dist, pair,
                                                                     agreed_mean)
            overhead.update(cp_gather_call_s=cg_call, cp_gather_byte_s=cg_byte,
                            cp_scatter_call_s=cs_call, cp_scatter_byte_s=cs_byte)
            say(f"context-parallel collectives in a step: all-gather {cg_call * 1e3:.2f} ms "
                f"+ {cg_byte * 2**20 * 1e3:.2f} ms per MiB, reduce-scatter "
                f"{cs_call * 1e3:.2f} ms + {cs_byte * 2**20 * 1e3:.2f} ms per MiB beyond "
                "back to back")

    if cuda:
        props = torch.cuda.get_device_properties(rank)
        info = {"name": torch.cuda.get_device_name(rank), "memory_bytes": int(props.total_memory),
                "capability": [int(props.major), int(props.minor)]}
    else:
        info = {"name": cpu_name(), "memory_bytes": physical_memory_bytes()}
    mine = {"rank": rank, "matmul": matmul, "copy_s": copy_s, "info": info, "overhead": overhead,
            **({"reference": list(reference)} if reference is not None else {}),
            "cold_bytes": cold_bytes, "attention": attention, "elementwise": elementwise,
            "grouped": grouped, "fp8_matmul": fp8_matmul}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        payload = {"ranks": gathered, "comm": comm, "world": world, "shares_cores": shares_cores,
                   "comm_after_compute": after_compute, "arrival_s": arrival}
        atomic_write_text(Path(result_dir, "result.json"), json.dumps(payload))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """While active (in the main thread), SIGTERM raises :class:`KeyboardInterrupt`, so that
    a profile stopped by ``kill`` or a job scheduler stops its ranks as Ctrl-C does rather
    than leaving them running; the previous handler is restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:    # (None: a handler not set from Python; the default then)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def run_ranks(nproc: int, backend: str, cuda: bool, threads: int, plan: MeasurementPlan,
              timeout_s: float, start: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="autoplan-profile-") as result_dir, \
            _terminate_as_interrupt():
        init = f"tcp://127.0.0.1:{_free_port()}"
        procs = [ctx.Process(target=_worker, args=(r, nproc, init, backend, cuda, threads, plan,
                                                   result_dir, start, os.getpid()),
                             daemon=False)
                 for r in range(nproc)]
        deadline = time.monotonic() + timeout_s
        failure = None
        try:
            for p in procs:
                p.start()
            while True:
                codes = [p.exitcode for p in procs]
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failure = "rank " + ", ".join(f"{r} exited with code {c}" for r, c in bad)
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout_s:g} s"
                    break
                time.sleep(0.05)
        finally:
            for p in procs:  # the survivors of a failure, or everyone on Ctrl-C or SIGTERM
                if p.is_alive():
                    p.terminate()
            for p in procs:
                if p.pid is None:   # interrupted before it started
                    continue
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        errors = sorted(Path(result_dir).glob("error-*.txt"))
        if failure or errors:
            details = "\n".join(f"--- {e.stem} ---\n{e.read_text()}" for e in errors)
            raise ProfilingFailed(f"profiling failed: {failure or 'a rank raised'}\n{details}".rstrip())
        return json.loads(Path(result_dir, "result.json").read_text())
