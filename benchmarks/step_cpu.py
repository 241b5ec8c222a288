"""Where a step's core time goes when ranks share cores, next to what the cost model prices.

``benchmarks/local_truth.py --confirm`` runs 4 CPU processes on this machine's 2 cores; its
misses (layouts more than 15% off) are pipelines, every one priced fast.  This runs layouts
of the confirm models (``autoplan.parallelize``, 4 processes, gloo, one thread each, global
batch 8) and accounts for the node's core time over a step: each rank's CPU time inside
the pipeline's stage calls (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``; without a pipeline, the model's forward and the loss's
``backward``: the model's work, with the data-parallel wrappers' hooks in it), in the
optimizer, elsewhere on its main thread (the schedule, the wrappers' reductions and buffer
copies, the loss), on its other threads (gloo's transport loops move every collective and
point-to-point transfer over loopback TCP: CPU work on shared cores) and, left over, the
cores' idle time.
Each figure is the median over ``--steps`` steps of the sum over the ranks, in core-ms; a
step spans the first rank's start to the last rank's end.

With ``--profile``, each layout is also priced by the engine as the confirm pass prices it
(``calibration=None``, ``GLOO_ON_CPU``): the step, and the stage work it charges (every
replica's micro-batches' forward + backward per pipeline rank, exposed communication
included, at every-rank-busy speed) in core-ms (times the cores over the ranks).

    python benchmarks/step_cpu.py --profile local.yaml            # 3 GPT pipelines, ~1 min
    python benchmarks/step_cpu.py --model llama --layout dp=2,pp=2,micro_batch=1,zero=1

What it found (2026-11-26, 2 cores, dp 2 pp 2 GPipe, priced with one quick profile; two
runs of GPT, one of Llama).  GPT, 4 micro-batches of 1 sequence: 243-248 ms a step against
208 priced; of its 487-496 core-ms the stage calls took 373-388 (the engine charges 345 as
stage work), the main threads 25-26 more, the other threads (gloo's transport) 44-51, and
the cores idled 22-28.  2 of 2: 215-221 ms against 195; stage 331-340 (319 charged).  1 of
4: 194-201 ms against 186; stage 304-305 (303 charged), transport 28-42.  Llama, 1/2/4
sequences a micro-batch: 265/213/196 ms against 226/208/198; stage 400/328/296 (384/348/327
charged), main threads 31/23/22, transport 49/45/35, idle 35/20/21.  The stage work is
charged within 12% either way (at one sequence a micro-batch 4-12% low); the transport and
the main thread's other work, ~15% of the node's core time, are not priced as core time:
at 4 sequences the engine's pipeline bound (the busiest rank at every-rank-busy speed) is
pessimistic enough to cover them, at 1 it is not.  Earlier runs of this script read the
same GPT layout's stage work at one micro-batch of 4 at 312 and 373 core-ms minutes apart:
the machine's speed moves that much.  Later the same day: against one micro-batch of 4, a
one-sequence 1F1B step spent 0.25 core-ms more per stage action in its main threads and 0.75
in its transport threads, what the profile now measures on a two-stage pipeline of a tiny
linear (``OpOverhead.pipeline_action_s``, ``pipeline_message_s``) and the engine prices per
stage action and message end (in the priced stage column since).  There is no target: it
says what the model does not yet price.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# spawn + join by a deadline + error reports, and the confirm pass's models and batch
from local_truth import (CONFIG, CONFIRM_BATCH, CONFIRM_MODELS, CONFIRM_WORLD,  # noqa: E402
                         GLOO_ON_CPU, _confirm_model, _in_worker, _run_ranks)

DEFAULT_LAYOUTS = ("dp=2,pp=2,micro_batch=1,schedule=gpipe",
                   "dp=2,pp=2,micro_batch=2,schedule=gpipe",
                   "dp=2,pp=2,micro_batch=4,schedule=gpipe")
WARMUP = 3
TIMEOUT_S = 300.0   # one layout's launch
STAGE_CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
INT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "micro_batch", "zero", "virtual_stages")
TEXT_FIELDS = ("recompute", "schedule")


def parse_layout(text: str) -> dict:
    """``"dp=2,pp=2,micro_batch=1"`` -> Strategy keywords (global batch and precision are
    the confirm pass's); a ``ValueError`` says what was wrong."""
    kw: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"{part!r} is not key=value")
        if key in INT_FIELDS:
            try:
                kw[key] = int(value)
            except ValueError:
                raise ValueError(f"{key} must be an integer, got {value!r}") from None
        elif key in TEXT_FIELDS:
            kw[key] = value
        elif key == "sequence_parallel":
            flag = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
            if value.lower() not in flag:
                raise ValueError(f"sequence_parallel must be true or false, got {value!r}")
            kw[key] = flag[value.lower()]
        else:
            raise ValueError(f"unknown key {key!r}; use {', '.join(INT_FIELDS + TEXT_FIELDS)}"
                             ", sequence_parallel")
    return kw


