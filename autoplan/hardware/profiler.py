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
  ``attention_efficiency`` (:func:`_attention_table`);
* the host: its RAM, cores and the bandwidth of a large copy in host memory, and on CUDA
  one GPU's host link (:func:`measure_host`), for embedding tables kept in host memory;
* on CPU, the host's time per operator: tiny transformer blocks (so small their
  arithmetic is negligible), the forward per operator they dispatch and the backward per
  autograd node they run (and both per captured operator, for older graphs), the extra
  time per dispatched operator under selective recompute (torch's selective
  checkpoint runs every operator the block dispatches through Python), the extra time
  of a tensor-parallel (DTensor) linear over a plain one (on real pairs of ranks where
  ranks share cores), an AdamW step's time per parameter tensor, plain and DTensor
  (added once per step), and a pipeline's host work per stage action and per message
  end (a two-stage 1F1B on pairs of ranks, :func:`_measure_pipeline_overhead`); and a
  reference stack of blocks at a transformer's width timed whole, against the cost
  model's price for it (the layer scales), and under selective checkpoints that
  recompute nothing (the checkpoint's cost per activation byte); every
  repeat is timed on all ranks at once, from the first rank's start to the last rank's
  end, except where ranks share cores: there each
  rank times its own work in free-running windows with every rank busy
  (:func:`_free_running`).  The cost model adds it per operator and micro-batch.  On
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
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..records import atomic_write_text
from .collectives import CollectiveOp, ring_coefficients
from .profile_records import ELEMENTWISE_KINDS, RATE_KINDS, cuda_architecture
from .profile_fp8 import fp8_capable, fp8_tables, measure_fp8_gemms
from .hosts import HostSpec
from .profiles import (
    COLLECTIVE_OPS,
    CollectiveEfficiency,
    CollectiveLatency,
    DeviceType,
    EfficiencyTable,
    IntraNodeTopology,
    NodeSpec,
    OpOverhead,
    ElementwiseRates,
    Profile,
    load_profile,
    profile_to_yaml,
    user_profiles_dir,
)

__all__ = ["main", "MeasurementPlan", "fit_alpha_beta"]

_PREFIX = "[autoplan profile]"
_WARMUP_CALLS = 2  # untimed calls before timing (first-touch allocation, connection set-up)
_CALIBRATION_CALLS = 3  # calls timed to choose the iteration count of the timed batches
#: where ranks share cores, calls per timed batch at least: a batch spans from the first
#: rank's start to the last rank's end, and ranks that share cores leave the barrier up to a
#: scheduler slice apart (a quick 4-rank profile on 2 cores timed 2-call batches of its
#: larger matmuls, and priced the confirm models' step ~5% slower than with 8-call ones)
_MIN_SHARED_CALLS = 8
_OVERRUN = 2.0  # stop repeating once a point has taken this many times its target
#: where ranks share cores, a rank's own work is timed in windows of at least this many
#: seconds (:func:`_free_running`): their start and end skew, up to a scheduler slice each,
#: then moves a figure by ~3%
_MIN_FREE_WINDOW_S = 0.15
#: CPU collectives are timed after a matmul of this shape (m, k, n): 134 MFLOP, about a
#: millisecond on one core, like the compute between a step's collectives
_WORK_SHAPE = (256, 256, 1024)
_WORK_FLOPS = 2 * math.prod(_WORK_SHAPE)
#: floor of a collective's time after the compute is subtracted (noise can take it below 0)
_MIN_COLLECTIVE_S = 1e-6
#: Matmuls are timed cold, as a training step runs them (other layers' weights and
#: activations have evicted the caches since the last use): each call takes the next of
#: several input/output sets that together span at least this many bytes, twice this
#: machine's 32 MiB last-level CPU cache (on CUDA, twice the device's L2 where larger;
#: Triton's ``do_bench`` clears the L2 before each call likewise).  Warm, back to back, the
#: step's matmul sizes on this CPU run 7-22% faster (median ~15%).
_COLD_BYTES = 64 * 2**20


@dataclass(frozen=True)
class MeasurementPlan:
    """What to measure and for how long (seconds are targets per point, not limits)."""

    matmul_sizes: dict[str, tuple[int, ...]]
    matmul_target_s: float
    copy_bytes: int
    copy_target_s: float
    comm_sizes_bytes: tuple[int, ...]
    comm_target_s: float
    repeats: int
    overhead_target_s: float = 0.1
    #: fused attention (CUDA only): (batch, heads, sequence, head dim) per timed call
    attention_shapes: tuple[tuple[int, int, int, int], ...] = ()

    @classmethod
    def for_machine(cls, cuda: bool, quick: bool) -> "MeasurementPlan":
        """The default (or ``quick``) plan for a CPU or a CUDA machine."""
        kib, mib = 2**10, 2**20
        if cuda:
            sizes = (512, 1024, 2048, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
            seqs = (1024, 4096) if quick else (512, 1024, 2048, 4096, 8192)
            attention = tuple((_ATTENTION_TOKENS // s, heads, s, d) for s in seqs
                              for heads, d in _ATTENTION_HEADS)
            return cls({d: sizes for d in ("fp32", "tf32", "bf16", "fp16")},
                       0.05 if quick else 0.2, (256 if quick else 1024) * mib, 0.05 if quick else 0.2,
                       tuple(4**i * kib for i in range(0, 9 if quick else 10, 2 if quick else 1)),
                       0.05 if quick else 0.2, 3 if quick else 5,
                       attention_shapes=attention)
        if quick:
            # collectives up to 16 MiB, where a CPU collective is bandwidth-bound: up to 2 MiB
            # the fit's slope was noise under latency on 4 ranks of 2 cores (1000 GB/s)
            return cls({"fp32": (128, 256, 512, 768), "bf16": (128, 256, 512)}, 0.06,
                       64 * mib, 0.1, (1 * kib, 16 * kib, 256 * kib, 16 * mib), 0.2, 3, 0.1)
        return cls({"fp32": (64, 128, 256, 512, 1024, 1536), "bf16": (64, 128, 256, 512, 1024)},
                   0.4, 256 * mib, 0.5, tuple(4**i * kib for i in range(0, 8)), 0.35, 5, 0.4)


# --------------------------------------------------------------------------- fitting


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Fit ``t = a + b * S`` minimising the squared *relative* error; ``a >= 0``, ``b > 0``.

    Relative weighting lets the small sizes fix the latency and the large ones
    the bandwidth.  The times are first made non-decreasing in size (adjacent
    violators pooled to their mean): a collective does not get faster with more
    bytes, so a larger size measured faster is noise, and left in it could turn
    the slope negative and drop the latency of a latency-bound operation.

    Examples
    --------
    >>> a, b = fit_alpha_beta([1e3, 1e6, 1e9], [1e-5 + 1e-9 * s for s in (1e3, 1e6, 1e9)])
    >>> round(a, 9), round(b, 15)
    (1e-05, 1e-09)
    """
    if len(sizes) != len(times) or not sizes:
        raise ValueError("fit_alpha_beta needs as many times as sizes, at least one")
    sizes, times = _monotone(sizes, times)
    w = [1.0 / t for t in times]  # rows scaled by 1/t: minimise sum ((a + b s - t) / t)^2
    sww = sum(x * x for x in w)
    sws = sum(x * x * s for x, s in zip(w, sizes))
    sss = sum((x * s) ** 2 for x, s in zip(w, sizes))
    swt = sum(x * x * t for x, t in zip(w, times))
    sst = sum(x * x * s * t for x, s, t in zip(w, sizes, times))
    det = sww * sss - sws * sws
    a, b = (((sss * swt - sws * sst) / det, (sww * sst - sws * swt) / det)
            if len(sizes) >= 2 and det > 0 else (0.0, 0.0))
    if a < 0 or b <= 0:  # through the origin, or bandwidth from the largest size
        a = 0.0
        b = sst / sss if sst > 0 else 0.0
    if b <= 0:
        i = max(range(len(sizes)), key=lambda j: sizes[j])
        b = times[i] / sizes[i]
    return a, b


def _monotone(sizes: list[float], times: list[float]) -> tuple[list[float], list[float]]:
    """``(sizes, times)`` sorted by size, the times made non-decreasing by pooling adjacent
    violators (the least-squares monotone fit).

    >>> _monotone([1, 2, 3, 4], [5.0, 3.0, 7.0, 6.0])
    ([1, 2, 3, 4], [4.0, 4.0, 6.5, 6.5])
    """
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    blocks: list[list[float]] = []      # [sum, count] per pooled block
    for i in order:
        blocks.append([times[i], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    pooled = [value for total, count in blocks for value in [total / count] * int(count)]
    return [sizes[i] for i in order], pooled


# --------------------------------------------------------------------------- operator overhead

#: Width of the tensors the overhead is measured on: small enough that the arithmetic is
#: negligible next to the dispatch, so the time is the per-operator overhead.
_OVERHEAD_WIDTH = 8


def _overhead_model(torch, h: int, blocks: int):
    """``blocks`` tiny pre-norm transformer blocks of width ``h`` in an ``nn.Sequential``,
    written with modules as models are (a block's host time includes its module calls):
    two layer norms, four linears, a causal softmax attention with dropout, a GELU MLP and
    two residual adds, :data:`OVERHEAD_BLOCK_OPS` captured operators each (not counting
    ``getitem``).  Seeded, without touching the caller's random state."""
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 2, h // 2).unbind(2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(h // 2))
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().bitwise_not()
            att = self.attn_dropout(att.masked_fill(mask, float("-inf")).softmax(-1))
            out = torch.matmul(att, v).transpose(1, 2).reshape(b, s, h)
            return self.resid_dropout(self.proj(out))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.proj = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)
            self.dropout = nn.Dropout(0.0)

        def forward(self, x):
            return self.dropout(self.proj(self.act(self.fc(x))))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(h), Attention()
            self.ln_2, self.mlp = nn.LayerNorm(h), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(*(Block() for _ in range(blocks)))


#: Captured operators in one block of :func:`_overhead_model` (what the capture records
#: for it, less ``getitem``): layer_norm, linear, view, unbind, 3 transpose, transpose,
#: matmul, mul, ones, tril, bitwise_not, masked_fill, softmax, dropout, matmul, transpose,
#: reshape, linear, dropout, add, layer_norm, linear, gelu, linear, dropout, add.
OVERHEAD_BLOCK_OPS = 28
#: Blocks the forward and backward host time is measured over: the autograd engine's
#: start and the loss spread over several layers, as in a model.
_OVERHEAD_BLOCKS = 4


#: The reference stack a CPU profile times whole against the cost model's price for it
#: (``OpOverhead.layer_forward_scale``): :func:`_overhead_model` blocks at a transformer's
#: width, ``(micro-batch, sequence, width)`` inputs.
_REFERENCE_SHAPE = (4, 128, 256)
_REFERENCE_BLOCKS = 2
#: The ``(micro-batch, sequence)`` the reference stack is timed at besides
#: ``_REFERENCE_SHAPE``'s: the host work is about the same at both (a micro-batch of one
#: dispatches 48 operators a block, not 51: views that are no-ops) and the arithmetic 16
#: times less, which separates the two (``OpOverhead.host_forward_scale``; stated in the
#: profile's source, not applied: ``HOST_SPLIT_NOT_APPLIED``).  Host work is ~37%
#: of its price (13% at one sequence of 128 tokens, the first form: there a 1% timing
#: error moved the host scale ~0.3, and one profile's backward read 5.4 against 2.5).
#: On the 2-core AMD VM, 4 ranks at once timed these blocks at 4x128, 1x128, 1x32 and
#: 1x8 tokens alternately: one arithmetic and one host scale fitted all four backward
#: within 1.5%; fitted on 4x128 and 1x32 they priced 1x128 within 1.4% forward, 0.4%
#: backward (the forward at 1x8 reads 16% over the line; 2026-11-28)
_REFERENCE_SMALL_SHAPE = (1, 32)
#: Why a profile states the host split (``OpOverhead.host_forward_scale``, fitted on the
#: two shapes) in its source but prices with the larger shape's ratio on host work and
#: arithmetic alike: in the three confirm passes whose profiles timed the second shape
#: (``benchmarks/local_truth.py --confirm``, 4 processes on 2 cores of an AMD EPYC VM,
#: 2026-11-28), the layouts priced nearer what they measured without the split, 70 against
#: 64, 67 against 51 and 66 against 60 of 81 within 15% (the Llama most: 93 dispatched
#: operators a block, many on tiny tensors, against the reference's 48).  ``local_truth.py --reprice
#: --host-split`` prices stored passes with it.
HOST_SPLIT_NOT_APPLIED = ("it priced three confirm passes of 4 processes on 2 cores worse "
                          "than one ratio for both, 64, 51 and 60 of 81 layouts within 15% "
                          "against 70, 67 and 66")
#: Seconds each of its timings takes at least (windows of ~100 ms calls): its selective
#: checkpoint's extra is the difference of two of them, ~25% of either; at the quick
#: profile's 0.45 s (three windows of four calls) three profiles read 20-30 ms for it
#: (2026-11-27)
_REFERENCE_TARGET_S = 1.2


def _reference_stack(torch, shape: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """The reference stack, :data:`_REFERENCE_BLOCKS` :func:`_overhead_model` blocks, and
    an input of :data:`_REFERENCE_SHAPE` (or of ``shape``, ``(micro-batch, sequence)``, at
    its width)."""
    b, seq, width = _REFERENCE_SHAPE
    b, seq = shape or (b, seq)
    return _overhead_model(torch, width, _REFERENCE_BLOCKS), torch.randn(b, seq, width)


def _measure_reference_layers(torch, timed: Callable[[Callable[[], Any]], float]
                              ) -> tuple[float, float, float, float, float]:
    """Seconds of the forward and of the backward (forward + backward less the forward) of
    the reference stack (:func:`_reference_stack`; ``timed(fn)`` is seconds per call), the
    gradients dropped before each call as a step's first micro-batch finds them; the
    seconds its forward + backward takes more with each block wrapped as
    :func:`autoplan.parallelize` wraps a block under selective recompute, with an empty
    attention core (nothing recomputed: the checkpoint's own cost, as
    ``OpOverhead.selective_byte_s`` prices it beyond its per-operator figure); and the
    forward and backward again at :data:`_REFERENCE_SMALL_SHAPE`."""
    from ..graph import AttentionCore
    from ..runtime.ac import apply_ac
    from ..strategy import Recompute

    stack, x = _reference_stack(torch)
    x.requires_grad_(True)
    b, seq = _REFERENCE_SMALL_SHAPE
    small = x[:b, :seq].detach().clone().requires_grad_(True)
    nothing = AttentionCore(nodes=(), ops=(), calls={})
    selective = torch.nn.Sequential(*(apply_ac(block, Recompute.SELECTIVE, core=nothing)
                                      for block in _reference_stack(torch)[0]))

    def forward(inputs) -> Callable[[], Any]:
        return lambda: stack(inputs).sum()

    def both(model, inputs) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            inputs.grad = None
            model(inputs).sum().backward()
        return run

    fwd = timed(forward(x))
    whole = timed(both(stack, x))
    extra = max(0.0, timed(both(selective, x)) - whole)
    fwd_small = timed(forward(small))
    return (fwd, max(0.0, whole - fwd), extra, fwd_small,
            max(0.0, timed(both(stack, small)) - fwd_small))


def _reference_engine(device: DeviceType, shape: tuple[int, int] | None = None):
    """The cost model of the reference stack (:func:`_reference_stack`, traced at its
    input's shape or at ``shape``, ``(micro-batch, sequence)``) on one ``device``, without
    its layer scales."""
    import torch

    from ..capture import trace
    from ..cost.engine import CostEngine
    from .cluster import NodeGroup, compose_cluster

    stack, x = _reference_stack(torch, shape)
    graph = trace(stack, example_inputs=x, loss_fn=lambda out, *_: out.sum(),
                  title="reference blocks")
    plain = device if device.op_overhead is None else replace(
        device, op_overhead=replace(device.op_overhead, layer_forward_scale=None,
                                    layer_backward_scale=None, host_forward_scale=None,
                                    host_backward_scale=None))
    profile = Profile(name="reference", description="the reference blocks' device",
                      device=plain, node=_one_device_node(plain.memory_bw_bytes_per_s,
                                                          "reference", False), network=None)
    return CostEngine(graph, compose_cluster([NodeGroup(profile, 1)]), calibration=None)


def _reference_scales(device: DeviceType, measured: tuple[float, ...], engine=None, *,
                      small_shape: tuple[int, int] = _REFERENCE_SMALL_SHAPE
                      ) -> tuple[float, float, tuple[float, float],
                                 tuple[float, float] | None]:
    """``(forward scale, backward scale, (priced forward, priced backward), host scales)``
    from the reference stack's measured seconds (:func:`_measure_reference_layers`:
    forward and backward at ``_REFERENCE_SHAPE``, then optionally at ``small_shape``,
    ``(micro-batch, sequence)``: :data:`_REFERENCE_SMALL_SHAPE`, or what a stored profile
    states it timed) and the cost model's price for it on ``device`` (one device, fp32,
    without the scales; ``engine``: its :func:`_reference_engine`, made here if not given).

    With one shape: its measured seconds over its price, as
    ``OpOverhead.layer_forward_scale`` / ``layer_backward_scale`` (they then scale the host
    work too), and no host scales.  With two, per direction, each shape's price splits into
    host work ``H`` (:meth:`~autoplan.cost.engine.CostEngine.model_host_s`) and the rest
    ``A``, and ``measured = s A + h H`` at both gives the layer scale ``s`` and the host
    scale ``h`` (``OpOverhead.host_forward_scale``); where either comes out <= 0 (the two
    shapes measured too close for the split, or no host work priced) or the small shape's
    timing is not positive, the larger shape's ratio scales both, as with one, and host
    scales are ``None``.

    Raises
    ------
    ProfilingFailed
        When either price or measurement is not a positive time."""
    engine = engine or _reference_engine(device)
    priced = engine.model_compute_s(_REFERENCE_SHAPE[0])
    if not (all(p > 0 for p in priced) and len(measured) in (2, 4)
            and measured[0] > 0 and measured[1] > 0):
        raise ProfilingFailed(f"the reference blocks priced {priced[0]!r} + {priced[1]!r} s and "
                              f"measured {', '.join(map(repr, measured))} s: no layer scale "
                              "from them")
    whole = (measured[0] / priced[0], measured[1] / priced[1])
    if len(measured) == 2 or not (measured[2] > 0 and measured[3] > 0):
        return whole[0], whole[1], priced, None
    small_engine = (engine if small_shape[1] == _REFERENCE_SHAPE[1]
                    else _reference_engine(device, small_shape))
    small = small_engine.model_compute_s(small_shape[0])
    host, small_host = engine.model_host_s(), small_engine.model_host_s()
    split = []
    for i in (0, 1):
        # measured[i] = s (priced - host) + h host, and the same at the small shape
        a, h, a_small, h_small = (priced[i] - host[i], host[i],
                                  small[i] - small_host[i], small_host[i])
        det = a * h_small - a_small * h
        split.append(((measured[i] * h_small - measured[2 + i] * h) / det,
                      (a * measured[2 + i] - a_small * measured[i]) / det)
                     if det > 0 else (0.0, 0.0))
    if not all(a > 0 and h > 0 for a, h in split):
        return whole[0], whole[1], priced, None
    return split[0][0], split[1][0], priced, (split[0][1], split[1][1])


def _reference_selective_byte_s(device: DeviceType, extra_s: float, engine=None
                                ) -> tuple[float, float, float]:
    """``(OpOverhead.selective_byte_s, per-operator seconds, activation bytes)``: the
    reference stack's measured extra under a selective checkpoint that recomputes nothing
    (:func:`_measure_reference_layers`) less its blocks' dispatched operators at the
    profile's ``selective_dispatch_s``, over the bytes its blocks save for the backward
    without recompute (:func:`autoplan.cost.memory.activation_bytes`), never below 0."""
    from ..strategy import Precision, Recompute

    engine = engine or _reference_engine(device)
    b = _REFERENCE_SHAPE[0]
    per_op = device.op_overhead.selective_dispatch_s if device.op_overhead else 0.0
    blocks = [layer for layer in engine.summary.layers if layer.is_block]
    ops_s = sum(layer.dispatched_ops for layer in blocks) * per_op
    scale = engine.precision_costs(Precision.FP32).activation_scale   # fp32 as it ran
    nbytes = sum(engine.activation_bytes(layer, 1, False, Recompute.NONE, 1)
                 for layer in blocks) * b * scale
    if nbytes <= 0:
        raise ProfilingFailed("the reference blocks save no activations as captured: "
                              "no selective recompute figure per byte from them")
    return max(0.0, extra_s - ops_s) / nbytes, ops_s, nbytes


def _p2p_partner(rank: int, world: int, *, every_pair: bool) -> int | None:
    """The rank that ``rank`` exchanges with in the profile's p2p timing: ranks 0 and 1 alone,
    or with ``every_pair`` every pair (0-1, 2-3, ...) at once; ``None``: it sits out (an odd
    world's last rank, or every rank past 1)."""
    partner = rank ^ 1 if every_pair else (1 - rank if rank < 2 else None)
    return partner if partner is not None and partner < world else None


def _measure_op_overhead(torch, timed: Callable[[Callable[[], Any]], float],
                         device: Any = None) -> dict[str, float]:
    """Host time of tiny transformer blocks (:func:`_overhead_model`, arithmetic
    negligible), as :class:`~autoplan.hardware.OpOverhead` fields (``timed(fn)`` is
    seconds per call):

    * over :data:`_OVERHEAD_BLOCKS` blocks, the forward (with autograd recording) per
      operator it dispatches (``forward_dispatch_s``) and the backward (forward + backward
      less the forward) per autograd node it runs (``backward_node_s``), counted as the
      capture counts a layer's (:func:`~autoplan.opstream.autograd_nodes`); the same per
      captured operator (``forward_s``, ``backward_s``) for graphs without the counts;
    * over one block, the extra of forward + backward with the block wrapped as
      :func:`autoplan.parallelize` wraps a block under selective recompute (its softmax as
      the attention core), per operator its forward dispatches (``selective_dispatch_s``):
      torch's selective checkpoint pays its Python mode per operator that reaches it;
    * over the blocks, the extra of forward + backward with the backward split as torch's
      zero-bubble schedules split it (``stage_backward_input``, then
      ``stage_backward_weight``: the input gradients first, the weight gradients in a
      pass of their own, after a Python walk of the autograd graph that groups the
      weights), per autograd node (``zero_bubble_node_s``; 0 on CUDA and where torch has
      no such functions).  On one process here it read 10-11 us per node, about a
      backward node's own host time again.

    On a CUDA ``device`` the tiny blocks' kernels take less than their launch, so the
    time is the host's: what it takes to dispatch and launch each operator."""
    from ..graph import AttentionCore, CoreOp
    from ..opstream import DispatchCount, autograd_nodes
    from ..runtime.ac import apply_ac
    from ..strategy import Recompute

    h = _OVERHEAD_WIDTH
    stack = _overhead_model(torch, h, _OVERHEAD_BLOCKS).to(device)
    x = torch.randn(1, 4, h, device=device).requires_grad_(True)
    with DispatchCount() as dispatched:
        loss = stack(x).sum()
    nodes = autograd_nodes([loss], lambda t: isinstance(t, torch.nn.Parameter))
    fwd = timed(lambda: stack(x).sum())
    both = timed(lambda: stack(x).sum().backward())
    bwd = max(0.0, both - fwd)
    captured = OVERHEAD_BLOCK_OPS * _OVERHEAD_BLOCKS

    block = stack[0]
    core = AttentionCore(nodes=("softmax",), ops=(CoreOp("_softmax", 0),), calls={"_softmax": 1})
    selective = apply_ac(_overhead_model(torch, h, 1)[0].to(device), Recompute.SELECTIVE,
                         core=core)
    plain = timed(lambda: block(x).sum().backward())
    sac = timed(lambda: selective(x).sum().backward())
    cuda = device is not None and torch.device(device).type == "cuda"
    with DispatchCount() as one:
        block(x)
    return {"forward_s": fwd / captured, "backward_s": bwd / captured,
            "forward_dispatch_s": fwd / dispatched.total, "backward_node_s": bwd / nodes,
            "selective_dispatch_s": max(0.0, sac - plain) / one.total,
            # a CPU figure: the cost model prices it where the host is the device
            "zero_bubble_node_s": (0.0 if cuda else
                                   _split_backward_extra(torch, stack, x, timed) / nodes)}


def _split_backward_extra(torch, stack: Any, x: Any,
                          timed: Callable[[Callable[[], Any]], float]) -> float:
    """Seconds a forward + backward of ``stack`` takes more with its backward split as
    torch's zero-bubble schedules split it (input gradients, then weight gradients) than
    whole; 0 where torch has no such functions."""
    try:
        from torch.distributed.pipelining._backward import (stage_backward_input,
                                                            stage_backward_weight)
    except ImportError:
        return 0.0
    grad = torch.ones_like(stack(x))

    def whole() -> None:
        xi = x.detach().requires_grad_(True)
        stack(xi).backward(grad)

    def split() -> None:
        xi = x.detach().requires_grad_(True)
        _, groups = stage_backward_input([stack(xi)], [grad], [xi], stack.parameters())
        stage_backward_weight(stack.parameters(), groups)

    return max(0.0, timed(split) - timed(whole))


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


def _measure_tp_overhead(torch, dist, timed: Callable[[Callable[[], Any]], float], own: Any,
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
      the cores where they share them (:func:`_core_seconds`): the host work a rank's
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
    h = _OVERHEAD_WIDTH
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


def _measure_tp_shared_overhead(torch, dist, timed: Callable[[Callable[[], Any]], float],
                                pair: Any, rounds: int = 1) -> tuple[float, float]:
    """Extra seconds of a column linear that shares its region's input with the one before
    it, ``(forward, backward)``: q, k and v of an attention, gate and up of a gated MLP.
    :mod:`autoplan.runtime.tp` takes a region's input once, as one DTensor, where its
    module opens (``PrepareModuleInput``); its column linears run their DTensor matmuls on
    it and their input gradients add up as partial sums, reduced by one all-reduce where
    the input leaves the region.  So a second column linear adds its DTensor matmul's
    sharding propagation and wrapping, not the region's wrapping and collective that
    :func:`_measure_tp_overhead`'s per-linear figure carries.

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
    h = _OVERHEAD_WIDTH

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
_TP_BYTES_SHAPE = (512, 256)


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


def _measure_tp_byte_overhead(torch, dist, timed: Callable[[Callable[[], Any]], float],
                              pair: Any, rounds: int = 1) -> float:
    """Extra seconds per byte of a tensor-parallel collective's payload
    (``OpOverhead.tp_collective_byte_s``): :func:`_tp_mlp_extra` at
    :data:`_TP_BYTES_SHAPE` less at :data:`_OVERHEAD_WIDTH` on 4 tokens, over the
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
    small_tokens, small_h = 4, _OVERHEAD_WIDTH
    tokens, h = _TP_BYTES_SHAPE
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
_TP_PAIR_ROUNDS = 5
#: Calls per CPU-time reading of the tensor-parallel figure on pairs (:func:`_core_seconds`)
_TP_CPU_CALLS = 20

#: Parameter tensors the optimizer-step overhead is measured over (width ``_OVERHEAD_WIDTH``)
_OPTIMIZER_TENSORS = 32
#: ... and the per-element figure: tensors of this many fp32 elements (1 MiB, as the linears
#: of a small model), 64 MiB of parameters, gradients and moments in all: beyond the caches
_OPTIMIZER_LARGE = (16, 2**18)


def _measure_optimizer_overhead(torch, timed: Callable[[Callable[[], Any]], float],
                                group: Any = None) -> tuple[float, float, float]:
    """Seconds per parameter tensor of one ``torch.optim.AdamW`` step as
    :func:`autoplan.parallelize` builds it by default
    (:func:`~autoplan.runtime.optim.default_optimizer`: fused), ``(plain, DTensor)``: over
    :data:`_OPTIMIZER_TENSORS` tiny tensors (the bytes negligible, so the time is the
    operators' dispatch), plain and as DTensors sharded on the one-rank mesh of ``group``
    (as FSDP2 and tensor parallelism leave the parameters); without ``group`` the DTensor
    figure is 0 (one rank runs no DTensor parameters).  Third, seconds per parameter
    element: a step over :data:`_OPTIMIZER_LARGE` tensors less their per-tensor part,
    over their elements (``OpOverhead.optimizer_element_s``)."""
    from ..runtime.optim import default_optimizer

    def per_tensor(params: list) -> float:
        for p in params:
            p.grad = torch.ones_like(p)
        opt = default_optimizer(params)
        return timed(opt.step) / len(params)

    h, n = _OVERHEAD_WIDTH, _OPTIMIZER_TENSORS
    plain = per_tensor([torch.nn.Parameter(torch.randn(h)) for _ in range(n)])
    count, size = _OPTIMIZER_LARGE
    large = per_tensor([torch.nn.Parameter(torch.randn(size)) for _ in range(count)])
    element = max(0.0, large - plain) / size
    if group is None:
        return plain, 0.0, element
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = DeviceMesh.from_group(group, "cpu")
    sharded = per_tensor([torch.nn.Parameter(distribute_tensor(torch.randn(h), mesh, [Shard(0)]))
                          for _ in range(n)])
    return plain, sharded, element


# --------------------------------------------------------------------------- workers


def _say(message: str, start: float) -> None:
    print(f"{_PREFIX} {time.perf_counter() - start:6.1f}s  {message}", file=sys.stderr, flush=True)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def _time_local(fn: Callable[[], Any], sync: Callable[[], None], target_s: float,
                repeats: int) -> float:
    """Best seconds per call of ``fn`` over ``repeats`` timed batches (no collectives)."""
    for _ in range(_WARMUP_CALLS):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(_CALIBRATION_CALLS):
        fn()
    sync()
    first = max((time.perf_counter() - t0) / _CALIBRATION_CALLS, 1e-9)
    iters = max(1, min(10_000, int(target_s / repeats / first)))
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        elapsed = time.perf_counter() - t0
        best, spent = min(best, elapsed / iters), spent + elapsed
        if spent > _OVERRUN * target_s:  # a loaded machine: keep the total bounded
            break
    return best


#: Fused attention is timed on calls of this many tokens (batch x sequence), as a step's
#: micro-batch of a 1-3B model, at sequence lengths 512-8192 and these (heads, head dim):
#: width 2048 in heads of 128 (Llama 3 8B and up, GPT-3 1.3B; the profile's table) and of
#: 64 (Llama 3.2 1B; recorded in the measurements only: a table has one curve)
_ATTENTION_TOKENS = 16384
_ATTENTION_HEADS = ((16, 128), (32, 64))
#: The FLOPs the cost model prices a causal fused attention's forward and backward at, in
#: units of one ``QK^T`` product: the forward's two products, the backward's four and the
#: forward the kernel recomputes in it (2 + 4 + 2), halved by the causal mask
#: (autoplan.cost.engine: CAUSAL_BLOCK_FRACTION)
_ATTENTION_FLOPS_PER_QK = 4.0


def _qk_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """FLOPs of one ``QK^T`` product (``2 b h s^2 d``), the engine's key for attention."""
    return 2.0 * batch * heads * seq * seq * head_dim


def _attention_call(torch, batch: int, heads: int, seq: int, head_dim: int,
                    device) -> Callable[[], Any]:
    """One causal ``scaled_dot_product_attention`` forward and backward in bf16 (torch picks
    its fused kernel, as a model's SDPA call does)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                           generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                       generator=gen)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call() -> None:   # gradients returned, not accumulated into .grad
        torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad)

    return call


def _cold_matmul(torch, n: int, dtype, device, cold_bytes: int) -> Callable[[], Any]:
    """A call that multiplies two ``n x n`` matrices into a third, each call the next of
    as many distinct sets (views into three flat buffers) as span ``cold_bytes``, so no
    call finds its operands in cache (:data:`_COLD_BYTES`)."""
    per_set = 3 * n * n * torch.empty((), dtype=dtype).element_size()
    sets = max(2, -(-cold_bytes // per_set))
    a_all = torch.randn(sets * n * n, device=device).to(dtype)
    b_all = torch.randn(sets * n * n, device=device).to(dtype)
    # written once here: a step's outputs land in memory its allocator has used before,
    # while a fresh page faults on its first write (~0.5-1.7 ms per MiB on this kind of VM);
    # a quick profile's few calls of a size would otherwise all pay it
    out_all = torch.zeros(sets * n * n, device=device, dtype=dtype)
    views = [(a_all[i * n * n:(i + 1) * n * n].view(n, n),
              b_all[i * n * n:(i + 1) * n * n].view(n, n),
              out_all[i * n * n:(i + 1) * n * n].view(n, n)) for i in range(sets)]
    state = [0]

    def call() -> None:
        a, b, out = views[state[0]]
        state[0] = (state[0] + 1) % sets
        torch.matmul(a, b, out=out)

    call.sets = views  # type: ignore[attr-defined]
    return call


#: Memory-bound operators of a kind (:data:`~autoplan.hardware.profile_records.RATE_KINDS`)
#: are timed on fp32 tensors of this many tokens x width, each call on the next of as many
#: as span ``_COLD_BYTES / 2`` (with their output gradients), so none is in cache, as a
#: step's activations are not: on a CPU 2 MiB, an activation of a small model's
#: micro-batch; on a GPU 64 MiB, one of a 1-3B model's (a GPU streams 2 MiB in about its
#: launch time).
_ELEMENTWISE_SHAPE = (1024, 512)
_ELEMENTWISE_SHAPE_CUDA = (8192, 2048)
#: The layout kinds' head size: a transposed view is (heads, tokens, head) of a
#: (tokens, heads x head) activation, as attention's queries are
_ELEMENTWISE_HEAD = 64


def _elementwise_calls(torch, kind: str, device, cold_bytes: int,
                       shape: tuple[int, int] = _ELEMENTWISE_SHAPE
                       ) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    """``(forward, forward + backward, counted bytes)`` of one call of ``kind``'s operator
    as a model calls it (GELU exact, softmax and layer norm over the last dimension,
    masked_fill of a boolean mask); the bytes are the cost model's count for it, its output
    plus its input (:func:`autoplan.cost.summary._elementwise`).

    The layout kinds (:func:`autoplan.cost.summary.rate_kind`): ``broadcast`` is one call
    of each of the broadcasts of a Llama block, a row's scale ``x * r`` (``r`` of one
    column), a norm's weight ``x * w`` and rotary embeddings' ``q * cos`` of a transposed
    query by a (tokens, head) table, counted at their outputs and inputs as the cost model
    counts them (the weight, a parameter, not); ``layout_copy`` is a transposed query made
    contiguous."""
    F = torch.nn.functional
    tokens, width = shape
    nbytes = tokens * width * 4
    sets = max(2, -(-cold_bytes // (4 * nbytes)))
    gen = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(tokens, width, generator=gen, device=device).requires_grad_()
          for _ in range(sets)]
    grads = [torch.randn(tokens, width, generator=gen, device=device) for _ in range(sets)]
    head = _ELEMENTWISE_HEAD
    heads = width // head

    def transposed(t):    # (heads, tokens, head), a view
        return t.view(tokens, heads, head).transpose(0, 1)

    if kind == "broadcast":
        rows = [torch.rand(tokens, 1, generator=gen, device=device).requires_grad_()
                for _ in range(sets)]
        weight = torch.ones(width, device=device, requires_grad=True)
        cos = torch.rand(tokens, head, generator=gen, device=device)
        small = rows[0].numel() * 4 + cos.numel() * 4

        def op(x, i):
            return (x * rows[i], x * weight, transposed(x) * cos)

        def wrt(i):
            return (xs[i], rows[i], weight)

        def outs_grads(i):
            return (grads[i], grads[i], transposed(grads[i]))
        counted = 3 * 2 * nbytes + small
    else:
        masks = [x.detach() > 1.0 for x in xs] if kind == "masked_fill" else []
        weight = torch.ones(width, device=device, requires_grad=True)
        bias = torch.zeros(width, device=device, requires_grad=True)
        ops: dict[str, Callable[[Any, int], Any]] = {
            "gelu": lambda x, i: F.gelu(x),
            "silu": lambda x, i: F.silu(x),
            "softmax": lambda x, i: torch.softmax(x, dim=-1),
            "layer_norm": lambda x, i: F.layer_norm(x, (width,), weight, bias),
            "masked_fill": lambda x, i: x.masked_fill(masks[i], 0.0),
            "layout_copy": lambda x, i: transposed(x).contiguous(),
        }
        one = ops[kind]

        def op(x, i):
            return (one(x, i),)

        def wrt(i):
            return (xs[i],)

        if kind == "layout_copy":   # the copy's output gradient: contiguous, transposed
            grads = [transposed(g).contiguous() for g in grads]

        def outs_grads(i):
            return (grads[i],)
        counted = 2 * nbytes
    state = [0]

    def turn() -> int:
        i = state[0]
        state[0] = (i + 1) % sets
        return i

    def forward() -> None:
        i = turn()
        with torch.no_grad():
            op(xs[i], i)

    def both() -> None:   # the inputs' gradients returned, not accumulated
        i = turn()
        torch.autograd.grad(op(xs[i], i), wrt(i), outs_grads(i))

    return forward, both, counted


def _measure_elementwise(torch, timed: Callable[[Callable[[], Any]], float], device,
                         cold_bytes: int, kinds: Sequence[str] = tuple(ELEMENTWISE_KINDS),
                         shape: tuple[int, int] = _ELEMENTWISE_SHAPE
                         ) -> dict[str, list[float]]:
    """``{kind: [forward seconds, backward seconds, counted bytes]}`` per call of each
    of ``kinds`` (:func:`_elementwise_calls`; the backward is forward + backward less the
    forward).

    On a CPU such operators are arithmetic per byte, not a copy: on 4 ranks sharing 2 cores
    (three quick profiles, 2026-11-27) erf-GELU ran at 0.6-0.7 of the speed the copy
    bandwidth priced it at (the backward at twice the forward's bytes), masked_fill at a
    quarter forward and 0.4 backward, layer norm at 1.2-1.7, softmax's backward at 1.4-1.8;
    the profile times the operator kinds there (torch's CPU loops vectorize broadcasts and
    layout copies).  On a GPU every kind, the layout kinds too
    (:data:`~autoplan.hardware.profile_records.LAYOUT_KINDS`).
    A backward that reads below 5% of its forward (timing noise on a fast one) is kept at
    that."""
    out: dict[str, list[float]] = {}
    for kind in kinds:
        forward, both, nbytes = _elementwise_calls(torch, kind, device, cold_bytes, shape)
        fwd = timed(forward)
        total = timed(both)
        out[kind] = [fwd, max(total - fwd, fwd * 0.05), float(nbytes)]
    return out


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


def _tp_in_pairs(world: int) -> bool:
    """Whether the CPU ranks' tensor-parallel figure is measured on pairs of ranks (every
    pair at once) rather than on each rank's one-rank mesh: wherever the ranks pair up
    (see :func:`_measure_tp_overhead`)."""
    return world > 1 and world % 2 == 0


def _shares_cores(cuda: bool, world: int, threads: int) -> bool:
    """Whether the CPU ranks outnumber the cores (threads included) and take turns on them.

    There a timed batch's length depends on how the scheduler happened to share the
    cores, and a training step pays the usual share, not the luckiest: a collective's
    figure is then the mean over the timed batches (with :data:`_MIN_SHARED_CALLS` calls
    or more each), not the best batch, and a rank's own work is timed in free-running
    windows with every rank busy (:func:`_free_running`).  Checked by
    ``benchmarks/local_truth.py --plain`` (the confirm models' single-process step on 4
    processes of 2 cores at once).
    """
    return not cuda and world * threads > _usable_cores()


def _free_running(fn: Callable[[], Any], sync: Callable[[], None], target_s: float,
                  agreed_mean: Callable[[float], float], barrier: Callable[[], None],
                  windows: int = 1) -> float:
    """Seconds per call of a rank's own work (no collective inside ``fn``) where ranks
    share cores: after a common start, each rank calls ``fn`` for a window of its own wall
    time, every rank busy as in a training step; the mean over the ranks, and of
    ``windows`` such windows (``target_s`` over them, :data:`_MIN_FREE_WINDOW_S` each at
    least) the fastest.

    Batches timed from the first rank's start to the last rank's end (the collectives'
    way) add to every batch the skew with which ranks that take turns on the cores leave
    the barrier, up to a scheduler slice each (a few ms): on 4 ranks of 2 cores the quick
    profile's 20 ms batches read 256^3 fp32 matmuls at 31-36 GFLOP/s where every rank,
    free-running for a second, made 39-44, and the confirm models' steps ran their
    matmuls at 40-45 (benchmarks/local_truth.py --plain priced the step 8-22% slow).
    A window pays that skew once at each end: ``slice / window``.  Every window shares the
    cores as a step does; the fastest is kept because what else runs on the machine (other
    tenants of a VM's host) only ever adds time, as the measured steps it is compared
    with are their fastest."""
    windows = max(1, windows)
    window = max(target_s / windows, _MIN_FREE_WINDOW_S)
    for _ in range(_WARMUP_CALLS):
        fn()
    sync()
    best = math.inf
    for _ in range(windows):
        barrier()
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= window:
                break
        best = min(best, agreed_mean(elapsed / calls))   # the same on every rank
    return best


#: The arrival cost (:func:`_measure_arrival`): calls of the ``_WORK_SHAPE`` matmul between
#: two collectives (about 10 ms on a CPU rank that shares its core, a transformer layer's
#: compute in the confirm models), calls per timed loop, and rounds of the three loops per
#: group.  One round's extra reads 0-3.6 ms on 4 ranks of 2 cores; the mean of 24 (12
#: rounds, world and pairs) read 0.97-1.42 ms in four launches, their median 0.70-1.37
#: (2026-11-26): the mean is kept, over 10 rounds (~10 s)
_ARRIVAL_WORK_CALLS = 3
_ARRIVAL_LOOP = 12
_ARRIVAL_ROUNDS = 10


def _measure_arrival(work: Callable[[], Any], collectives: Sequence[Callable[[], Any]],
                     barrier: Callable[[], None], agreed_mean: Callable[[float], float],
                     rounds: int = _ARRIVAL_ROUNDS, loop: int = _ARRIVAL_LOOP) -> float:
    """Seconds a small collective costs more after compute than back to back where ranks
    share cores: the mean over ``rounds`` rounds and each group's ``collectives`` (a tiny
    all-reduce over a group, every rank in one) of ``compute then collective`` less the
    compute alone less the collective back to back, each the ranks' mean of ``loop`` calls
    timed on each rank's own clock (the compute free-running, as a rank's own work is).

    Where ranks share cores they reach a collective a scheduler slice apart: the last one
    waits for a core while the first ones wait in the collective, and the call costs more
    than back to back (where the ranks are all in the collective's loop).  On 4 ranks of 2
    cores, a 16 B all-reduce after ~10 ms of matmuls cost 0.2-2.8 ms more per call than
    back to back (world and pairs alike; 2026-11-26), where the profile's collectives,
    timed back to back there, had not priced it.  The mean, not the median: a step pays
    every call's wait, the rare long ones included.  Clamped at 0."""
    for fn in (work, *collectives):
        fn()
    extras = []
    for _ in range(max(1, rounds)):
        for collective in collectives:
            times = []
            for fn in (work, collective, lambda: (work(), collective())):
                barrier()
                t0 = time.perf_counter()
                for _ in range(loop):
                    fn()
                times.append(agreed_mean((time.perf_counter() - t0) / loop))
            alone, back_to_back, after = times
            extras.append(after - alone - back_to_back)
    return max(0.0, statistics.fmean(extras))


def _wall_per_call(fn: Callable[[], Any], calls: int, barrier: Callable[[], None],
                   agreed_mean: Callable[[float], float]) -> float:
    """Seconds per call of ``fn`` after a warm-up call and a common start (``barrier``),
    each rank's clock over ``calls`` calls, the ranks' mean.  Every rank makes the same
    number of calls, so ``fn`` may run collectives (a window of each rank's own length,
    :func:`_free_running`, may not)."""
    fn()
    barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return agreed_mean((time.perf_counter() - t0) / calls)


#: The pipeline's host work (:func:`_measure_pipeline_overhead`): micro-batches per step
#: of the two-stage 1F1B pipeline, steps per timed round, rounds (the median is kept).
_PIPELINE_MICRO_BATCHES = 8
_PIPELINE_STEPS = 20
_PIPELINE_ROUNDS = 3


def _measure_pipeline_overhead(torch, dist, pair: Any, agreed_mean: Callable[[float], float],
                               share: float, rounds: int = _PIPELINE_ROUNDS) -> tuple[float, float]:
    """Core seconds a pipeline stage action costs beyond its module's own work,
    ``(action, message)``, each times ``share`` (the ranks over the cores they share, 1
    where each rank has its own): a two-stage ``Schedule1F1B`` of
    ``_PIPELINE_MICRO_BATCHES`` micro-batches over ``pair`` (every pair at once), each
    stage one tiny linear (width ``_OVERHEAD_WIDTH``), against the same module's forward
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
    h, m = _OVERHEAD_WIDTH, _PIPELINE_MICRO_BATCHES
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
_FSDP_WIDTHS = (256, 512)
_FSDP_LINEARS = 4
_FSDP_TOKENS = 64
_FSDP_CALLS = 12
_FSDP_ROUNDS = 5


def _measure_fsdp_overhead(torch, dist, pair: Any, agreed_mean: Callable[[float], float],
                           rounds: int = _FSDP_ROUNDS
                           ) -> tuple[float, float, float, float, float, float]:
    """FSDP2's seconds beyond its collectives, ``(gather per call, gather per byte, reduce
    per call, reduce per byte, replicate per call, replicate per byte)``
    (``OpOverhead.fsdp_*``, ``OpOverhead.replicate_*``): two units of
    :data:`_FSDP_LINEARS` linears each at each of :data:`_FSDP_WIDTHS`, on ``pair`` (every
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

    from ..runtime.fsdp import apply_fsdp, apply_replicate, set_micro_batch_sync

    mesh = DeviceMesh.from_group(pair, "cpu")
    world = dist.get_world_size(pair)

    def wall(fn: Callable[[], Any]) -> float:
        return _wall_per_call(fn, _FSDP_CALLS, dist.barrier, agreed_mean)

    def extras(width: int) -> tuple[float, float, float, float]:
        """(unit bytes, gather extra per call, reduce extra per call, replicate extra per
        call of both units) at ``width``."""
        def units() -> tuple[Any, list[Any]]:
            torch.manual_seed(0)
            blocks = [torch.nn.Sequential(*(torch.nn.Linear(width, width)
                                            for _ in range(_FSDP_LINEARS))) for _ in range(2)]
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
        n = _FSDP_LINEARS * (width * width + width)      # a unit's parameters
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
        (b0, g0, r0, a0), (b1, g1, r1, a1) = (extras(w) for w in _FSDP_WIDTHS)
        readings.append(_line(b0, g0, b1, g1) + _line(b0, r0, b1, r1)
                        + _line(2 * b0, a0, 2 * b1, a1))
    return tuple(statistics.median(r[i] for r in readings)  # type: ignore[return-value]
                 for i in range(6))


#: Context parallelism's collectives in a step (:func:`_measure_cp_overhead`): tokens per
#: sequence, heads and head width of the attention (the confirm models' GPT), the
#: sequences a call takes (512 KiB and 1 MiB of fp32 keys and values gathered), linears of
#: the attention's width run before it (a block's other work), calls per timed window and
#: rounds (the median is kept)
_CP_SHAPE = (128, 4, 64)
_CP_BATCHES = (2, 4)
_CP_LINEARS = 6
_CP_CALLS = 10
_CP_ROUNDS = 5


def _cp_bytes(batch: int) -> int:
    """Bytes of fp32 keys and values a pair gathers for ``batch`` sequences of
    :data:`_CP_SHAPE` (whole sequences, both ranks' tokens)."""
    seq, heads, head = _CP_SHAPE
    return 2 * 4 * batch * seq * heads * head


def _measure_cp_overhead(torch, dist, pair: Any, agreed_mean: Callable[[float], float],
                         rounds: int = _CP_ROUNDS) -> tuple[float, float, float, float]:
    """Context parallelism's collectives in a step beyond their back-to-back time,
    ``(all-gather per call, per byte, reduce-scatter per call, per byte)``
    (``OpOverhead.cp_*``), per byte of the keys and values gathered (whole sequences).

    On ``pair`` (every pair at once, every rank busy), each rank's clock over
    :data:`_CP_CALLS` calls (the same count on both ranks of a pair: each call runs their
    collectives), the ranks' mean: :data:`_CP_LINEARS` linears, then an attention core
    over the keys and values that :func:`autoplan.runtime.cp.gather_sequence` gathers
    (local queries, causal mask of the global positions), as :mod:`autoplan.runtime.cp`
    runs a block; the forward, and forward + backward.  Less the same with a local
    stand-in for the collective (the same buffers and copies), less the raw
    ``all_gather_single`` (forward) and ``reduce_scatter_single`` (the backward's
    extra) of the same bytes timed back to back; per call and per byte from the two
    payloads of :data:`_CP_BATCHES` (a line through the medians of ``rounds`` at each,
    at least 0).

    Where ranks share cores a collective between compute costs more than back to back:
    each transfer waits for its peer to be scheduled while the other ranks compute.
    On 4 CPU ranks of 2 cores the pairs' all-gather and reduce-scatter together read
    8.3-10.0 ms in a step at 512 KiB and 11.3-11.4 ms at 1 MiB, against 4.1 and 5.1 ms
    back to back (2026-11-28), where the stored confirm passes had priced the layouts
    with context parallelism in pairs 4-12% fast on average."""
    from ..runtime import cp as cpm

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

    def wall(fn: Callable[[], Any], calls: int = _CP_CALLS) -> float:
        return _wall_per_call(fn, calls, dist.barrier, agreed_mean)

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
                          4 * _CP_CALLS)
        raw_scatter = wall(lambda: dist.reduce_scatter_single(shard, whole, group=pair),
                           4 * _CP_CALLS)
        gather = t[True, False] - t[False, False]
        scatter = t[True, True] - t[False, True] - gather
        return float(_cp_bytes(batch)), gather - raw_gather, scatter - raw_scatter

    readings = [[extras(n) for n in _CP_BATCHES] for _ in range(max(1, rounds))]
    (b0, g0, s0), (b1, g1, s1) = (
        tuple(statistics.median(r[i][j] for r in readings) for j in range(3))
        for i in range(len(_CP_BATCHES)))
    return _line(b0, g0, b1, g1) + _line(b0, s0, b1, s1)


def _line(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    """``(intercept, slope)`` of the line through two points, each at least 0 (a negative
    intercept: the line through the origin and the larger point)."""
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    intercept = y0 - slope * x0
    if intercept < 0:
        return 0.0, max(0.0, y1 / x1)
    return intercept, slope


def _core_seconds(dist, agreed_mean: Callable[[float], float], share: float,
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


def _calls_per_batch(target_s: float, repeats: int, first_s: float, shares_cores: bool) -> int:
    """Calls per timed batch: ``repeats`` batches fill ``target_s`` at ``first_s`` a call."""
    calls = min(10_000, int(target_s / repeats / max(first_s, 1e-9)))
    return max(_MIN_SHARED_CALLS if shares_cores else 1, calls)


def _usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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
        from ..runtime.cpu_heap import keep_cpu_heap
        keep_cpu_heap()   # the heap as autoplan.parallelize runs its CPU ranks
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731 - gloo and CPU ops are synchronous
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            **({"device_id": device} if cuda else {}))
    say = (lambda m: _say(m, start)) if rank == 0 else (lambda m: None)
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

    shares_cores = _shares_cores(cuda, world, threads)

    def timed(fn: Callable[[], Any], target_s: float = plan.comm_target_s,
              mean: bool = False, local: bool = False) -> float:
        # the best batch for compute on a device of its own (other work only ever adds
        # time); the mean of every call for a collective (``mean``): its waits are part of
        # what a step pays; and the mean of everything where ranks share cores -- there
        # a rank's own work (``local``: no collective inside ``fn``) in free-running
        # windows, the fastest (:func:`_free_running`)
        if local and shares_cores:
            return _free_running(fn, sync, target_s, agreed_mean, dist.barrier,
                                 windows=plan.repeats)
        mean = mean or shares_cores
        for _ in range(_WARMUP_CALLS):
            fn()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(_CALIBRATION_CALLS):
            fn()
        sync()
        first = agreed_max((time.perf_counter() - t0) / _CALIBRATION_CALLS)
        iters = _calls_per_batch(target_s, plan.repeats, first, shares_cores)
        best, spent, calls = math.inf, 0.0, 0
        for _ in range(plan.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            elapsed = agreed_span(t0, time.perf_counter())  # the same on every rank
            best, spent, calls = min(best, elapsed / iters), spent + elapsed, calls + iters
            if spent > _OVERRUN * target_s:  # every rank decides alike
                break
        return spent / calls if mean else best


    # compute: every rank at once, each on its own device / thread share
    # (on CPU timed together: ranks that share cores are measured all busy, as in training;
    # timed alone, a rank that finishes first idles and lends its core to the others)
    dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
              "fp16": torch.float16}
    cold_bytes = _COLD_BYTES
    if cuda:
        cold_bytes = max(cold_bytes, 2 * int(getattr(torch.cuda.get_device_properties(device),
                                                     "L2_cache_size", 0)))
    matmul: dict[str, list[tuple[int, float]]] = {}
    for name, sizes in plan.matmul_sizes.items():
        if cuda:  # fp32 matmuls run on TF32 tensor cores only when allowed
            torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
        matmul[name] = []
        for n in sizes:
            call = _cold_matmul(torch, n, dtypes[name], device, cold_bytes)
            dist.barrier()
            sec = (_time_local(call, sync, plan.matmul_target_s, plan.repeats) if cuda
                   else timed(call, plan.matmul_target_s, local=True))
            del call
            matmul[name].append((n, sec))
            say(f"matmul {name} {n}^3: {2 * n**3 / sec / 1e9:.1f} GFLOP/s")
    if cuda:
        torch.set_float32_matmul_precision("highest")
    # grouped GEMMs, as MoE experts run them (autoplan.hardware.grouped_gemm)
    grouped = _measure_grouped_gemms(torch, dist, device, dtypes, plan, cuda, sync, timed, say)
    # FP8 GEMMs (tensorwise and rowwise torch._scaled_mm) where the GPU has them
    # (profile_fp8); their sizes are the 16-bit matmuls'
    fp8_matmul = (measure_fp8_gemms(
        torch, device, plan.matmul_sizes.get("bf16", ()), cold_bytes,
        lambda call: _time_local(call, sync, plan.matmul_target_s, plan.repeats), say)
        if cuda and fp8_capable(torch, device) else {})

    elems = plan.copy_bytes // 4
    src = torch.ones(elems, device=device)
    dst = torch.empty_like(src)
    dist.barrier()
    copy_s = (_time_local(lambda: dst.copy_(src), sync, plan.copy_target_s, plan.repeats) if cuda
              else timed(lambda: dst.copy_(src), plan.copy_target_s, local=True))
    say(f"memory copy {_fmt_bytes(plan.copy_bytes)}: {2 * plan.copy_bytes / copy_s / 1e9:.2f} GB/s")
    del src, dst
    # memory-bound operators of a kind, at their own speed (CPU: arithmetic per byte; on a
    # GPU the vectorized ones stream at about the copy bandwidth, broadcasts and layout
    # copies take a slower path)
    dist.barrier()
    if cuda:
        elementwise = _measure_elementwise(
            torch, lambda fn: _time_local(fn, sync, plan.copy_target_s, plan.repeats), device,
            cold_bytes, RATE_KINDS, _ELEMENTWISE_SHAPE_CUDA)
    else:
        elementwise = _measure_elementwise(
            torch, lambda fn: timed(fn, plan.copy_target_s, local=True), device, cold_bytes)
    if elementwise:
        say("memory-bound operators: " + ", ".join(
            f"{k} {v[2] / v[0] / 1e9:.1f}/{v[2] / v[1] / 1e9:.1f} GB/s"
            for k, v in elementwise.items()) + " (forward/backward, per counted byte)")

    attention: list[tuple[int, int, int, int, float]] = []
    if cuda:   # torch's fused attention (SDPA), as models call it, forward and backward
        for batch, heads, seq, head_dim in plan.attention_shapes:
            call = _attention_call(torch, batch, heads, seq, head_dim, device)
            sec = _time_local(call, sync, plan.matmul_target_s, plan.repeats)
            del call
            attention.append((batch, heads, seq, head_dim, sec))
            say(f"attention b{batch} h{heads} s{seq} d{head_dim} forward+backward: "
                f"{sec * 1e3:.2f} ms ({_ATTENTION_FLOPS_PER_QK * _qk_flops(batch, heads, seq, head_dim) / sec / 1e12:.0f} TFLOP/s priced)")

    # operator overhead: on CPU the host is the device; on CUDA the host's dispatch runs
    # ahead of the device, and the cost model takes the larger of the two per layer
    overhead = None
    dist.barrier()
    if cuda:
        overhead = _measure_op_overhead(
            torch, lambda fn: _time_local(fn, sync, plan.overhead_target_s, plan.repeats),
            device=device)
    else:
        overhead = _measure_op_overhead(torch, lambda fn: timed(fn, plan.overhead_target_s,
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
        reference = _measure_reference_layers(
            torch, lambda fn: timed(fn, max(plan.overhead_target_s, _REFERENCE_TARGET_S),
                                    local=True))
        say(f"reference blocks {'x'.join(map(str, _REFERENCE_SHAPE))}: "
            f"{reference[0] * 1e3:.2f} ms forward, {reference[1] * 1e3:.2f} ms backward, "
            f"{reference[2] * 1e3:.2f} ms more under selective checkpoints; at "
            f"{'x'.join(map(str, _REFERENCE_SMALL_SHAPE))}: {reference[3] * 1e3:.2f} ms forward, "
            f"{reference[4] * 1e3:.2f} ms backward")

    # torch 2.13 renamed the tensor forms (the old names warn); older torch has only those
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    comm: dict[str, list[tuple[int, float]]] = {op: [] for op in COLLECTIVE_OPS}
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
        work_a = torch.randn(*_WORK_SHAPE[:2], device=device)
        work_b = torch.randn(*_WORK_SHAPE[1:], device=device)

        def work() -> None:
            torch.matmul(work_a, work_b)

    # one rank: no collective can run on this node (no other device to talk to)
    for size in plan.comm_sizes_bytes if world > 1 else ():
        count = max(world, (size // 4) // world * world)  # float32 elements, divisible by world
        nbytes = count * 4
        full = torch.ones(count, device=device)
        shard = torch.ones(count // world, device=device)
        other = torch.empty(count, device=device)

        partner = _p2p_partner(rank, world, every_pair=shares_cores)

        def p2p() -> None:
            if partner is None:
                return
            if rank < partner:
                dist.send(full, partner)
                dist.recv(full, partner)
            else:
                dist.recv(full, partner)
                dist.send(full, partner)

        ops: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: all_gather(other, shard),
            "reduce_scatter": lambda: reduce_scatter(shard, full),
            "all_to_all": lambda: dist.all_to_all_single(other, full),
            "broadcast": lambda: dist.broadcast(full, 0),
            "p2p": p2p,
        }
        if not cuda:
            work_s = timed(work, mean=True)  # the matmul alone, in the same conditions
        for op, fn in ops.items():
            if not (after_compute or (shares_cores and op == "p2p")):
                sec = timed(fn, mean=True)
            else:  # after compute, less the compute
                sec = max(_MIN_COLLECTIVE_S, timed(lambda: (work(), fn()), mean=True) - work_s)
            comm[op].append((nbytes, sec / 2 if op == "p2p" else sec))  # p2p: one way
        say("collectives " + _fmt_bytes(nbytes) + ": " + ", ".join(
            f"{op} {comm[op][-1][1] * 1e6:.0f} us" for op in ops))

    # where the CPU ranks pair up, this rank's pair (every pair at once), for the
    # tensor-parallel figure and, where ranks share cores, the arrival cost
    # (new_subgroups is collective: every rank)
    pair = (dist.new_subgroups(group_size=2)[0]
            if not cuda and _tp_in_pairs(world) else None)
    arrival = 0.0
    if shares_cores and world > 1:
        # a tiny all-reduce after compute, over every rank and over pairs of ranks (the
        # groups of a 4-rank layout's parallelism); the collectives above ran back to back
        tiny = torch.ones(4, device=device)
        groups: list[Any] = [None]
        if pair is not None and world > 2:
            groups.append(pair)
        dist.barrier()
        arrival = _measure_arrival(
            lambda: [work() for _ in range(_ARRIVAL_WORK_CALLS)],
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
        opt_plain, opt_dtensor, opt_element = _measure_optimizer_overhead(
            torch, lambda fn: timed(fn, plan.overhead_target_s, local=True), own)
        overhead.update(optimizer_param_s=opt_plain, optimizer_dtensor_param_s=opt_dtensor,
                        optimizer_element_s=opt_element)
        say(f"optimizer step overhead: {opt_plain * 1e6:.1f} us per parameter tensor, "
            f"{opt_dtensor * 1e6:.1f} us per DTensor parameter, "
            f"{opt_element * 1e9:.2f} ns per parameter element")
        # a rank's core time becomes seconds at this factor when every rank is busy
        share = max(1.0, world * threads / _usable_cores()) if shares_cores else 1.0
        overhead["tp_linear_forward_s"] = overhead["tp_linear_backward_s"] = 0.0
        if world > 1:
            # on pairs of ranks in main-thread CPU time (times the share where ranks share
            # cores); on one-rank meshes, timed, where the ranks do not pair up
            tp_timed = (partial(_core_seconds, dist, agreed_mean, share)
                        if pair is not None else
                        (lambda fn: timed(fn, plan.overhead_target_s)))
            tp_fwd, tp_bwd = _measure_tp_overhead(torch, dist, tp_timed, own, pair,
                                                  _TP_PAIR_ROUNDS if pair is not None else 1)
            overhead.update(tp_linear_forward_s=tp_fwd, tp_linear_backward_s=tp_bwd)
            say(f"tensor-parallel linear overhead: {tp_fwd * 1e6:.1f} us forward, "
                f"{tp_bwd * 1e6:.1f} us backward")
            if pair is not None:
                # and what grows with the activation (on one-rank groups DTensor skips the
                # collectives and their copies: not measured there, 0)
                per_byte = _measure_tp_byte_overhead(torch, dist, tp_timed, pair,
                                                     _TP_PAIR_ROUNDS)
                overhead["tp_collective_byte_s"] = per_byte
                say(f"tensor-parallel collective host work: {per_byte * 2**20 * 1e3:.2f} ms "
                    "per MiB of payload")
                shared_fwd, shared_bwd = _measure_tp_shared_overhead(
                    torch, dist, tp_timed, pair, _TP_PAIR_ROUNDS)
                overhead.update(tp_shared_linear_forward_s=shared_fwd,
                                tp_shared_linear_backward_s=shared_bwd)
                say(f"a column linear sharing its region's input: {shared_fwd * 1e6:.1f} us "
                    f"forward, {shared_bwd * 1e6:.1f} us backward")
        overhead["pipeline_action_s"] = overhead["pipeline_message_s"] = 0.0
        if world % 2 == 0:
            # a two-stage pipeline on pairs of ranks, every pair at once
            pp_pair = pair if pair is not None else dist.new_subgroups(group_size=2)[0]
            action, message = _measure_pipeline_overhead(torch, dist, pp_pair, agreed_mean,
                                                         share)
            overhead.update(pipeline_action_s=action, pipeline_message_s=message)
            say(f"pipeline host work: {action * 1e6:.0f} us per stage action, "
                f"{message * 1e6:.0f} us per message end")
        if pair is not None:
            # FSDP2 around its collectives, on pairs of ranks as the tensor-parallel figures
            g_call, g_byte, r_call, r_byte, a_call, a_byte = _measure_fsdp_overhead(
                torch, dist, pair, agreed_mean)
            overhead.update(fsdp_gather_call_s=g_call, fsdp_gather_byte_s=g_byte,
                            fsdp_reduce_call_s=r_call, fsdp_reduce_byte_s=r_byte,
                            replicate_call_s=a_call, replicate_byte_s=a_byte)
            say(f"FSDP2 beyond its collectives: all-gather {g_call * 1e3:.2f} ms per call + "
                f"{g_byte * 2**20 * 1e3:.2f} ms per MiB, reduce-scatter {r_call * 1e3:.2f} ms "
                f"+ {r_byte * 2**20 * 1e3:.2f} ms per MiB, replicate's all-reduce "
                f"{a_call * 1e3:.2f} ms + {a_byte * 2**20 * 1e3:.2f} ms per MiB")
            # context parallelism's collectives in a step, on the same pairs
            cg_call, cg_byte, cs_call, cs_byte = _measure_cp_overhead(torch, dist, pair,
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
        info = {"name": _cpu_name(), "memory_bytes": _physical_memory_bytes()}
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


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    try:  # platforms without sysconf
        import psutil  # type: ignore[import-not-found]
    except ImportError:
        raise RuntimeError("cannot read the physical memory size here; install psutil") from None
    return int(psutil.virtual_memory().total)


def measure_host(*, cuda: bool, quick: bool = False) -> HostSpec:
    """The host of this machine: its RAM, its cores, the bandwidth of a large copy in host
    memory with every core, and on CUDA one GPU's host link (a pinned host buffer copied to
    the device; ``None`` without one).

    The copy counts the bytes read and written, as the device's copy bandwidth does; the
    host link counts the bytes moved one way, one device alone (devices that share a
    PCIe switch's uplink get less each when they all read at once).
    """
    import torch

    nbytes = (64 if quick else 512) * 2**20
    repeats = 3 if quick else 5
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = min(_timed_once(lambda: dst.copy_(src)) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    copy_bw = 2.0 * nbytes / best
    pcie = None
    how = (f"measured by `autoplan profile` on {socket.gethostname()}: RAM from the OS, "
           f"{os.cpu_count()} logical cores, a {_fmt_bytes(nbytes)} tensor copy with every "
           f"core (bytes read + written, best of {repeats})")
    if cuda:
        host = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
        dev = torch.empty_like(host, device="cuda")

        def h2d() -> None:
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        h2d()
        pcie = nbytes / min(_timed_once(h2d) for _ in range(repeats))
        how += (f"; host link: a pinned {_fmt_bytes(nbytes)} buffer copied to GPU 0, one "
                f"device alone, best of {repeats}")
    return HostSpec(memory_bytes=_physical_memory_bytes(), memory_bw_bytes_per_s=copy_bw,
                    cores=max(1, os.cpu_count() or 1), source=how, pcie_bw_bytes_per_s=pcie)


def _timed_once(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProfilingFailed(RuntimeError):
    """A rank failed or timed out; the message carries its traceback."""


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


def _run_ranks(nproc: int, backend: str, cuda: bool, threads: int, plan: MeasurementPlan,
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


# --------------------------------------------------------------------------- building


def _median_raw(raws: list[Any]) -> Any:
    """The figure-by-figure median of several runs' raw measurements (``result.json``
    payloads of one machine and one plan): numbers by their median, dicts key by key,
    lists item by item; anything else (names, flags) as the first run has it.

    Raises
    ------
    ProfilingFailed
        When the runs' structures differ (a key or a list length), which one plan on one
        machine never gives."""
    first = raws[0]
    if isinstance(first, dict):
        if any(not isinstance(r, dict) or r.keys() != first.keys() for r in raws):
            raise ProfilingFailed("the profiling runs measured different things")
        return {k: _median_raw([r[k] for r in raws]) for k in first}
    if isinstance(first, list):
        if any(not isinstance(r, list) or len(r) != len(first) for r in raws):
            raise ProfilingFailed("the profiling runs measured different things")
        return [_median_raw(list(items)) for items in zip(*raws)]
    if (isinstance(first, (int, float)) and not isinstance(first, bool)
            and any(r != first for r in raws)):
        return statistics.median(raws)
    return first     # the same in every run (sizes, counts), or not a number


def _profile_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    return name or "local"


def _build_profile(name: str, raw: dict[str, Any], *, cuda: bool, nproc: int, threads: int,
                   devices_per_node: int, quick: bool, copy_bytes: int,
                   cores: int | None = None, runs: int = 1) -> tuple[Profile, dict[str, Any]]:
    host = socket.gethostname()
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    how = (f"measured by `autoplan profile{' --quick' if quick else ''}"
           f"{f' --repeat {runs}' if runs > 1 else ''}` on {host} at {when}, "
           f"{nproc} rank{'s' if nproc > 1 else ''} at once"
           + ("" if cuda else f", {threads} thread(s) per rank")
           + (f", each figure the median of {runs} runs" if runs > 1 else ""))
    ranks = raw["ranks"]

    # matmul: the slowest rank at each size; peak = best of those
    peaks: dict[str, float] = {}
    tables: dict[str, EfficiencyTable] = {}
    throughput: dict[str, list[tuple[float, float]]] = {}
    for dtype in ranks[0]["matmul"]:
        points = []
        for i, (n, _) in enumerate(ranks[0]["matmul"][dtype]):
            sec = max(r["matmul"][dtype][i][1] for r in ranks)
            points.append((2.0 * n**3, 2.0 * n**3 / sec))
        peak = max(p[1] for p in points)
        peaks[dtype] = peak
        throughput[dtype] = points
        tables[dtype] = EfficiencyTable(
            tuple((flops, min(1.0, achieved / peak)) for flops, achieved in points),
            source=(f"{how}: square matmuls timed cold (each call's operands from a rotation "
                    f"of sets spanning {_fmt_bytes(ranks[0].get('cold_bytes', _COLD_BYTES))}), "
                    f"throughput over the best measured ({dtype})"
                    + ("; the ranks share cores: each rank free-running, every rank busy, "
                       "the fastest of a few windows of the ranks' mean"
                       if raw.get("shares_cores") else "")))
    fp8_peak, fp8, fp8_points = fp8_tables(ranks, how)
    if fp8_peak is not None:          # FP8 GEMMs timed (CUDA, capability 8.9+)
        peaks["fp8"] = fp8_peak
        tables.update(fp8)
        throughput.update(fp8_points)
    copy_bytes_per_s = min(2.0 * copy_bytes / r["copy_s"] for r in ranks)
    memory = min(int(r["info"]["memory_bytes"]) for r in ranks)
    if not cuda:
        memory //= nproc  # the ranks share the RAM
    names = sorted({r["info"]["name"] for r in ranks})
    device_name = (" / ".join(names) if cuda
                   else f"CPU {names[0]} ({threads} thread{'s' if threads > 1 else ''} per rank)")
    # the architecture keys the fitted figures (autoplan.cost.calibration); the slowest
    # rank's capability stands for all (ranks of one profile are one device kind)
    architecture = (cuda_architecture(*min(tuple(r["info"].get("capability", (0, 0)))
                                           for r in ranks)) if cuda else "cpu")
    op_overhead = None
    # the slowest rank decides, as for the matmuls
    worst = ({k: max(r["overhead"][k] for r in ranks) for k in ranks[0]["overhead"]}
             if all(r.get("overhead") for r in ranks) else None)
    if cuda and worst is not None:
        op_overhead = OpOverhead(
            **worst,
            source=(f"{how}: the host's time, {_OVERHEAD_BLOCKS} tiny transformer blocks on the "
                    f"GPU (modules, width {_OVERHEAD_WIDTH}: each kernel takes less than its "
                    "launch), the forward per operator they dispatch and forward + backward "
                    "less the forward per autograd node; one block's extra of forward + "
                    "backward under torch's selective checkpoint, per operator its forward "
                    "dispatches; the optimizer, tensor-parallel and zero-bubble figures not "
                    "measured (0). "
                    "The host runs ahead of the GPU: the cost model takes the larger of the "
                    "two per layer"))
    elif worst is not None:
        tp_in_pairs = _tp_in_pairs(nproc)
        op_overhead = OpOverhead(
            **worst,
            source=(f"{how}: {_OVERHEAD_BLOCKS} tiny transformer blocks (modules, width "
                    f"{_OVERHEAD_WIDTH}, arithmetic negligible), the forward per operator they "
                    "dispatch and forward + backward less the forward per autograd node "
                    f"(and both per captured operator, {OVERHEAD_BLOCK_OPS} a block); one "
                    "block's extra of forward + backward under torch's selective checkpoint, "
                    "per operator its forward dispatches; "
                    + ("the blocks' extra of forward + backward with the backward split as "
                       "torch's zero-bubble schedules split it, per autograd node; "
                       if "zero_bubble_node_s" in worst else "")
                    + "tensor-parallel linears: a ColwiseParallel + "
                    "RowwiseParallel MLP less the same MLP unsharded, per linear: "
                    + ("on two-rank groups, every pair at once, in the main thread's CPU "
                       "time, less one all-reduce of the same bytes each way, the median of "
                       f"{_TP_PAIR_ROUNDS} rounds"
                       + ("; per byte of a collective's payload: the MLP at width "
                          f"{_TP_BYTES_SHAPE[1]} on {_TP_BYTES_SHAPE[0]} tokens less at the "
                          "tiny width, each less the MLP a rank computes and one all-reduce, "
                          "over the payloads' difference"
                          if "tp_collective_byte_s" in worst else "")
                       + ("; a column linear sharing its region's input (q, k, v): a region "
                          "of two column linears and a row linear less a region of one, "
                          "each less the same modules unsharded"
                          if "tp_shared_linear_forward_s" in worst else "")
                       if tp_in_pairs else
                       "on a one-rank mesh, plus the functional all-reduce's own time once "
                       "each way")
                    + ("" if nproc > 1 else " (one rank: not measured, 0)")
                    + f"; optimizer: the fused AdamW step autoplan.parallelize builds, over "
                    f"{_OPTIMIZER_TENSORS} tiny parameters, plain and as DTensors on a one-rank "
                    f"mesh, per tensor; over {_OPTIMIZER_LARGE[0]} of {_OPTIMIZER_LARGE[1]} fp32 "
                    "elements less that, per element"
                    + ("" if nproc > 1 else " (DTensor on one rank: not measured, 0)")
                    + ("" if "pipeline_action_s" not in worst else
                       f"; pipeline: a two-stage 1F1B of {_PIPELINE_MICRO_BATCHES} "
                       "micro-batches of a tiny linear on pairs of ranks, every pair at once, "
                       "less the same module's forward and backward without it, per stage "
                       "action: the main thread's CPU time, and the other threads' (gloo's "
                       "transport) per message end, the ranks' mean, the median of "
                       f"{_PIPELINE_ROUNDS} rounds"
                       + (f", times the {nproc} ranks over the cores they share"
                          if raw.get("shares_cores") else "")
                       if nproc % 2 == 0
                       else "; pipeline: not measured ("
                       + ("one rank" if nproc == 1 else "an odd number of ranks") + "), 0")
                    + ("; FSDP2 beyond its collectives: two units of "
                       f"{_FSDP_LINEARS} linears at widths {_FSDP_WIDTHS[0]} and "
                       f"{_FSDP_WIDTHS[1]} on pairs of ranks, every pair at once, wall time: "
                       "ZeRO-2's forward + backward (a reduce-scatter each) less the units "
                       "without fully_shard, ZeRO-3's (two gathers more) less ZeRO-2's, "
                       "replicate's (one all-reduce of both units) less the units without "
                       "it, each less the raw collectives of the same bytes, per call and per "
                       "byte from the two widths, the median of "
                       f"{_FSDP_ROUNDS} rounds" if "fsdp_gather_call_s" in worst else "")
                    + ("; context-parallel collectives in a step: linears then an attention "
                       "core over keys and values gathered by the runtime's "
                       "gather_sequence on pairs of ranks, every pair at once, each rank's "
                       f"clock over {_CP_CALLS} calls, forward and forward + backward, less "
                       "the same with a local stand-in for the collective, less the raw "
                       "all-gather and reduce-scatter of the same bytes back to back, per "
                       "call and per byte gathered from "
                       + " and ".join(_fmt_bytes(_cp_bytes(b)) for b in _CP_BATCHES)
                       + f", the medians of {_CP_ROUNDS} rounds"
                       if "cp_gather_call_s" in worst else "")
                    + ("; the ranks share cores: all but the tensor-parallel figures timed "
                       "each rank free-running, every rank busy, the fastest of a few windows "
                       "of the ranks' mean" if raw.get("shares_cores") else "")))
    attention, attention_table = _attention_table(ranks, peaks, how)
    elementwise_rates = _elementwise_rates(ranks, how, bool(raw.get("shares_cores")), cuda)
    grouped_tables = _grouped_tables(ranks, peaks, how)
    device = DeviceType(
        name=device_name, architecture=architecture, peak_flops_per_s=peaks, memory_bytes=memory,
        memory_bw_bytes_per_s=copy_bytes_per_s, matmul_efficiency=tables, op_overhead=op_overhead,
        measured=True, attention_efficiency=attention_table, elementwise_rates=elementwise_rates,
        grouped_matmul_efficiency=grouped_tables or None,
        source=(f"{how}. Peaks are the best measured matmul throughput, not datasheet figures; "
                + ("memory is the smallest GPU's total memory; " if cuda else
                   f"memory is the physical RAM divided among the {nproc} ranks; ")
                + "bandwidth is tensor-copy bytes (read + write) per second per device"))
    reference = ([max(float(r["reference"][i]) for r in ranks)
                  for i in range(min(len(r["reference"]) for r in ranks))]
                 if op_overhead is not None and all(r.get("reference") for r in ranks) else None)
    if reference is not None and not (reference[0] > 0 and reference[1] > 0):
        # a timing that came out empty (a machine too busy to time the blocks apart):
        # the profile keeps its per-operator figures, without layer scales, and says so
        assert op_overhead is not None
        op_overhead = replace(op_overhead, source=op_overhead.source + (
            f"; no layer scales: the reference blocks' timing came out "
            f"{reference[0] * 1e3:.2f} ms forward, {reference[1] * 1e3:.2f} ms backward"))
        device = replace(device, op_overhead=op_overhead)
        reference = None
    if reference is not None:
        # the slowest rank's reference blocks against their price from the figures above
        assert op_overhead is not None
        engine = _reference_engine(device)
        scale_fwd, scale_bwd, priced, _ = _reference_scales(device, tuple(reference[:2]),
                                                            engine)
        # measurements taken before the second shape have three figures; its split is
        # stated, not applied (HOST_SPLIT_NOT_APPLIED)
        two = len(reference) > 4
        fit = (_reference_scales(device, tuple(reference[:2]) + tuple(reference[3:5]), engine)
               if two else None)
        host = fit[3] if fit else None
        b, seq, width = _REFERENCE_SHAPE
        small_b, small_seq = _REFERENCE_SMALL_SHAPE
        selective = ""
        if len(reference) > 2:      # measurements taken before it have two figures
            per_byte, ops_s, nbytes = _reference_selective_byte_s(device, reference[2], engine)
            op_overhead = replace(op_overhead, selective_byte_s=per_byte)
            selective = (f"; selective recompute per activation byte: the same blocks, each "
                         f"under a selective checkpoint recomputing nothing, "
                         f"{reference[2] * 1e3:.2f} ms more forward + backward, less "
                         f"{ops_s * 1e3:.2f} ms for their operators at the per-operator figure, "
                         f"over the {nbytes / 2**20:.1f} MiB they save without recompute")
        if host is not None:
            split = (f"; and on {small_b} x {small_seq} tokens timed whole "
                     f"({reference[3] * 1e3:.2f} ms forward, {reference[4] * 1e3:.2f} ms "
                     f"backward): the price's host work and the rest fitted to both would "
                     f"scale the layers x{fit[0]:.3f} forward, x{fit[1]:.3f} backward and "
                     f"their host work x{host[0]:.3f}, x{host[1]:.3f} (not applied: "
                     f"{HOST_SPLIT_NOT_APPLIED})")
        elif two:
            split = (f"; on {small_b} x {small_seq} tokens ({reference[3] * 1e3:.2f} "
                     f"ms forward, {reference[4] * 1e3:.2f} ms backward) no positive split of "
                     "host work and arithmetic")
        else:
            split = ""
        op_overhead = replace(
            op_overhead, layer_forward_scale=scale_fwd, layer_backward_scale=scale_bwd,
            source=op_overhead.source + (
                f"; layer scales: {_REFERENCE_BLOCKS} such blocks at width {width} on "
                f"{b} x {seq} tokens timed whole ({reference[0] * 1e3:.2f} ms forward, "
                f"{reference[1] * 1e3:.2f} ms backward"
                + (", each rank free-running, every rank busy" if raw.get("shares_cores")
                   else "")
                + f") over the cost model's price for them from this profile's other figures "
                f"({priced[0] * 1e3:.2f} + {priced[1] * 1e3:.2f} ms){split}" + selective))
        device = replace(device, op_overhead=op_overhead)

    backend = "NCCL" if cuda else "gloo"
    if nproc == 1:
        node = _one_device_node(copy_bytes_per_s, how, cuda)
        profile = Profile(name=name, description=f"Measured on {host}: {device_name}, 1 device",
                          device=device, node=node, network=None)
        return profile, {"matmul_flops_per_s": throughput, "copy_bytes_per_s": copy_bytes_per_s,
                         "attention": attention}

    # collectives: t = a + b S  ->  bus bandwidth factor / b, per-step latency a / steps
    fits: dict[str, dict[str, float]] = {}
    for op in COLLECTIVE_OPS:
        sizes = [float(s) for s, _ in raw["comm"][op]]
        times = [float(t) for _, t in raw["comm"][op]]
        a, b = fit_alpha_beta(sizes, times)
        factor, steps = ring_coefficients(CollectiveOp(op), 2 if op == "p2p" else nproc)
        fits[op] = {"alpha_s": a, "beta_s_per_byte": b, "bus_bw_bytes_per_s": factor / b,
                    "latency_per_step_s": a / steps}
    bus = max(f["bus_bw_bytes_per_s"] for f in fits.values())
    latency = statistics.median(f["latency_per_step_s"] for f in fits.values())
    fit_text = "; ".join(f"{op} {f['bus_bw_bytes_per_s'] / 1e9:.3g} GB/s, "
                         f"{f['latency_per_step_s'] * 1e6:.3g} us/step" for op, f in fits.items())
    efficiency = CollectiveEfficiency(
        **{op: max(1e-6, min(1.0, f["bus_bw_bytes_per_s"] / bus)) for op, f in fits.items()},
        source=f"{how}: each operation's fitted bus bandwidth over the best ({fit_text})")
    op_latency = CollectiveLatency(
        **{op: f["latency_per_step_s"] for op, f in fits.items()},
        source=f"{how}: each operation's fitted latency (t = a + b S, the mean of every timed call"
               + (f", each after a {_WORK_FLOPS / 1e6:.0f}-MFLOP matmul, less the matmul"
                  if raw.get("comm_after_compute") else "")
               + (f"; the ranks share cores: p2p after a {_WORK_FLOPS / 1e6:.0f}-MFLOP matmul, "
                  "every pair of ranks at once, less the matmul, the others back to back"
                  if raw.get("shares_cores") else "")
               + ") over its ring steps")
    # more ranks than cores: they share them (a rank runs faster while others wait)
    shared = cores if not cuda and cores is not None and cores < devices_per_node else None
    arrival = float(raw.get("arrival_s", 0.0)) if shared is not None else 0.0
    node = NodeSpec(
        devices_per_node=devices_per_node, shared_cores=shared,
        topology=IntraNodeTopology.UNIFORM if cuda else IntraNodeTopology.SHARED_MEMORY,
        bw_unidir_bytes_per_s=bus, latency_s=latency, collective_efficiency=efficiency,
        collective_latency=op_latency,
        arrival_s=arrival,
        arrival_source=(f"{how}: a 16-byte all-reduce after {_ARRIVAL_WORK_CALLS} "
                        f"{_WORK_FLOPS / 1e6:.0f}-MFLOP matmuls, over every rank and over "
                        "pairs of ranks, less the matmuls alone (free-running) less the "
                        f"all-reduce back to back, each the ranks' mean of {_ARRIVAL_LOOP} "
                        f"calls; the mean of {_ARRIVAL_ROUNDS} rounds")
                       if arrival else None,
        source=f"{how}: the best {backend} bus bandwidth of any collective (ring model fit)",
        latency_source=f"{how}: median over the collectives of the fitted per-step latency")
    profile = Profile(name=name,
                      description=f"Measured on {host}: {device_name}, {devices_per_node} devices",
                      device=device, node=node, network=None)
    measurements = {"matmul_flops_per_s": throughput, "copy_bytes_per_s": copy_bytes_per_s,
                    "collective_fits": fits, "collective_times_s": raw["comm"],
                    "attention": attention}
    return profile, measurements


def _measure_grouped_gemms(torch, dist, device, dtypes: dict, plan: MeasurementPlan, cuda: bool,
                           sync: Callable[[], None], timed, say) -> dict[str, list]:
    """Grouped GEMMs per 16-bit or fp32 dtype the plan times matmuls in, over
    :data:`~autoplan.hardware.grouped_gemm.GROUPED_SHAPES`: ``dtype -> [(experts, rows, k,
    n, seconds)]``; a dtype the device's grouped kernel refuses is left out."""
    from .grouped_gemm import GROUPED_SHAPES, grouped_gemm_call, grouped_gemm_flops

    experts, rows_list, k, n = GROUPED_SHAPES["cuda" if cuda else "cpu"]
    out: dict[str, list] = {}
    for name in ("bf16", "fp32"):
        if name not in plan.matmul_sizes:
            continue
        points = []
        for rows in rows_list:
            try:
                call = grouped_gemm_call(torch, experts=experts, rows=rows, k=k, n=n,
                                         dtype=dtypes[name], device=device)
                call()
            except (RuntimeError, NotImplementedError) as exc:   # no kernel for this dtype
                say(f"grouped GEMM {name}: not measured ({type(exc).__name__}: {exc})"[:200])
                points = []
                break
            dist.barrier()
            sec = (_time_local(call, sync, plan.matmul_target_s, plan.repeats) if cuda
                   else timed(call, plan.matmul_target_s, local=True))
            del call
            points.append((experts, rows, k, n, sec))
            flops = grouped_gemm_flops(experts=experts, rows=rows, k=k, n=n)
            say(f"grouped GEMM {name} {experts} x {rows} rows: {flops / sec / 1e9:.1f} GFLOP/s")
        if points:
            out[name] = points
    return out


def _grouped_tables(ranks: list[dict[str, Any]], peaks: dict[str, float],
                    how: str) -> dict[str, EfficiencyTable]:
    """Per dtype, the grouped-GEMM efficiency table of the slowest rank at each point."""
    from .grouped_gemm import grouped_gemm_table

    out = {}
    for dtype, points in (ranks[0].get("grouped") or {}).items():
        if dtype not in peaks or any(dtype not in (r.get("grouped") or {}) for r in ranks):
            continue
        worst = [(*p[:4], max(r["grouped"][dtype][i][4] for r in ranks))
                 for i, p in enumerate(points)]
        out[dtype] = grouped_gemm_table(
            worst, peaks[dtype],
            f"{how}: grouped GEMMs (torch grouped_mm) of {worst[0][0]} experts, "
            f"{', '.join(str(p[1]) for p in worst)} rows each, {worst[0][2]} x {worst[0][3]} "
            f"weights, over the best measured {dtype} matmul")
    return out


def _attention_table(ranks: list[dict[str, Any]], peaks: dict[str, float], how: str
                     ) -> tuple[list[dict[str, Any]], EfficiencyTable | None]:
    """The measured attention calls (the slowest rank's time per shape) and the profile's
    table: for the shapes of the first (heads, head dim) of :data:`_ATTENTION_HEADS`, the
    fraction of the 16-bit peak at which :data:`_ATTENTION_FLOPS_PER_QK` ``QK^T`` products
    take the measured time, against one product's FLOPs.  ``None`` without measurements."""
    shapes = [tuple(r[:4]) for r in ranks[0].get("attention") or []]
    if not shapes:
        return [], None
    peak = peaks.get("bf16") or peaks.get("fp16")
    rows = []
    for i, shape in enumerate(shapes):
        sec = max(float(r["attention"][i][4]) for r in ranks)
        qk = _qk_flops(*shape)
        rows.append({"batch": shape[0], "heads": shape[1], "seq": shape[2], "head_dim": shape[3],
                     "seconds": sec, "qk_flops": qk,
                     "priced_flops_per_s": _ATTENTION_FLOPS_PER_QK * qk / sec})
    if peak is None:
        return rows, None
    heads, head_dim = _ATTENTION_HEADS[0]
    points = sorted((r["qk_flops"], min(1.0, r["priced_flops_per_s"] / peak)) for r in rows
                    if (r["heads"], r["head_dim"]) == (heads, head_dim))
    if not points:
        return rows, None
    table = EfficiencyTable(
        tuple(points),
        source=(f"{how}: causal torch scaled_dot_product_attention in bf16, forward and "
                f"backward, {_ATTENTION_TOKENS} tokens a call, {heads} heads of {head_dim}, "
                f"sequence {min(r['seq'] for r in rows)}-{max(r['seq'] for r in rows)}: "
                f"{_ATTENTION_FLOPS_PER_QK:g} QK^T products' FLOPs (the cost model's price of a "
                "causal fused attention) over the time, over the best measured 16-bit matmul"))
    return rows, table


def _elementwise_rates(ranks: list[dict[str, Any]], how: str, shares_cores: bool,
                       cuda: bool = False) -> ElementwiseRates | None:
    """The ranks' memory-bound operator timings (:func:`_measure_elementwise`) as rates,
    the slowest rank's per figure (as for the matmuls); ``None`` where not measured
    (results of an older profiler)."""
    measured = [r.get("elementwise") or {} for r in ranks]
    kinds = [k for k in measured[0] if all(k in m for m in measured)]
    if not kinds:
        return None
    forward = {k: min(m[k][2] / m[k][0] for m in measured) for k in kinds}
    backward = {k: min(m[k][2] / m[k][1] for m in measured) for k in kinds}
    rows, width = _ELEMENTWISE_SHAPE_CUDA if cuda else _ELEMENTWISE_SHAPE
    layout = [k for k in kinds if k not in ELEMENTWISE_KINDS]
    return ElementwiseRates(
        forward_bytes_per_s=forward, backward_bytes_per_s=backward,
        source=(f"{how}: each operator as models call it (GELU exact, SiLU, softmax and "
                f"layer norm over the last dimension, masked_fill of a boolean mask"
                + (", broadcasts: a row's scale, a norm's weight and rotary embeddings' "
                   "cos of a transposed query; a transposed query made contiguous"
                   if layout else "")
                + f") on {rows} x {width} fp32 tensors, each call on the next of a rotation "
                "that no cache holds; its output plus its input per second of its forward, "
                "and per second of its backward (forward + backward less the forward)"
                + ("; the ranks share cores: each rank free-running, every rank busy, the "
                   "fastest of a few windows of the ranks' mean" if shares_cores else "")))


def _one_device_node(copy_bytes_per_s: float, how: str, cuda: bool) -> NodeSpec:
    """The node of a one-device profile: no collective can run on it, so none was measured;
    its link figures are the device's own copy bandwidth (what a one-rank collective moves
    through) and no latency, and are never used by a plan of one device."""
    why = (f"{how}: one device, so no collective was measured (none runs on a one-device "
           "node); the device's own copy bandwidth stands for the link")
    return NodeSpec(devices_per_node=1,
                    topology=IntraNodeTopology.UNIFORM if cuda else IntraNodeTopology.SHARED_MEMORY,
                    bw_unidir_bytes_per_s=copy_bytes_per_s, latency_s=0.0,
                    collective_efficiency=CollectiveEfficiency.uniform(1.0, why),
                    source=why, latency_source=why)


def _summary(profile: Profile, path: Path, elapsed: float) -> str:
    d, n = profile.device, profile.node
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in d.peak_flops_per_s.items())
    effs = ", ".join(f"{op} {getattr(n.collective_efficiency, op):.2f}" for op in COLLECTIVE_OPS)
    return "\n".join([
        f"wrote {path} in {elapsed:.1f} s (load it with autoplan.load_cluster({str(path)!r}))",
        f"  device   {d.name} x {n.devices_per_node}",
        f"  matmul   best GFLOP/s: {peaks}",
        f"  memory   {d.memory_bytes / 2**30:.2f} GiB per device, copy {d.memory_bw_bytes_per_s / 1e9:.2f} GB/s",
        *([f"  memory-bound operators (forward/backward GB/s of their bytes): " + ", ".join(
            f"{k} {d.elementwise_rates.forward_bytes_per_s[k] / 1e9:.1f}/"
            f"{d.elementwise_rates.backward_bytes_per_s[k] / 1e9:.1f}"
            for k in d.elementwise_rates.forward_bytes_per_s)]
          if d.elementwise_rates is not None else []),
        *([f"  link     {n.bw_unidir_bytes_per_s / 1e9:.3f} GB/s bus bandwidth, "
           f"{n.latency_s * 1e6:.1f} us per step",
           f"  collective efficiency: {effs}"] if n.devices_per_node > 1 else
          ["  link     none: one device, no collective measured"]),
        *(["  latency per step: " + ", ".join(
            f"{op} {n.collective_latency.of(op) * 1e6:.0f} us" for op in COLLECTIVE_OPS)]
          if n.collective_latency is not None else []),
        *([f"  attention {len(d.attention_efficiency.points)} points, "
           + ", ".join(f"{e:.2f}" for _, e in d.attention_efficiency.points)
           + " of the 16-bit peak (causal SDPA, forward + backward)"]
          if d.attention_efficiency is not None else []),
        *([f"  grouped GEMM {dtype} {len(t.points)} points, "
           + ", ".join(f"{e:.2f}" for _, e in t.points)
           + " of the peak (MoE experts, by rows per expert)"
           for dtype, t in (d.grouped_matmul_efficiency or {}).items()]),
        *([f"  after compute: +{n.arrival_s * 1e6:.0f} us per collective call (ranks share "
           f"{n.shared_cores} cores)"] if n.arrival_s else []),
        *([f"  overhead {d.op_overhead.forward_dispatch_s * 1e6:.1f} us per dispatched operator "
           f"forward, {d.op_overhead.backward_node_s * 1e6:.1f} us per autograd node backward; "
           f"tensor-parallel linear "
           f"+{d.op_overhead.tp_linear_forward_s * 1e6:.0f} + "
           f"{d.op_overhead.tp_linear_backward_s * 1e6:.0f} us"
           + (f" + {d.op_overhead.tp_collective_byte_s * 2**20 * 1e3:.2f} ms per MiB of its "
              "collectives" if d.op_overhead.tp_collective_byte_s else "")
           + (f", one sharing its region's input "
              f"+{d.op_overhead.tp_shared_linear_forward_s * 1e6:.0f} + "
              f"{d.op_overhead.tp_shared_linear_backward_s * 1e6:.0f} us"
              if d.op_overhead.tp_shared_linear_forward_s is not None
              and d.op_overhead.tp_shared_linear_backward_s is not None else "")
           + "; optimizer "
           f"{d.op_overhead.optimizer_param_s * 1e6:.0f} us per parameter tensor, "
           f"{d.op_overhead.optimizer_dtensor_param_s * 1e6:.0f} us per DTensor, "
           f"{d.op_overhead.optimizer_element_s * 1e9:.2f} ns per element; zero-bubble "
           f"split backward +{d.op_overhead.zero_bubble_node_s * 1e6:.1f} us per autograd "
           f"node; pipeline "
           f"{d.op_overhead.pipeline_action_s * 1e6:.0f} us per stage action + "
           f"{d.op_overhead.pipeline_message_s * 1e6:.0f} us per message end"
           + (f"; layers x{d.op_overhead.layer_forward_scale:.2f} forward, "
              f"x{d.op_overhead.layer_backward_scale:.2f} backward their parts' sum"
              if d.op_overhead.layer_forward_scale is not None
              and d.op_overhead.layer_backward_scale is not None else "")
           + (f", their host work x{d.op_overhead.host_forward_scale:.2f}, "
              f"x{d.op_overhead.host_backward_scale:.2f}"
              if d.op_overhead.host_forward_scale is not None
              and d.op_overhead.host_backward_scale is not None else "")
           + (f"; selective recompute +{d.op_overhead.selective_byte_s * 1e9:.2f} ns per "
              "activation byte" if d.op_overhead.selective_byte_s else "")
           + (f"; FSDP2 +{d.op_overhead.fsdp_gather_call_s * 1e3:.2f} ms + "
              f"{d.op_overhead.fsdp_gather_byte_s * 2**20 * 1e3:.2f} ms/MiB a gather, "
              f"+{d.op_overhead.fsdp_reduce_call_s * 1e3:.2f} ms + "
              f"{d.op_overhead.fsdp_reduce_byte_s * 2**20 * 1e3:.2f} ms/MiB a reduce-scatter"
              if d.op_overhead.fsdp_measured else "")
           + (f"; replicate +{d.op_overhead.replicate_call_s * 1e3:.2f} ms + "
              f"{d.op_overhead.replicate_byte_s * 2**20 * 1e3:.2f} ms/MiB an all-reduce"
              if d.op_overhead.replicate_measured else "")
           + (f"; context parallelism in a step +{d.op_overhead.cp_gather_call_s * 1e3:.2f} "
              f"ms + {d.op_overhead.cp_gather_byte_s * 2**20 * 1e3:.2f} ms/MiB an all-gather, "
              f"+{d.op_overhead.cp_scatter_call_s * 1e3:.2f} ms + "
              f"{d.op_overhead.cp_scatter_byte_s * 2**20 * 1e3:.2f} ms/MiB a reduce-scatter"
              if d.op_overhead.cp_measured else "")]
          if d.op_overhead else []),
    ])


# --------------------------------------------------------------------------- entry point


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
        print(f"{_PREFIX} error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = args.nproc if args.nproc is not None else (gpus if cuda else 2)
    if nproc < 1 or (cuda and nproc > gpus):
        parser.print_usage(sys.stderr)
        limit = f" and at most {gpus} (GPUs present)" if cuda else ""
        print(f"{_PREFIX} error: --nproc must be at least 1{limit}, got {nproc}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        parser.print_usage(sys.stderr)
        print(f"{_PREFIX} error: --repeat must be at least 1, got {args.repeat}", file=sys.stderr)
        return 2
    if args.out is not None:
        out = args.out
        name = _profile_name(args.name or out.stem)
    else:
        name = _profile_name(args.name or f"local-{socket.gethostname()}")
        out = user_profiles_dir() / f"{name}.yaml"
    cores = _usable_cores()
    threads = 1 if cuda else max(1, cores // nproc)
    plan = MeasurementPlan.for_machine(cuda, args.quick)
    backend = "nccl" if cuda else "gloo"
    _say(f"profiling {'CUDA' if cuda else 'CPU'} with {nproc} rank{'s' if nproc > 1 else ''} "
         f"({backend}"
         f"{'' if cuda else f', {threads} thread(s) each'}){' --quick' if args.quick else ''}",
         start)
    try:
        raws = []
        for run in range(args.repeat):
            if args.repeat > 1:
                _say(f"run {run + 1} of {args.repeat}", start)
            raws.append(_run_ranks(nproc, backend, cuda, threads, plan, args.timeout, start))
        raw = _median_raw(raws)
    except ProfilingFailed as exc:
        print(f"{_PREFIX} {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{_PREFIX} interrupted", file=sys.stderr)
        return 130
    profile, measurements = _build_profile(
        name, raw, cuda=cuda, nproc=nproc, threads=threads,
        devices_per_node=gpus if cuda else nproc, quick=args.quick, copy_bytes=plan.copy_bytes,
        cores=cores, runs=args.repeat)
    _say("host memory" + (" and host link" if cuda else ""), start)
    profile = replace(profile, host=measure_host(cuda=cuda, quick=args.quick))
    header = (f"# Measured by `autoplan profile` ({'quick, ' if args.quick else ''}{nproc} "
              f"rank{'s' if nproc > 1 else ''}"
              f"{f', the median of {args.repeat} runs' if args.repeat > 1 else ''}) "
              f"on {socket.gethostname()}. Figures are measurements, not datasheet values;\n"
              f"# see autoplan/hardware/profiler.py for what each one means. Re-run to refresh.\n")
    atomic_write_text(out, header + profile_to_yaml(profile))
    load_profile(out)  # what we wrote must load
    elapsed = time.perf_counter() - start
    _say(f"done: {out}", start)
    if args.json:
        print(json.dumps({"path": str(out), "elapsed_s": elapsed, "plan": asdict(plan),
                          "profile": profile.to_dict(), "measurements": measurements}, indent=1))
    else:
        print(_summary(profile, out, elapsed))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
