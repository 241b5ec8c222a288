"""``autoplan profile``: measure the machine this runs on and write a profile.

What is measured, on each of ``--nproc`` local ranks at once (so shared
resources such as the memory bus and the cores are shared as they will be in
training):

* matmul throughput over square sizes, for fp32 and bf16 (on CUDA also tf32
  and fp16);
* memory bandwidth (a large tensor copy: bytes read + bytes written);
* all-reduce, all-gather, reduce-scatter, all-to-all, broadcast and
  point-to-point (ping-pong) time over message sizes, with torch.distributed
  (gloo on CPU, NCCL on CUDA); none with one rank (``--nproc 1``, a machine of one
  GPU), whose node's link then stands at the device's copy bandwidth;
* on CUDA, torch's fused attention (causal ``scaled_dot_product_attention`` in bf16,
  forward and backward) over sequence lengths, as the profile's
  ``attention_efficiency`` (:func:`~.attention.tabulate_attention`);
* the host: its RAM, cores and the bandwidth of a large copy in host memory, and on CUDA
  one GPU's host link (:func:`~.host.measure_host`), for embedding tables kept in host memory;
* on CPU, the host's time per operator: tiny transformer blocks (so small their
  arithmetic is negligible), the forward per operator they dispatch and the backward per
  autograd node they run (and both per captured operator, for older graphs), the extra
  time per dispatched operator under selective recompute (torch's selective
  checkpoint runs every operator the block dispatches through Python), the extra time
  of a tensor-parallel (DTensor) linear over a plain one (on real pairs of ranks where
  ranks share cores), an AdamW step's time per parameter tensor, plain and DTensor
  (added once per step), and a pipeline's host work per stage action and per message
  end (a two-stage 1F1B on pairs of ranks, :func:`~.parallel.measure_pipeline_overhead`); and a
  reference stack of blocks at a transformer's width timed whole, against the cost
  model's price for it (the layer scales), and under selective checkpoints that
  recompute nothing (the checkpoint's cost per activation byte); every
  repeat is timed on all ranks at once, from the first rank's start to the last rank's
  end, except where ranks share cores: there each
  rank times its own work in free-running windows with every rank busy
  (:func:`~.timing.free_running`).  The cost model adds it per operator and micro-batch.  On
  CUDA the same tiny blocks, on the GPU, measure the host's time (their kernels take
  less than their launch; no optimizer or tensor-parallel figure): there the host
  enqueues work ahead of the device, and the cost model takes the longer of the host's
  and the device's work per layer (selective recompute's Python dispatch made steps of a
  1-3B model 1.7-4x the GPU's busy time on an H100: ``benchmarks/gpu_truth.py``).

Every profile it writes says ``measured: true``: its peaks are the best achieved, so the
calibration's fitted fractions of a datasheet peak are not applied on top.

From this it writes a node :class:`~autoplan.hardware.profiles.Profile`:

* **device**: the "peak" FLOP/s per dtype is the *best measured* matmul
  throughput (not a datasheet figure) and the efficiency table is measured
  throughput over that peak, per size.  The slowest rank decides each point.
  On CPU a device is one rank with ``cores // nproc`` threads, its memory is
  the physical RAM divided equally among the ranks, and its bandwidth the
  copy bandwidth each rank gets while all copy at once; its ``op_overhead`` is
  the slowest rank's.  On CUDA a device is one GPU (the smallest memory, the
  slowest GPU).
* **node**: ``devices_per_node`` = ranks (CPU) or GPUs (CUDA).  For each
  collective, ``t(S) = a + b S`` is fitted (least squares on relative error)
  and turned into the ring model of :mod:`autoplan.hardware.collectives`:
  bus bandwidth ``factor / b`` and per-step latency ``a / steps``.  The node's
  bandwidth is the best bus bandwidth of any operation, each operation's
  efficiency its bus bandwidth over that, each operation's latency its own
  per-step latency (``collective_latency``) and the hop latency the median of
  those.  A collective's time is its *mean* over every timed call, not the best
  batch: on a CPU host a call now and then waits a scheduler tick (a few ms,
  against ~0.2-0.4 ms typical), and a training step pays every call.  On a CPU
  whose ranks each have cores of their own, each collective is timed after a
  matmul of about a millisecond, less the matmul alone: in a step the ranks
  arrive apart and a waiting rank has gone idle, which back-to-back calls miss.
* **network**: none (one machine): the profile forms one-node clusters.

The package sits above the hardware records, the runtime and the cost model (it uses all
three; none of them imports it), one module per kind of measurement:

* :mod:`.matmul` (cold matmuls), :mod:`.grouped_gemm` (MoE experts' grouped GEMMs),
  :mod:`.attention` (fused attention), :mod:`.elementwise` (memory-bound operators),
  :mod:`.fp8` (FP8 GEMMs on GPUs that have them);
* :mod:`.collectives` (the collectives' fit, the cost of one after compute);
* :mod:`.overhead` (the host's time per operator, selective recompute, the optimizer),
  :mod:`.parallel` (tensor-parallel linears, pipelines, FSDP2 and replicate, context
  parallelism), :mod:`.reference` (the reference blocks' layer scales);
* :mod:`.host` (host memory and its link to a GPU);
* :mod:`.workers` (the ranks and what each measures), :mod:`.build` (the raw measurements
  into a profile), :mod:`.plan` (what to measure), :mod:`.timing` (how a call is timed).

Examples
--------
.. code-block:: console

    $ autoplan profile --quick          # about a minute on 2 CPU cores (63 s; 124 s shared)
    $ autoplan profile --nproc 4 --out my-box.yaml --json

Without ``--out`` the profile goes to ``$AUTOPLAN_HOME/profiles/local-<host>.yaml``
(default ``~/.autoplan/profiles``), a folder ``load_cluster`` searches by name.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from ..hardware.profiles import load_profile, profile_to_yaml, user_profiles_dir
from ..records import atomic_write_text
from .build import build_profile, median_raw, profile_name, profile_summary
from .collectives import fit_alpha_beta
from .host import measure_host
from .plan import MeasurementPlan
from .timing import PREFIX, ProfilingFailed, progress, usable_cores
from .workers import run_ranks


__all__ = ["main", "MeasurementPlan", "ProfilingFailed", "fit_alpha_beta", "measure_host"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoplan profile",
        description="Measure this machine (CPU, or each CUDA GPU) and write a hardware profile "
                    "that autoplan.load_cluster reads.")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and shorter timings (about a minute with 2 ranks on 2 CPU "
                        "cores: 63 s measured, 124 s with the cores shared)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to measure with (default: 2 on CPU, every GPU on CUDA)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="what to profile (default: CUDA when available)")
    p.add_argument("--out", type=Path, default=None,
                   help="profile file to write (default: $AUTOPLAN_HOME/profiles/local-<hostname>"
                        ".yaml, i.e. ~/.autoplan/profiles/..., loadable by name)")
    p.add_argument("--name", default=None,
                   help="profile name (default: the --out file name, or local-<hostname>)")
    p.add_argument("--json", action="store_true",
                   help="print the profile and the raw measurements as JSON on stdout")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="measure N times and keep each figure's median (default 1): on a "
                        "machine whose speed comes and goes (a shared VM), one run can catch "
                        "a slow spell")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="give up after this many seconds, each run (default 600)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``autoplan profile``; returns the exit status (0 ok, 1 failed, 2 usage)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return int(exc.code or 0)
    start = time.perf_counter()
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        parser.print_usage(sys.stderr)
        print(f"{PREFIX} error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = args.nproc if args.nproc is not None else (gpus if cuda else 2)
    if nproc < 1 or (cuda and nproc > gpus):
        parser.print_usage(sys.stderr)
        limit = f" and at most {gpus} (GPUs present)" if cuda else ""
        print(f"{PREFIX} error: --nproc must be at least 1{limit}, got {nproc}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        parser.print_usage(sys.stderr)
        print(f"{PREFIX} error: --repeat must be at least 1, got {args.repeat}", file=sys.stderr)
        return 2
    if args.out is not None:
        out = args.out
        name = profile_name(args.name or out.stem)
    else:
        name = profile_name(args.name or f"local-{socket.gethostname()}")
        out = user_profiles_dir() / f"{name}.yaml"
    cores = usable_cores()
    threads = 1 if cuda else max(1, cores // nproc)
    plan = MeasurementPlan.for_machine(cuda, args.quick)
    backend = "nccl" if cuda else "gloo"
    progress(f"profiling {'CUDA' if cuda else 'CPU'} with {nproc} rank{'s' if nproc > 1 else ''} "
             f"({backend}"
             f"{'' if cuda else f', {threads} thread(s) each'}){' --quick' if args.quick else ''}",
             start)
    try:
        raws = []
        for run in range(args.repeat):
            if args.repeat > 1:
                progress(f"run {run + 1} of {args.repeat}", start)
            raws.append(run_ranks(nproc, backend, cuda, threads, plan, args.timeout, start))
        raw = median_raw(raws)
    except ProfilingFailed as exc:
        print(f"{PREFIX} {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PREFIX} interrupted", file=sys.stderr)
        return 130
    profile, measurements = build_profile(
        name, raw, cuda=cuda, nproc=nproc, threads=threads,
        devices_per_node=gpus if cuda else nproc, quick=args.quick, copy_bytes=plan.copy_bytes,
        cores=cores, runs=args.repeat)
    progress("host memory" + (" and host link" if cuda else ""), start)
    profile = replace(profile, host=measure_host(cuda=cuda, quick=args.quick))
    header = (f"# Measured by `autoplan profile` ({'quick, ' if args.quick else ''}{nproc} "
              f"rank{'s' if nproc > 1 else ''}"
              f"{f', the median of {args.repeat} runs' if args.repeat > 1 else ''}) "
              f"on {socket.gethostname()}. Figures are measurements, not datasheet values;\n"
              f"# see autoplan/profiling/ for what each one means. Re-run to refresh.\n")
    atomic_write_text(out, header + profile_to_yaml(profile))
    load_profile(out)  # what we wrote must load
    elapsed = time.perf_counter() - start
    progress(f"done: {out}", start)
    if args.json:
        print(json.dumps({"path": str(out), "elapsed_s": elapsed, "plan": asdict(plan),
                          "profile": profile.to_dict(), "measurements": measurements}, indent=1))
    else:
        print(profile_summary(profile, out, elapsed))
    return 0