def strategy_of(kw: dict):
    from autoplan.strategy import Strategy
    return Strategy(global_batch=CONFIRM_BATCH, precision="fp32", **kw)


def _threads_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads (Linux ``/proc``), by thread id: the
    scheduler's nanosecond run time (``schedstat``), else user + system clock ticks
    (``stat``, 10 ms steps)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0]) / 1e9
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:   # the thread ended
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _measure(pm, ids, *, rank: int, outdir: str, steps: int) -> None:
    """``WARMUP`` steps, then ``steps`` steps whose CPU figures rank ``rank`` writes."""
    import torch
    import torch.distributed as dist
    spent = {"stage": 0.0, "optimizer": 0.0}

    def timed(obj, attr: str, key: str) -> None:
        inner = getattr(obj, attr)

        def call(*args, **kwargs):
            c0 = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[key] += time.thread_time() - c0
        setattr(obj, attr, call)

    for stage in pm.stages:
        for attr in STAGE_CALLS:
            if hasattr(stage, attr):
                timed(stage, attr, "stage")
    if not pm.stages:   # pp 1: the model's forward and the loss's backward
        for part in pm.parts:
            timed(part, "forward", "stage")
        timed(torch.Tensor, "backward", "stage")
    for opt in pm.optimizers:
        timed(opt, "step", "optimizer")
    rows = []
    for i in range(WARMUP + steps):
        spent.update(stage=0.0, optimizer=0.0)
        dist.barrier()
        threads0, main0 = _threads_cpu(), time.thread_time()
        t0 = time.perf_counter()
        pm.step(ids)
        t1 = time.perf_counter()
        main, threads1 = time.thread_time() - main0, _threads_cpu()
        dist.barrier()
        process = sum(v - threads0.get(t, 0.0) for t, v in threads1.items())
        if i >= WARMUP:
            rows.append({"start": t0, "end": t1, "process": process, "main": main, **spent})
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(rows))


def _worker(rank: int, world: int, port: int, label: str, outdir: str, *, model: str,
            kw: dict, steps: int) -> None:
    _in_worker(rank, world, port, outdir, strategy_of(kw),
               partial(_measure, rank=rank, outdir=outdir, steps=steps),
               model=partial(_confirm_model, model), global_batch=CONFIRM_BATCH)


def account(ranks: list[list[dict]], cores: int) -> dict[str, float]:
    """Medians over the steps of the ranks' sums, in seconds (core-seconds but ``step``)."""
    per_step = []
    for rows in zip(*ranks):
        step = max(r["end"] for r in rows) - min(r["start"] for r in rows)
        stage = sum(r["stage"] for r in rows)
        optimizer = sum(r["optimizer"] for r in rows)
        main = sum(r["main"] for r in rows)
        # /proc's clock ticks (without schedstat) are coarser than thread_time: other
        # threads never read below 0
        others = max(0.0, sum(r["process"] for r in rows) - main)
        per_step.append({"step": step, "cores": cores * step, "stage": stage,
                         "optimizer": optimizer, "main_other": main - stage - optimizer,
                         "other_threads": others,
                         "idle": cores * step - main - others})
    return {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}


def priced(profile: Path, model: str, kw: dict, graphs: dict) -> dict[str, float]:
    """The engine's step and stage work (core-seconds) for the layout, as the confirm
    pass prices it."""
    from autoplan import estimate, load_cluster, trace
    cluster = load_cluster(str(profile))
    if model not in graphs:
        graphs[model] = trace(_confirm_model(model), seq_len=CONFIG.seq_len)
    s = strategy_of(kw)
    est = estimate(graphs[model], cluster, s, calibration=None, options=GLOO_ON_CPU)
    node = cluster.profile_of(0).node
    cores = node.shared_cores or CONFIRM_WORLD
    m = CONFIRM_BATCH // (s.dp * s.micro_batch)
    per_stage = s.world_size // (s.dp * s.pp)     # a stage's ranks in a replica (tp x cp x ...)
    work = s.dp * per_stage * sum(m * (st.forward_s + st.backward_s) for st in est.stages)
    return {"step": est.step_time_s, "stage": work * min(1.0, cores / CONFIRM_WORLD)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=CONFIRM_MODELS, default="gpt")
    parser.add_argument("--layout", action="append", metavar="K=V,...",
                        help="Strategy keywords, e.g. dp=2,pp=2,micro_batch=1,schedule=gpipe "
                             "(repeatable; default: GPT dp 2 pp 2 GPipe at micro-batches 1, 2, 4)")
    parser.add_argument("--profile", type=Path,
                        help="a profile of this machine (autoplan profile --quick --nproc 4 "
                             "--device cpu): also print what the engine prices")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="cores the ranks share (default: this machine's)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.cores < 1:
        parser.error(f"--steps and --cores must be >= 1, got {args.steps} and {args.cores}")
    if args.profile is not None and not args.profile.is_file():
        parser.error(f"--profile {args.profile}: no such file")
    layouts = []
    for text in args.layout or DEFAULT_LAYOUTS:
        try:
            kw = parse_layout(text)
            s = strategy_of(kw)
        except Exception as exc:   # ValueError from parsing, AutoplanError from Strategy
            parser.error(f"--layout {text!r}: {exc}")
        if s.world_size != CONFIRM_WORLD:
            parser.error(f"--layout {text!r} uses {s.world_size} devices; this runs "
                         f"{CONFIRM_WORLD} processes")
        layouts.append((text, kw))
    graphs: dict = {}
    print(f"{args.model}, {CONFIRM_WORLD} processes on {args.cores} cores, global batch "
          f"{CONFIRM_BATCH}; core-ms per step (medians of {args.steps} steps, summed over ranks)")
    head = (f"{'layout':44s} {'step ms':>8s} {'cores':>6s} {'stage':>6s} {'optim':>6s} "
            f"{'main+':>6s} {'comm':>6s} {'idle':>6s}")
    if args.profile:
        head += f" | {'priced step':>11s} {'stage':>6s}"
    print(head)
    for text, kw in layouts:
        try:
            ranks = _run_ranks(partial(_worker, model=args.model, kw=kw, steps=args.steps),
                               CONFIRM_WORLD, text, TIMEOUT_S,
                               lambda out: [json.loads(p.read_text())
                                            for p in sorted(out.glob("rank*.json"))])
        except RuntimeError as exc:   # the ranks' error reports
            print(f"{text:44s} failed: {exc}")
            continue
        if len(ranks) != CONFIRM_WORLD:
            print(f"{text:44s} failed: a process died or passed {TIMEOUT_S:.0f} s")
            continue
        a = {k: v * 1e3 for k, v in account(ranks, args.cores).items()}
        line = (f"{text:44s} {a['step']:8.1f} {a['cores']:6.0f} {a['stage']:6.0f} "
                f"{a['optimizer']:6.0f} {a['main_other']:6.0f} {a['other_threads']:6.0f} "
                f"{a['idle']:6.0f}")
        if args.profile:
            try:
                p = priced(args.profile, args.model, kw, graphs)
            except Exception as exc:   # a profile that does not load, a layout it rejects
                line += f" | not priced: {type(exc).__name__}: {exc}"
            else:
                line += f" | {p['step'] * 1e3:11.1f} {p['stage'] * 1e3:6.0f}"
        print(line, flush=True)
    print("stage: CPU in the stage calls (pp 1: forward and backward); main+: the rest of the "
          "main threads; comm: other threads (gloo's transport); idle: the cores' time left "
          "over; each column its own median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
