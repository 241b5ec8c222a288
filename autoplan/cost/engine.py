"""The cost engine: step time and memory of a layout, from a captured graph and a cluster.

One engine prices both a uniform :class:`~autoplan.strategy.Strategy` and a
per-layer :class:`~autoplan.plan.Plan`: both become the same internal layout
(virtual stages made of *segments*, runs of consecutive layers with the same
options), so the search and :func:`autoplan.cost.estimate` never disagree.

Time of one step (per data-parallel replica; the step waits for the slowest)
----------------------------------------------------------------------------
Per pipeline rank ``p`` and micro-batch, ``F_p`` and ``B_p`` are the forward
and backward times of all its chunks:

* **compute** of every FLOP-carrying node ``n`` of the layer:
  ``flops_n / (peak[dtype] * efficiency(flops_n))`` with ``flops_n`` the node's
  FLOPs on one device (``/tp`` inside tensor-parallel regions, ``/cp`` under
  context parallelism), ``peak`` and the efficiency table from the device
  profile (:meth:`DeviceType.efficiency`).  The backward of a matmul runs two
  matmuls of the forward's size (input and weight gradients), so it is priced at
  the forward's efficiency.  Under an FP8 recipe (``Precision.is_fp8``) the GEMMs of
  the linears it converts run at the FP8 peak and efficiency, and their operands are
  quantized first, memory-bound, as the library that runs it does
  (``CostOptions.fp8_library``; :mod:`autoplan.cost.fp8`: torchao's casts, scale
  all-reduces and FP8 all-gathers, Transformer Engine's fused casts).
* **memory-bound operators** (norms, activations, softmax, residual adds,
  copies; the roofline of Williams et al. 2009): the bytes each captured node
  without FLOPs reads and writes, over the device's memory bandwidth, and in the
  backward, where the host is the device (CPUs), the bytes its derivative moves
  (nothing for an add or a dropout of probability 0, twice the forward for a product
  of two tensors: :func:`autoplan.cost.summary.backward_traffic`), on a GPU twice the
  forward's (:data:`ELEMENTWISE_BACKWARD_FACTOR`: session-38 H100/H200 step times of
  0.5-3B models priced 7-15% fast with the derivative's bytes, within their tests' bounds
  with twice the forward's; the GPU's backward kernels of memory-bound operators, or
  something else there, run slower than the bytes say); sharded like the activations
  they touch.  Kinds a profile timed
  apart (``DeviceType.elementwise_rates``: on CPU ranks GELU, SiLU, softmax, layer
  norm, masked_fill, arithmetic per byte there; on a GPU these and broadcasts and
  layout copies, which run on a non-vectorized path) move their bytes at their own
  measured forward and backward speeds instead.
* **host and composition** (CPU devices, where the host is the device): the
  host's dispatch per forward operator and backward autograd node
  (``DeviceType.op_overhead``) adds to a layer's time, and a profile that timed a
  reference stack of blocks whole scales the sum of these parts by what it found
  (``OpOverhead.layer_forward_scale`` / ``layer_backward_scale``).
* **recompute** (Chen et al. 2016; Korthikanti et al. 2022, Sec. 5): full
  recompute re-runs each block's forward (and its tensor-parallel collectives)
  before its backward; selective recompute re-runs only the attention core.
* **fused attention** (Dao et al. 2022, Alg. 2/4; Dao 2023 Sec. 3.1): the
  attention core's backward recomputes its forward; a causal mask halves the
  core's work (:data:`CAUSAL_BLOCK_FRACTION`).
* **tensor parallelism** (Shoeybi et al. 2019, Sec. 3; Korthikanti et al. 2022,
  Sec. 4.2.2): the collectives captured per layer, all-reduces or (sequence
  parallel) all-gathers and reduce-scatters, over the tensor-parallel group;
  exposed unless ``tp_comm_overlap``, then hidden behind the layer's compute.
* **context parallelism**, all-gather attention as :mod:`autoplan.runtime.cp`
  runs it (Dubey et al. 2024, "The Llama 3 Herd of Models", Sec. 3.3.2): each
  block all-gathers the keys/values of the whole sequences over the replica's
  context-parallel group in the forward (``kv_bytes_per_token * seq_len * b / tp``
  gathered bytes) and reduce-scatters their gradients in the backward (again
  under full recompute, whose forward gathers again).  The attention core
  waits for the gather and the input gradient for the reduce-scatter, so both
  are exposed, not overlapped; so are the runtime's memory-bound copies around
  them at the device's copy bandwidth (2 x local + 2 x gathered bytes forward,
  4 x gathered backward: the stack of keys and values and the copy into position
  order, each way).
* **expert parallelism** (mixture-of-experts layers; Lepikhin et al. 2021, GShard;
  Megatron-Core and torchtitan carve the ``ep`` ranks out of ``dp x cp``):
  the ``ep`` consecutive ranks of the flattened ``dp x cp`` index (same ``tp`` index,
  so ``ep x tp`` devices apart at most; inside a node when ``ep x tp`` fits one) share
  one copy of the experts.  Per MoE layer and micro-batch each rank sends
  ``tokens x top-k x hidden x bytes`` (its ``b x seq / cp`` tokens) through an
  all-to-all, ``(ep - 1) / ep`` of it to other ranks, for the dispatch and the combine
  in the forward and their transposes in the backward (again under full recompute),
  blocking, so exposed (:meth:`CostEngine.dispatch_bytes`; pairwise exchange in
  :mod:`autoplan.hardware.collectives`); a DeepEP-style dispatcher
  (``CostOptions.moe_dispatcher="deepep"``) sends one copy per destination node or rank
  instead of one per assignment (:meth:`CostEngine.dispatch_share`).  The expert GEMMs
  run one expert at a time: ``ep x tokens x top-k / experts`` rows each (the tokens of
  the ep group spread over all experts), priced at that size's efficiency, and the
  busiest rank computes ``CostOptions.expert_imbalance`` times the mean.  The router and
  shared experts are ordinary (dense) matmuls.
* **ZeRO-3 / FSDP** (Rajbhandari et al. 2020, Sec. 5.3; Zhao et al. 2023,
  Sec. 3.3): each micro-batch all-gathers every layer's parameters in the
  forward and again in the backward and reduce-scatters its gradients; with
  prefetch a layer's collectives run under the previous layer's compute:
  ``sum_i max(f_i, ag_i)`` in the forward and ``sum_i max(b_i, ag_i + rs_i)``
  in the backward.  ZeRO-2 reduce-scatters gradients per micro-batch the same
  way.
* **pipeline point-to-point**: each chunk sends its output activation forward (in
  its forward) and its input's gradient backward (in its backward), and its rank
  pays for the sends it makes (the first and last stage one per micro-batch, a
  middle stage two); with tensor parallelism each rank sends ``1/tp`` of it when
  the stack scatters (Narayanan et al. 2021, Sec. 4.1), the whole tensor otherwise.
  A CPU rank whose profile measured the host work per message end
  (``OpOverhead.pipeline_message_s``: gloo's transport threads) pays that instead
  of the link's time: gloo's isend returns at once.

The ranks combine through the schedule (:mod:`autoplan.cost.schedules`).  After
the last backward, each rank reduces its gradients over its data-parallel (x
context-parallel) group: an all-reduce (ZeRO-0) or reduce-scatter plus
parameter all-gather (ZeRO-1, Megatron's distributed optimizer; ZeRO-2's
all-gather), one of each per wrapped block and one for the rest of the rank's
layers under ``zero_step_per_layer`` (FSDP), one over all of them otherwise.
Under ``zero_buffer_copies`` (torch's wrappers, what
:func:`autoplan.parallelize` runs) these step-level collectives also copy through
flat buffers at the memory bandwidth: the gradients into the reduction's input
and, for an all-reduce, its result back out (DDP's buckets, FSDP2's
``replicate``); the shard into the all-gather's input and its output into the
parameters.  Where a CPU profile measured FSDP2's work around them
(``OpOverhead.replicate_call_s``, ``fsdp_reduce_call_s``...) it is priced in place of
those copies, per call and byte, but on pipelines whose ranks share cores.  With
``overlap_grad_reduce`` the reduction runs under the last
backward; rank ``p`` also finishes its backward ``sum_{q<p} B_q`` before rank 0
does, which hides more.  Where ranks share fewer cores (``NodeSpec.shared_cores``),
what that hides still takes the cores: the step pays the hidden seconds times
``1 - cores / ranks``.  Tied embeddings split over the first and last stages
all-reduce their gradient between the two (Shoeybi et al. 2019).  The
**optimizer** step is memory-bound: ``local params * bytes accessed per param /
memory bandwidth``; on a device whose host is the device (a CPU's ``op_overhead``) it
adds the host's time per parameter tensor, for a DTensor (the parameters FSDP2's
``fully_shard``/``replicate`` and tensor parallelism leave) at its own figure.

Memory of one device
--------------------
Model states per ZeRO stage (Rajbhandari et al. 2020, Sec. 5) over the
``dp * cp`` group (an expert bank's: ``1/ep`` of it per device, sharded over the
``dp * cp / ep`` ranks holding the same experts, which also reduce its gradients); activations per micro-batch from the captured saved bytes
(Korthikanti et al. 2022, Sec. 4: the part outside tensor-parallel regions
shrinks by ``tp`` only with sequence parallelism, the part inside by ``tp``;
selective recompute and fused attention drop the ``s x s`` part; full recompute
keeps each block's input) times the micro-batches in flight, plus one layer's
working set under full recompute, and on the stage computing the loss its fp32 logits
(``CostOptions.loss_fp32_copy``, :func:`loss_bytes_per_logit`); buffers (gathered ZeRO-3
layers, gradient buckets or, where ZeRO-1/2 reduce-scatter per layer, one layer's
unsharded gradients, pipeline send/receive, under ``CostOptions.autocast`` the bf16
weight copies torch.autocast caches, and under ``CostOptions.grad_accumulate_add`` the
largest ZeRO-0/1 module's fresh gradient of a later micro-batch) and the runtime reserve
from ``profiles/cost/cost-model.yaml``.

The host
--------
On a CPU the host is the device: a measured ``op_overhead`` adds per operator.  On a GPU
the host dispatches ahead of the device; with a measured ``op_overhead``
(``autoplan profile`` on CUDA) each layer takes the longer of the host's work and the
device's, per direction (:func:`host_runs_ahead`); without one (datasheet profiles) the
device's alone.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import ConfigError, StrategyError
from ..graph import LayerKind
from ..strategy import Precision, Recompute, Schedule, Strategy, stage_ranks, uses_ddp
from .calibration import _is_gpu
from .calibration import (DEFAULT_CALIBRATION, Calibration, apply_calibration, attention_tables,
                          resolve_calibration)
from .constants import CostConstants, CostOptions, load_constants
from . import fp8 as _fp8
from .ledger import Ledger, LedgerBuilder
from .memory import activation_bytes, fsdp2_state_bytes, model_state_bytes
from ..precision import DTYPE_BYTES, fp8_all_gather, fp8_problem, precision_program
from .result import BREAKDOWN_KEYS, Estimate, MemoryBreakdown, StageEstimate
from .schedules import in_flight, pipeline_time
from .summary import BACKWARD_TRAFFIC_DEFAULT, GraphSummary, LayerCost, MatmulNode, summarize

__all__ = ["CostEngine", "QuickEstimate", "LayerTime", "PrecisionCosts", "CAUSAL_BLOCK_FRACTION",
           "ELEMENTWISE_BACKWARD_FACTOR", "layout_from_plan", "Layout", "Segment"]

#: Backward bytes of a memory-bound operator per forward byte on a GPU, and on a CPU where
#: its derivative is not known (:func:`autoplan.cost.summary.backward_traffic` knows the
#: common ones; the module docstring says why GPUs keep this for every one): it reads
#: the output gradient and what it saved and writes the input gradient (about twice the
#: forward's one read and one write; Korthikanti et al. 2022 count the same saved
#: tensors).  A kind a profile times apart (``elementwise_rates``) is counted at this in
#: the summary's backward bytes and its measured backward replaces it.
ELEMENTWISE_BACKWARD_FACTOR = BACKWARD_TRAFFIC_DEFAULT
#: Bytes of the step's closing loss all-reduce (:attr:`CostOptions.step_loss_all_reduce`):
#: the loss sum and the sequence count, float64 (``ParallelModel.step``).
LOSS_REDUCE_BYTES = 16

#: Under torch.autocast over fp32 weights (:attr:`CostOptions.autocast`): bytes per
#: parameter of the bf16 copies it caches during a forward; bytes moved per parameter by
#: one cast (fp32 -> bf16 in the forward, the gradient bf16 -> fp32 in the backward:
#: 4 + 2)
AUTOCAST_COPY_BYTES = 2
AUTOCAST_CAST_BYTES = 6
#: Gradient accumulation (:attr:`CostOptions.grad_accumulate_add`): a micro-batch's
#: gradient added to the accumulated one reads both and writes one, three times the
#: gradient's bytes per parameter
GRAD_ACCUMULATE_READS_WRITES = 3


def loss_bytes_per_logit(dtype: str, shifts: bool) -> float:
    """Bytes per logit the token cross-entropy holds beyond what capture counts
    (:func:`autoplan.runtime.loss.token_cross_entropy`, as Hugging Face computes it).

    While its log-softmax runs, the model's logits (in the compute dtype) are held by the
    caller, log-softmax reads an fp32 tensor made for it -- the upcast of 16-bit logits,
    or, in fp32, the copy that reshaping the next-token slice makes -- and writes its fp32
    output, which it saves for the backward.  Capture counts only that saved output, and
    at the recipe's activation bytes.  So ``4 + 4`` where the fp32 input is a new tensor,
    else ``4``, whatever the compute dtype: the logits' own bytes and the saved output's
    count cancel.  Measured: a bf16 H100 step (``benchmarks/gpu_truth.py``) under full
    recompute, where the loss's working set decides the peak, within 1% of its peak
    memory with this term, 4-24% under it without.

    >>> loss_bytes_per_logit("bf16", shifts=True), loss_bytes_per_logit("fp32", shifts=False)
    (8.0, 4.0)
    """
    new_input = dtype != "fp32" or shifts
    return 4.0 + (4.0 if new_input else 0.0)


#: A fused attention kernel's backward matmuls against its forward's: the gradients of
#: the values, the probabilities, the queries and the keys (four products) against the
#: scores and the values (two).  The kernel's recompute of the scores is priced apart
#: (the forward again, Dao et al. 2022); torch's FLOP formula counts it in the backward.
FUSED_BACKWARD_PRODUCTS = 2.0

#: Fraction of the attention core a fused kernel computes under a causal mask: the
#: blocks above the diagonal are skipped (Dao 2023, FlashAttention-2, Sec. 3.1.1).
CAUSAL_BLOCK_FRACTION = 0.5

_DTYPE = {Precision.BF16: "bf16", Precision.FP16: "fp16", Precision.FP32: "fp32",
          Precision.FP8: "fp8", Precision.FP8_ROWWISE: "fp8-rowwise",
          Precision.FP8_BLOCKWISE: "fp8-blockwise"}


def _fp8_scaling(dtype: str) -> str | None:
    """The FP8 scaling of a :attr:`PrecisionCosts.dtype` (``"fp8"``, ``"fp8-rowwise"``,
    ``"fp8-blockwise"``), or None for a 16- or 32-bit recipe."""
    return Precision(dtype).fp8_scaling if dtype.startswith("fp8") else None

#: Bytes of one count of the token counts a MoE layer's ranks exchange before each
#: dispatch (int64, one per expert: ``autoplan.runtime.ep``, step 1)
COUNT_BYTES = 8
#: The vocabulary-parallel loss (``CostOptions.loss_parallel``): all-reduces per micro-batch
#: over the tensor-parallel group (the logits' max, the sum of their exponentials, the
#: target's logit; torch's ``loss_parallel``, counted on 2 gloo ranks) and bytes per token
#: of each (one fp32 number)
LOSS_PARALLEL_REDUCES = 3
LOSS_PARALLEL_BYTES = 4


def _no_volume(_: tuple) -> None:
    """A ``volumes`` sink for a layer priced without a ledger."""


def _ledger_dtypes(recipe: "PrecisionCosts") -> tuple[str, str, str]:
    """``(activations, gradient reduction, gathered weights)`` dtypes of a recipe as the
    ledger names them (:mod:`.ledger`)."""
    if recipe.dtype == "fp32":
        return "fp32", "fp32", "fp32"
    act = "fp16" if recipe.dtype == "fp16" else "bf16"     # bf16 under FP8 recipes
    return act, {4: "fp32", 2: "bf16"}[recipe.grad_bytes], act


# --------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Segment:
    """Consecutive layers ``lo .. hi-1`` of one virtual stage with the same options."""

    lo: int
    hi: int
    tp: int
    sequence_parallel: bool
    zero: int
    recompute: Recompute


@dataclass(frozen=True)
class Layout:
    """What the engine prices: a :class:`~autoplan.plan.Plan` compiled to segments and devices.

    ``chunks[k]`` are the segments of virtual stage ``k`` (on pipeline rank
    ``stage_ranks[k]``: looped, or a V for zero-bubble);
    ``rank_devices[p]`` the devices of rank ``p`` in rank order
    (dp, cp, tp innermost); ``rank_tp[p]`` its tensor-parallel degree;
    ``replica_micro_batches[r]`` the micro-batches replica ``r`` runs per step.
    Plans compile to it with :func:`layout_from_plan` (a Strategy through
    :meth:`Plan.from_strategy`); the search builds it directly for speed and
    turns the winners into plans that compile back to the same layout.
    """

    pp: int
    virtual_stages: int
    dp: int
    cp: int
    micro_batch: int
    global_batch: int
    replica_micro_batches: tuple[int, ...]
    schedule: Schedule
    precision: Precision
    chunks: tuple[tuple[Segment, ...], ...]
    rank_devices: tuple[tuple[int, ...], ...]
    rank_tp: tuple[int, ...]
    stage_ranks: tuple[int, ...] = ()
    padded: bool = False    # uneven replicas all run the largest count (Plan.pads_micro_batches)
    ep: int = 1             # expert parallel degree (a sub-dimension of dp x cp)

    def micro_batches_run(self, replica: int) -> int:
        """Micro-batches replica ``replica`` runs, zero-weight padding included."""
        return (max(self.replica_micro_batches) if self.padded
                else self.replica_micro_batches[replica])

    def __post_init__(self) -> None:
        if not self.stage_ranks:
            object.__setattr__(self, "stage_ranks",
                               stage_ranks(self.schedule, self.pp, len(self.chunks)))


def layout_from_plan(summary: GraphSummary, plan) -> Layout:
    """The layout of a :class:`~autoplan.plan.Plan` (segments from its layer placements)."""
    index = summary.index
    placement = {lp.name: lp for lp in plan.layers}
    unknown = [n for n in placement if n not in index]
    if unknown or len(placement) != summary.num_layers:
        missing = [l.name for l in summary.layers if l.name not in placement]
        raise StrategyError(f"the plan does not match the model {summary.model!r}: unknown layers "
                            f"{unknown[:5]}, missing {missing[:5]}")
    chunks = []
    for st in plan.stages:
        segs: list[Segment] = []
        for name in st.layers:
            i, lp = index[name], placement[name]
            key = (lp.tp, lp.sequence_parallel, lp.zero, lp.recompute)
            if segs and segs[-1].hi == i and (segs[-1].tp, segs[-1].sequence_parallel,
                                               segs[-1].zero, segs[-1].recompute) == key:
                s = segs[-1]
                segs[-1] = Segment(s.lo, i + 1, *key)
            else:
                segs.append(Segment(i, i + 1, *key))
        chunks.append(tuple(segs))
    pp = plan.pp
    rank_devices = tuple(plan.stages[p].devices for p in range(pp))   # stage p < pp is on rank p
    rank_tp = tuple(plan.stages[p].tp for p in range(pp))
    cp = plan.stages[0].cp
    return Layout(pp, plan.virtual_stages, plan.dp, cp, plan.micro_batch, plan.global_batch,
                  tuple(plan.micro_batches_of(r) for r in range(plan.dp)), plan.schedule,
                  plan.precision, tuple(chunks), rank_devices, rank_tp, plan.stage_ranks,
                  plan.pads_micro_batches, plan.ep)


# --------------------------------------------------------------------------- results
class QuickEstimate(NamedTuple):
    """The three numbers a search needs, without building records."""

    step_time_s: float
    peak_memory_bytes: float
    fits: bool


class PrecisionCosts(NamedTuple):
    """What a :class:`~autoplan.strategy.Precision` recipe costs per parameter and per
    activation byte (``profiles/cost/cost-model.yaml``; :meth:`CostEngine.precision_costs`)."""

    dtype: str                      # key of the device's peak-FLOPs table: bf16, fp16, fp32;
                                    # an FP8 recipe's name (fp8, fp8-rowwise, fp8-blockwise),
                                    # whose converted GEMMs run at the "fp8" peak
    param_bytes: int                # held per parameter (Rajbhandari et al. 2020, Sec. 3.1)
                                    # and all-gathered: the weights computed with
    grad_bytes: int                 # held, reduced and accumulated (grad_reduce_dtype)
    optimizer_bytes: int
    optimizer_bytes_accessed: int   # read and written per parameter by one optimizer step
    activation_scale: float         # the recipe's activation bytes per captured byte
    fsdp2_master: bool = False      # 16-bit compute copies of fp32 master parameters
                                    # (CostOptions.master_weights == "fsdp2")

    @property
    def peak_dtype(self) -> str:
        """The device peak the recipe's fastest GEMMs run at: ``fp8`` for FP8 recipes."""
        return "fp8" if _fp8_scaling(self.dtype) else self.dtype


def prefetch_exposed(shares: tuple[float, ...], compute_s: float, comm_s: float) -> float:
    """Seconds a one-ahead prefetch leaves exposed over one layer's modules.

    Module ``i`` computes for ``compute_s * shares[i]`` while the next module's gather
    (``comm_s * shares[i + 1]``; after the last module, the first of the next layer, alike)
    runs; a gather issued when its predecessor starts, as DeepSpeed ZeRO-3 does with a
    prefetch bucket smaller than a module (``stage3_prefetch_bucket_size``, 5e7 elements by
    default), is waited for by the amount it outlasts that module.  Equal shares give
    ``max(0, comm_s - compute_s)``, the layer-wise overlap; unequal ones expose more: a
    large module's gather hides only under the small module before it.

    >>> round(prefetch_exposed((0.5, 0.5), 1.0, 1.2), 6)
    0.2
    >>> round(prefetch_exposed((0.25, 0.75), 1.0, 1.0), 6)
    0.5
    """
    k = len(shares)
    return sum(max(0.0, comm_s * shares[(i + 1) % k] - compute_s * shares[i]) for i in range(k))


def _host_s(overhead, layer: LayerCost, captured_ops: int, counted: bool) -> tuple[float, float]:
    """Host seconds of one micro-batch of ``layer`` in the forward and in the backward (a
    CPU device, where the host is the device): ``OpOverhead.forward_dispatch_s`` per
    operator its forward dispatches (``layer.dispatched_ops``) and
    ``OpOverhead.backward_node_s`` per node its backward runs (``layer.autograd_nodes``).
    ``counted``: the graph records both counts (a layer that builds a mask without
    gradient runs no autograd node).  A profile or a graph from before them prices per
    captured operator (``forward_s``, ``backward_s``)."""
    if overhead.forward_dispatch_s and counted:
        return (layer.dispatched_ops * overhead.forward_dispatch_s,
                layer.autograd_nodes * overhead.backward_node_s)
    return captured_ops * overhead.forward_s, captured_ops * overhead.backward_s


def host_runs_ahead(device) -> bool:
    """Whether the host dispatches ahead of the device (a GPU), so that a layer takes the
    longer of the two, rather than being the device (a CPU, whose operator overhead adds)."""
    return _is_gpu(device)


def _local_params(layer: LayerCost, tp: int, ep: int) -> tuple[float, float]:
    """Parameters of ``layer`` on one device, ``(outside the expert banks, in them)``:
    tensor parallelism shards the sharded ones by ``tp``, expert parallelism the banks by
    ``ep`` (banks are whole on every tp rank; without ep they shard as the rest)."""
    expert = layer.expert_params if ep > 1 else 0
    return (layer.sharded_params / tp + (layer.params - layer.sharded_params - expert),
            expert / ep)


def _largest_module_local(layer: LayerCost, tp: int, ep: int) -> float:
    """Parameters of ``layer``'s largest module on one device (tensor parallelism shards
    it by ``tp`` where it is sharded, expert parallelism by ``ep`` where it is a bank)."""
    return (layer.largest_module_params / (tp if layer.largest_module_sharded else 1)
            / (ep if layer.largest_module_expert else 1))


def _selective_dispatch_s(overhead, layer: LayerCost, captured_ops: int,
                          activation_bytes: float = 0.0) -> float:
    """Host seconds torch's selective checkpoint adds to one micro-batch of a block: its
    Python dispatch mode runs for every operator the forward and the recompute dispatch,
    so ``OpOverhead.selective_dispatch_s`` per operator the block dispatches
    (``layer.dispatched_ops``), and ``OpOverhead.selective_byte_s`` per byte of the
    ``activation_bytes`` the block saves without recompute on this device for the
    micro-batch (its outputs held to the forward's end, fresh tensors in the recompute).
    A profile measured before it states ``selective_s`` per
    captured operator, and a graph captured before it has no dispatched count: those
    are priced per captured operator (a block dispatches 1.4-1.8 per captured one, so
    a new profile on an old graph prices low)."""
    per_byte = overhead.selective_byte_s * activation_bytes
    if overhead.selective_dispatch_s and layer.dispatched_ops:
        return layer.dispatched_ops * overhead.selective_dispatch_s + per_byte
    return captured_ops * (overhead.selective_s or overhead.selective_dispatch_s) + per_byte


class LayerTime(NamedTuple):
    """Compute seconds of one layer and micro-batch on one device, memory-bound
    operators included (:meth:`CostEngine.template_time`)."""

    forward_s: float
    backward_s: float
    core_forward_s: float   # the attention core's part of forward_s (selective recompute's)
    weight_grad_s: float    # the weight-gradient matmuls' part of backward_s (zero-bubble's W)


class _LayerTerms(NamedTuple):
    """Everything one layer adds to its pipeline rank per micro-batch (see the module
    docstring; :meth:`CostEngine._layer_terms`).  ``<kind>_total_s`` are the seconds of
    that kind of communication, ``<kind>_exposed_s`` the part of them compute does not hide."""

    forward_compute_s: float
    backward_compute_s: float
    recompute_s: float
    weight_grad_s: float
    tp_total_s: float
    tp_exposed_s: float
    cp_total_s: float
    cp_exposed_s: float
    zero_total_s: float
    zero_exposed_s: float
    forward_s: float            # forward with its exposed communication
    backward_s: float           # backward, recompute included, with its exposed communication
    local_params: float         # parameters on this device outside the expert banks
    gather_unit_params: float   # parameters ZeRO-3 gathers at once (a layer or a module)
    saved_bytes: float          # activations saved for the backward (after recompute)
    working_bytes: float        # activations the layer holds while it is (re)computed
    ep_total_s: float
    ep_exposed_s: float
    local_expert_params: float  # parameters on this device in expert banks (ZeRO shards
                                # them over the edp group, the rest over dp x cp)
    cp_waits_s: float           # the part of cp_exposed_s that ranks sharing cores wait
                                # for each other's turn (OpOverhead.cp_gather_call_s)


class _RankGroups(NamedTuple):
    """The device groups of one replica on one pipeline rank, at tensor-parallel index 0
    (:meth:`CostEngine._groups`)."""

    replica: tuple[int, ...]        # the replica's devices on this rank (cp x tp)
    tp: tuple[int, ...]             # the tp group priced: the one spanning the most nodes
    dp: tuple[int, ...]             # same tp index on every replica: dp x cp members
    dp_concurrency: int | None      # concurrent_groups of data-parallel collectives
    dp_key: tuple                   # stands for the dp group in collective cache keys
    cp: tuple[int, ...]             # same tp index in this replica; () without cp
    ep: tuple[int, ...]             # the ep members sharing one copy of the experts
    edp: tuple[int, ...]            # the members holding the same experts (their gradients)
    ep_key: tuple                   # stands for the ep and edp groups in cache keys


@dataclass
class _RankEval:
    """One pipeline rank on one replica: per-micro-batch times and per-step terms."""

    device_type: str
    layers: int
    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    recompute: float = 0.0
    wgrad: float = 0.0
    tp_exposed: float = 0.0
    tp_total: float = 0.0
    cp_exposed: float = 0.0
    cp_total: float = 0.0
    cp_waits: float = 0.0         # of cp_exposed: the turns of ranks sharing cores
    ep_exposed: float = 0.0       # expert-parallel token all-to-alls (blocking: all exposed)
    ep_total: float = 0.0
    zero_exposed: float = 0.0     # ZeRO-2/3 per-micro-batch collectives, exposed
    zero_total: float = 0.0
    p2p: float = 0.0
    fwd: float = 0.0              # F_p: forward per micro-batch incl. exposed comm
    bwd: float = 0.0              # B_p
    dp_step_total: float = 0.0    # per-step gradient reduction / parameter gather
    dp_step_exposed: float = 0.0  # before the pipeline slack
    tp_step: float = 0.0          # of those, the per-step reduction over tp (exposed)
    optimizer: float = 0.0
    memory: MemoryBreakdown | None = None
    in_flight: float = 1.0
    capacity: float = 0.0
    peak_flops: float = 0.0

    @property
    def per_micro_batch(self) -> float:
        return self.fwd + self.bwd


# --------------------------------------------------------------------------- engine
class CostEngine:
    """Prices layouts of one model on one cluster; caches everything reusable.

    Parameters
    ----------
    graph : ModelGraph or GraphSummary
    cluster : Cluster
    options : CostOptions, optional
    constants : CostConstants, optional
        Default: ``profiles/cost/cost-model.yaml``.
    calibration : Calibration, str or None
        Fitted device figures (:mod:`autoplan.cost.calibration`) applied on top
        of the cluster's profiles; default the fit to published runs
        (``profiles/cost/published-fit.yaml``); ``None`` prices the profiles as
        they are.

    Examples
    --------
    >>> from autoplan import trace
    >>> from autoplan.models import GPT, GPTConfig
    >>> from autoplan.hardware import load_cluster
    >>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
    >>> engine = CostEngine(g, load_cluster("a100-sxm4-80gb"))
    >>> q = engine.quick(Strategy(dp=8, global_batch=8))
    >>> q.fits and q.step_time_s > 0
    True
    """

    def __init__(self, graph, cluster, *, options: CostOptions | None = None,
                 constants: CostConstants | None = None,
                 calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> None:
        self.summary = summarize(graph)
        calibration = resolve_calibration(calibration)
        self.calibration = calibration
        self.cluster = apply_calibration(cluster, calibration) if calibration else cluster
        self.options = options or CostOptions()
        self._module_shares: dict[str, tuple[float, ...]] = {}   # per template
        #: fused-attention curves per device type, for the options' attention kernel
        self._attention_tables = (attention_tables(cluster, calibration,
                                                   self.options.attention_kernel)
                                  if calibration else {})
        self.constants = constants or load_constants()
        self._template_times: dict[tuple, LayerTime] = {}
        self._collective_times: dict[tuple, float] = {}
        self._template_counts: dict[tuple[int, int], tuple[tuple[str, int], ...]] = {}
        self._templates: dict[str, LayerCost] = {}
        for l in self.summary.layers:
            self._templates.setdefault(l.template, l)
        # graphs captured before the host-time counts have no autograd nodes anywhere
        self._host_counted = any(l.autograd_nodes for l in self._templates.values())
        self._device_cache: dict[tuple[int, ...], object] = {}
        #: Whether the cluster has one device type (then every replica costs the same).
        self.homogeneous = len(self.cluster.device_types) == 1
        # _LayerTerms cached as plain tuples: the garbage collector stops tracking a tuple
        # of floats but never a NamedTuple, and a search caches tens of thousands of them
        # (each collection would walk them all: 15 % of a DeepSeek-V3 search)
        self._terms: dict[tuple, tuple[float, ...]] = {}
        #: the collectives each cached _LayerTerms priced (_layer_terms' ``volumes``)
        self._volumes: dict[tuple, tuple[tuple, ...]] = {}
        self._precision_costs: dict[Precision, PrecisionCosts] = {}
        self._fp8_cache: dict[tuple[str, str], dict] = {}
        self._strategy_layouts: dict[Strategy, Layout] = {}
        self._rank_stages: dict[tuple[int, ...], dict[int, list[int]]] = {}
        #: The node of every device, and the first device of every node but the first
        #: (where one NVLink domain ends and the next begins).
        self._node_of = tuple(d.node for d in self.cluster.devices)
        self._node_starts = tuple(i for i in range(1, len(self._node_of))
                                  if self._node_of[i] != self._node_of[i - 1])
        sizes = {len(n.local_ranks) for n in self.cluster.nodes}
        self._node_size = sizes.pop() if len(sizes) == 1 else None
        self._alike: dict[tuple, bool] = {}
        self._alike_by_id: dict[tuple, tuple[tuple, bool]] = {}

    # ------------------------------------------------------------------ entry points
    def layout(self, layout) -> Layout:
        if isinstance(layout, Layout):
            return layout
        if isinstance(layout, Strategy):
            hit = self._strategy_layouts.get(layout)
            if hit is None:
                from ..plan import Plan

                hit = layout_from_plan(self.summary, Plan.from_strategy(self.summary, self.cluster,
                                                                        layout))
                if len(self._strategy_layouts) > 4096:
                    self._strategy_layouts.clear()
                self._strategy_layouts[layout] = hit
            return hit
        return layout_from_plan(self.summary, layout)

    def estimate(self, layout, *, ledger: bool = True) -> Estimate:
        """Full :class:`Estimate` of a Strategy, Plan or Layout, with its :meth:`ledger`
        (``ledger=False``: without it, ``Estimate.ledger`` None; what a search loop reads)."""
        lay = self.layout(layout)
        est = self._evaluate(lay, full=True)
        if not ledger:
            return est  # type: ignore[return-value]
        return dataclasses.replace(est, ledger=self.ledger(lay))  # type: ignore[arg-type]

    def ledger(self, layout) -> Ledger:
        """What every device moves and computes in one step of ``layout`` (a Strategy,
        Plan or Layout), from the figures the estimate prices (:mod:`.ledger`).  Each
        pipeline rank of the replicas priced alike (as :meth:`estimate` groups them) is
        one :class:`~autoplan.cost.ledger.DeviceLedger` standing for all their devices."""
        lay = self.layout(layout)
        recipe = self.precision_costs(lay.precision)
        act, grad, param = _ledger_dtypes(recipe)
        # (FP8 recipes: the FLOPs of their FP8 GEMMs are listed as fp8, _ledger_flops)
        matmul = "bf16" if _fp8_scaling(recipe.dtype) else recipe.dtype
        signatures: dict[tuple, list[int]] = {}
        runs = ((max(lay.replica_micro_batches),) * lay.dp if lay.padded
                else lay.replica_micro_batches)
        for r in range(lay.dp):
            sig = (tuple(self.device_of(self._replica_devices(lay, p, r)).name
                         for p in range(lay.pp)), runs[r],
                   tuple(self._placement(lay, p, r) for p in range(lay.pp)))
            signatures.setdefault(sig, []).append(r)
        world = tuple(sorted({i for devs in lay.rank_devices for i in devs}))
        out = []
        for replicas in signatures.values():
            r = replicas[0]
            for p in range(lay.pp):
                builder = LedgerBuilder(act, grad, param, matmul,
                                        fp8=_fp8_scaling(recipe.dtype) is not None)
                self._rank(lay, p, r, runs[r], recipe, builder)
                if self.options.step_loss_all_reduce and len(world) > 1:
                    builder.per_step("all_reduce", "world", "float64", LOSS_REDUCE_BYTES, 1,
                                     "loss")
                devices = tuple(sorted(d for q in replicas
                                       for d in self._replica_devices(lay, p, q)))
                out.append(builder.build(p, devices, runs[r]))
        return Ledger(tuple(out))

    def quick(self, layout) -> QuickEstimate:
        """Step time, peak memory and fit only (what a search loop needs)."""
        return self._evaluate(self.layout(layout), full=False)  # type: ignore[return-value]

    # ------------------------------------------------------------------ building blocks
    # What the search prices a layer with when it sets up an optimisation problem; the
    # engine itself prices layouts with them too.

    def precision_costs(self, precision: Precision) -> PrecisionCosts:
        """The compute dtype, bytes per parameter (weights, gradients, optimizer states),
        optimizer traffic per parameter and activation scale of a precision recipe
        (``profiles/cost/cost-model.yaml``; Rajbhandari et al. 2020, Sec. 3.1)."""
        hit = self._precision_costs.get(precision)
        if hit is None:
            opts = self.options
            problem = fp8_problem(precision, opts.fp8_library)
            if problem:
                raise ConfigError(problem)
            program = precision_program(precision, opts.grad_reduce_dtype)
            mixed = program.mixed
            param_bytes, grad_bytes, optimizer_bytes = self.constants.model_states.per_param(mixed)
            traffic = self.constants.optimizer
            accessed = (traffic.mixed_bytes_accessed_per_param if mixed
                        else traffic.fp32_bytes_accessed_per_param)
            fsdp2_master = mixed and opts.master_weights == "fsdp2" and not opts.autocast
            if mixed:
                # gradients are reduced, accumulated and read by the optimizer in the
                # stack's dtype (autoplan.precision)
                grad_bytes = program.grad_reduce_bytes
            if fsdp2_master:
                # the optimizer steps the fp32 parameters themselves: as fp32 does
                optimizer_bytes = self.constants.model_states.fp32_optimizer_bytes
                accessed = traffic.fp32_bytes_accessed_per_param
            hit = PrecisionCosts(_DTYPE[precision], param_bytes, grad_bytes, optimizer_bytes,
                                 accessed, precision.bytes / self.summary.activation_bytes,
                                 fsdp2_master)
            self._precision_costs[precision] = hit
        return hit

    def _fp8_linears(self, template: str) -> dict[str, "_fp8.Fp8Linear"]:
        """The linears of ``template`` whose GEMMs the options' FP8 library converts
        (:func:`autoplan.precision.fp8_converts`), by name."""
        key = (template, self.options.fp8_library)
        hit = self._fp8_cache.get(key)
        if hit is None:
            linears, _ = self.summary.linears[template]
            hit = self._fp8_cache[key] = _fp8.fp8_linears_of(linears, self.options.fp8_library)
        return hit

    def _fp8_terms(self, layer: LayerCost, seg: "Segment", recipe: PrecisionCosts,
                   shards: int) -> "_fp8.LayerFp8 | None":
        """torchao's FP8 terms of ``layer`` in segment ``seg`` over ``shards`` data-parallel
        ranks (:class:`autoplan.cost.fp8.LayerFp8`), or None: not an FP8 recipe, run by
        another library, or no linear of the layer converted."""
        scaling = _fp8_scaling(recipe.dtype)
        if scaling is None or self.options.fp8_library != "torchao":
            return None
        converted = self._fp8_linears(layer.template)
        if not converted:
            return None
        t = seg.tp
        gathered = 0.0
        if fp8_all_gather(recipe.dtype, seg.zero, shards):
            gathered = sum(math.prod(l.local(t)) for l in converted.values())
        linears, entries = self.summary.linears[layer.template]
        regions = frozenset(e for e in entries if e and _fp8.region_fp8(e, linears, converted))
        return _fp8.LayerFp8(converted, scaling, t, seg.sequence_parallel, gathered,
                             regions if _fp8.float8_tp("torchao", scaling, t) else frozenset(),
                             self.summary.seq_len or 1)

    def _fp8_step_scales(self, chunks, recipe: PrecisionCosts, groups: "_RankGroups",
                         ledger: LedgerBuilder | None) -> tuple[float, float]:
        """Seconds of the step's scale all-reduces of the weights torchao all-gathers in
        FP8 on a rank holding ``chunks`` (one per chunk over the data-parallel group, and one
        over the tensor-parallel group where it splits them too: 4 bytes a weight), and of
        reading those weights' shards for their maxima (``_foreach_norm``)."""
        shards = len(groups.dp)
        device = self.device_of(groups.replica)
        seconds = read = 0.0
        for chunk in chunks:
            weights, params = 0, 0.0
            for seg in chunk:
                for template, count in self.layer_counts(seg.lo, seg.hi):
                    fp8 = self._fp8_terms(self._templates[template], seg, recipe, shards)
                    if fp8 is not None and fp8.gathered_params:
                        weights += count * len(fp8.converted)
                        params += count * fp8.gathered_params
            if not weights:
                continue
            nbytes = weights * _fp8.SCALE_BYTES
            tp = chunk[0].tp
            seconds += self.collective_time("all_reduce", groups.dp, nbytes)
            if tp > 1:
                tp_group = groups.tp if tp == len(groups.tp) else groups.replica[:tp]
                seconds += self.collective_time("all_reduce", tp_group, nbytes)
            read += params / shards * DTYPE_BYTES["fp32"] / device.memory_bw_bytes_per_s
            if ledger is not None:
                ledger.per_step("all_reduce", "dp", "fp32", nbytes, 1, "fp8")
                if tp > 1:
                    ledger.per_step("all_reduce", "tp", "fp32", nbytes, 1, "fp8")
        return seconds, read

    def template(self, name: str) -> LayerCost:
        """The first layer of template ``name``; it stands for every layer of the template
        (they cost the same)."""
        return self._templates[name]

    def layer_counts(self, lo: int, hi: int) -> tuple[tuple[str, int], ...]:
        """``(template, count)`` of layers ``lo .. hi-1``, in order of first appearance."""
        key = (lo, hi)
        c = self._template_counts.get(key)
        if c is None:
            counts: dict[str, int] = {}
            for l in self.summary.layers[lo:hi]:
                counts[l.template] = counts.get(l.template, 0) + 1
            c = tuple(counts.items())
            self._template_counts[key] = c
        return c

    def model_compute_s(self, b: int, dtype: str = "fp32") -> tuple[float, float]:
        """Seconds of the whole model's forward and backward on one device (the first of
        the cluster) for a micro-batch of ``b`` sequences in ``dtype``: every layer's
        :meth:`template_time` without parallelism, recompute or communication."""
        device = self.device_of((0,))
        fwd = bwd = 0.0
        for template, count in self.layer_counts(0, len(self.summary.layers)):
            t = self.template_time(template, b, 1, 1, device, dtype)
            fwd += count * t.forward_s
            bwd += count * t.backward_s
        return fwd, bwd

    def model_host_s(self) -> tuple[float, float]:
        """The host seconds of the whole model's forward and backward on the first device
        of the cluster (a CPU's ``OpOverhead`` per dispatched operator and autograd node,
        unscaled; whatever the micro-batch), which :meth:`model_compute_s` includes; 0 on
        a device without them or whose host runs ahead (GPUs)."""
        device = self.device_of((0,))
        overhead = device.op_overhead
        if overhead is None or host_runs_ahead(device):
            return 0.0, 0.0
        fwd = bwd = 0.0
        for template, count in self.layer_counts(0, len(self.summary.layers)):
            host_fwd, host_bwd = _host_s(overhead, self._templates[template],
                                         self.summary.op_counts[template][0],
                                         self._host_counted)
            fwd += count * host_fwd
            bwd += count * host_bwd
        return fwd, bwd

    def device_of(self, devices: tuple[int, ...]):
        """The :class:`~autoplan.hardware.DeviceType` that prices work spread over
        ``devices``: the slowest among them (lowest bf16-or-best peak, then least memory)."""
        d = self._device_cache.get(devices)
        if d is None:
            types = {self.cluster.device_type_of(i).name: self.cluster.device_type_of(i)
                     for i in devices}
            d = min(types.values(), key=lambda t: (max(t.peak_flops_per_s.values()), t.memory_bytes))
            self._device_cache[devices] = d
        return d

    def collective_time(self, op: str, group: tuple[int, ...], nbytes: float,
                        concurrent: int | None = None, group_key: tuple | None = None, *,
                        after_compute: bool = True) -> float:
        """Seconds of collective ``op`` sending ``nbytes`` per rank over ``group``
        (:meth:`Cluster.collective_time <autoplan.hardware.Cluster.collective_time>`,
        cached); ``concurrent`` its ``concurrent_groups``.  ``group_key`` stands for a
        large ``group`` in the cache key (``(first device, size, hash)``: hashing the
        group once per rank, not per call); ``after_compute=False``: without the node's
        arrival cost.  Zero for one device or no bytes."""
        if len(group) <= 1 or nbytes <= 0:
            return 0.0
        key = (op, group if group_key is None else group_key, nbytes, concurrent, after_compute)
        t = self._collective_times.get(key)
        if t is None:
            t = self.cluster.collective_time(op, group, nbytes, concurrent_groups=concurrent,
                                             after_compute=after_compute)
            self._collective_times[key] = t
        return t

    def core_fraction(self, node: MatmulNode, cp: int) -> float:
        """The part of attention-core node ``node``'s captured FLOPs its kernel computes at
        context-parallel degree ``cp``.

        A causal kernel that skips the score blocks above the diagonal computes
        :data:`CAUSAL_BLOCK_FRACTION` of them (Dao 2023, FlashAttention-2, Sec. 3.1.1):
        the stack's fused kernel where it states one (``CostOptions.fused_attention``:
        FlashAttention or cuDNN, their ring attention under context parallelism skipping
        too), and a captured ``scaled_dot_product_attention`` of a causal model, which an
        eager step calls with ``is_causal`` and no mask (Hugging Face's SDPA attention and
        torch's, checked by the ledger).  Everything else computes every block: eager
        attention (its scores, then the mask), and under :mod:`autoplan.runtime.cp`'s
        context parallelism the captured kernel, handed an explicit mask of global
        positions over the gathered keys.
        """
        if not self.summary.causal:
            return 1.0
        if self.options.fused_attention or (node.fused and cp == 1):
            return CAUSAL_BLOCK_FRACTION
        return 1.0

    def template_flops(self, template: str, b: int, tp: int, cp: int,
                       fp8_only: bool = False) -> tuple[float, float, float]:
        """``(forward, backward, attention core forward)`` matmul FLOPs of one ``template``
        layer and micro-batch of ``b`` sequences on one device, as :meth:`template_time`
        prices them: sharded by tensor and context parallelism; the core as its kernel
        computes it (:meth:`core_fraction`), a fused kernel's backward recomputing its
        forward (the ledger's figures, :mod:`.ledger`).  ``fp8_only``: the part an FP8
        recipe runs in FP8 (its converted linears' GEMMs)."""
        fused = self.options.fused_attention
        experts = self._templates[template].num_experts
        token_split = tp if self.options.moe_tokens_split_over_tp else 1
        converted = self._fp8_linears(template) if fp8_only else {}
        banks = any(l.num_experts > 1 for l in converted.values())
        fwd = bwd = core = 0.0
        for n in self.summary.templates[template]:
            if fp8_only and (n.core or not (n.module in converted or (n.expert and banks))):
                continue
            div = (tp if n.sharded else 1) * cp
            if n.expert and experts > 1:
                div *= token_split
            f, g = n.fwd_flops * b / div, n.bwd_flops * b / div
            if n.fused:
                g = FUSED_BACKWARD_PRODUCTS * f
            if n.core:
                causal = self.core_fraction(n, cp)
                f, g = f * causal, g * causal
                core += f
                if fused:
                    g += f
            fwd += f
            bwd += g
        return fwd, bwd, core

    def _ledger_flops(self, ledger: LedgerBuilder, seg: Segment, b: int, cp: int,
                      ep: int) -> None:
        """The matmul FLOPs of segment ``seg``'s layers per micro-batch, into ``ledger``:
        forward, backward and what recompute runs again (a block's forward under full
        recompute, its attention core under selective, as :meth:`_layer_terms` prices)."""
        selective = seg.recompute is Recompute.SELECTIVE and not self.options.fused_attention
        fp8 = ledger.fp8
        for l in self.summary.layers[seg.lo:seg.hi]:
            fwd, bwd, core = self.template_flops(l.template, b, seg.tp, cp)
            rc = 0.0
            if l.is_block and seg.recompute is Recompute.FULL:
                rc = fwd
            elif l.is_block and selective:
                rc = core
            if fp8:
                # an FP8 recipe's converted GEMMs, apart from the rest (bf16)
                f8, b8, _ = self.template_flops(l.template, b, seg.tp, cp, fp8_only=True)
                r8 = f8 if l.is_block and seg.recompute is Recompute.FULL else 0.0
                ledger.flops(l.name, f8, b8, r8, dtype="fp8")
                fwd, bwd, rc = fwd - f8, bwd - b8, rc - r8
            ledger.flops(l.name, fwd, bwd, rc)

    def template_time(self, template: str, b: int, tp: int, cp: int, device, dtype: str,
                      sp: bool = False, ep: int = 1) -> LayerTime:
        """Compute seconds of one ``template`` layer and micro-batch of ``b`` sequences on
        one ``device`` (:meth:`device_of`) in ``dtype`` (:attr:`PrecisionCosts.dtype`),
        under tensor (``tp``, sequence parallel ``sp``), context (``cp``) and expert
        (``ep``) parallelism, without recompute or communication.

        Each FLOP-carrying node: ``flops / (peak * efficiency(flops))`` on one device;
        each memory-bound node: the bytes it reads and writes over the device's memory
        bandwidth and, in the backward, the bytes its derivative moves on a CPU
        (``GraphSummary.elementwise_backward``) and :data:`ELEMENTWISE_BACKWARD_FACTOR`
        times the forward's on a GPU, or at the device's measured speed for its kind
        (``elementwise_rates``).
        An expert bank's GEMMs run one expert at a time: the efficiency is that of one
        expert's GEMM, ``ep x tokens x top-k / experts`` rows (this rank's local
        experts take the tokens of its ``ep`` group), and under expert parallelism the
        busiest rank runs ``expert_imbalance`` times the mean load.
        """
        fused = self.options.fused_attention
        key = (template, b, tp, cp, device.name, dtype, fused, sp, ep,
               self.options.attention_kernel)
        hit = self._template_times.get(key)
        if hit is not None:
            return hit
        scaling = _fp8_scaling(dtype)
        fp8 = scaling is not None
        if fp8:
            # the GEMMs of the linears the recipe converts in FP8, the rest in bf16, and
            # their operands quantized as the library does (autoplan.cost.fp8)
            dtype = "bf16"
            library = self.options.fp8_library
            converted = self._fp8_linears(template)
            tokens = b * (self.summary.seq_len or 1) / cp
            cast_fwd = cast_bwd = 0.0
            for lin in converted.values():
                if lin.num_experts == 1:
                    f8, b8 = _fp8.cast_bytes(lin, library, scaling, tokens=tokens, tp=tp)
                    cast_fwd, cast_bwd = cast_fwd + f8, cast_bwd + b8
            rowwise = library == "torchao" and scaling == "row"
        # fp32 matmuls on TF32 tensor cores where asked (CostOptions.fp32_matmuls); the
        # elementwise bytes stay the recipe's
        mm = "tf32" if dtype == "fp32" and self.options.fp32_matmuls == "tf32" else dtype
        peak = device.peak(mm)
        fwd = bwd = core = wgrad = 0.0
        # fused-attention kernels (the stack's, or a captured SDPA call) at their own speed
        attention = self._attention_tables.get(device.name)
        experts = self._templates[template].num_experts
        imbalance = self.options.expert_imbalance if ep > 1 else 1.0
        grouped = self.options.expert_grouped_gemm
        token_split = tp if self.options.moe_tokens_split_over_tp else 1
        converted_experts = fp8 and any(l.num_experts > 1 for l in converted.values())
        for n in self.summary.templates[template]:
            div = (tp if n.sharded else 1) * cp
            if n.expert and experts > 1:
                div *= token_split                       # this tp rank's tokens only
            f = n.fwd_flops * b / div
            g = n.bwd_flops * b / div
            if n.fused:
                g = FUSED_BACKWARD_PRODUCTS * f
            ref = f if f > 0 else g / 2
            if ref <= 0:
                continue
            grouped_eff = None
            if n.expert and experts > 1:
                f, g = f * imbalance, g * imbalance
                if grouped:
                    # a measured grouped GEMM, by the FLOPs of one expert's part of it
                    grouped_eff = device.grouped_efficiency(
                        ref * imbalance * ep / experts, "bf16" if fp8 else dtype)
                # one GEMM over all local experts' rows, or one expert's GEMM each
                ref = ref * imbalance * (1 if grouped else ep / experts)
            rate_backward = None
            # an FP8 recipe's converted GEMM (a TE expert bank's grouped FP8 GEMM included)
            fp8_gemm = fp8 and not n.core and (n.module in converted or
                                               (n.expert and experts > 1 and converted_experts))
            if grouped_eff is not None and not fp8_gemm:
                rate = peak * grouped_eff
            elif n.core and (fused or n.fused) and attention is not None:
                # the table is by the FLOPs of one QK^T product: a captured kernel's
                # forward counts two (scores and values)
                rate = peak * attention.efficiency(ref / 2 if n.fused else ref)
            elif fp8_gemm:
                rate = _fp8.fp8_gemm_rate(device, ref, rowwise=rowwise)
                rate_backward = _fp8.fp8_gemm_rate(device, ref)
                if n.expert:
                    # an expert bank's GEMM (Transformer Engine's grouped FP8 GEMM): its
                    # routed rows, ~ m sqrt(kn) of inputs and of gradients, and its weights
                    kn = f / (2 * tokens)
                    per = _fp8.TE_CAST_BYTES[scaling]
                    cast_fwd += per * (tokens * math.sqrt(kn) + kn)
                    cast_bwd += per * tokens * math.sqrt(kn)
            else:
                rate = peak * device.efficiency(ref, mm)
            tf, tb = f / rate, g / (rate_backward or rate)
            if n.core:
                causal = self.core_fraction(n, cp)
                tf *= causal
                tb *= causal
                core += tf
                if fused or n.fused:
                    tb += tf  # the kernel's backward recomputes the scores (Dao et al. 2022)
            if n.weight:
                wgrad += tb / 2
            fwd += tf
            bwd += tb
        # memory-bound operators (norms, activations, softmax, adds): bytes / bandwidth
        rep, shd, quad = self.summary.elementwise[template]
        if fused:
            quad = 0.0      # inside the attention kernel
        # captured bytes are in the graph's activation dtype; the recipe's dtype moves,
        # fp32 under autocast (CostOptions.autocast)
        autocast = self.options.autocast and dtype != "fp32"
        ew_bytes = Precision.FP32.bytes if autocast else Precision(dtype).bytes
        act_scale = ew_bytes / self.summary.activation_bytes

        def rank_bytes(r: float, s: float, q: float) -> float:
            """This rank's bytes of a micro-batch of (replicated, sharded, quadratic)."""
            return (r / (tp if sp else 1) + (s + q) / tp) * b / cp * act_scale

        moved = rank_bytes(rep, shd, quad)
        ew = moved / device.memory_bw_bytes_per_s
        if not host_runs_ahead(device):
            # where the host is the device (CPUs): the backward's bytes as each operator's
            # derivative moves them, a dropout of probability 0 free (summary)
            r_rep, r_shd, r_quad = self.summary.elementwise_returned[template]
            fwd += ew - rank_bytes(r_rep, r_shd, 0.0 if fused else r_quad) \
                / device.memory_bw_bytes_per_s
            b_rep, b_shd, b_quad = self.summary.elementwise_backward[template]
            bwd += rank_bytes(b_rep, b_shd, 0.0 if fused else b_quad) \
                / device.memory_bw_bytes_per_s
        else:
            # GPUs: twice the forward's bytes (ELEMENTWISE_BACKWARD_FACTOR)
            fwd += ew
            bwd += ELEMENTWISE_BACKWARD_FACTOR * ew
        rates = device.elementwise_rates
        if rates is not None:
            # kinds the profile timed apart (a CPU's GELU, a GPU's broadcasts...): at their
            # own speed, in place of the copy bandwidth's
            for kind, (k_rep, k_shd, k_quad) in self.summary.elementwise_kinds[template].items():
                if fused:
                    k_quad = 0.0
                k_moved = rank_bytes(k_rep, k_shd, k_quad)
                own = rates.seconds(kind, k_moved)
                if own is None:
                    continue
                copy = k_moved / device.memory_bw_bytes_per_s
                fwd += own[0] - copy
                bwd += own[1] - ELEMENTWISE_BACKWARD_FACTOR * copy
                if k_quad:   # the attention core's part
                    q_moved = rank_bytes(0.0, 0.0, k_quad)
                    core += (q_moved / rates.forward_bytes_per_s[kind]
                             - q_moved / device.memory_bw_bytes_per_s)
        if autocast:
            # the weights cast down in the forward, their gradients up in the backward
            local = sum(_local_params(self._templates[template], tp, ep))
            fwd += AUTOCAST_CAST_BYTES * local / device.memory_bw_bytes_per_s
            bwd += AUTOCAST_CAST_BYTES * local / device.memory_bw_bytes_per_s
        if fp8:
            # FP8 quantization kernels: memory-bound
            fwd += cast_fwd / device.memory_bw_bytes_per_s
            bwd += cast_bwd / device.memory_bw_bytes_per_s
        core += rank_bytes(0.0, 0.0, quad) / device.memory_bw_bytes_per_s  # softmax, mask
        overhead = device.op_overhead
        if overhead is not None and not host_runs_ahead(device):
            # the host's dispatch per operator, whatever the micro-batch (CPU devices)
            ops, tp_linears, tp_shared = self.summary.op_counts[template]
            host_fwd, host_bwd = _host_s(overhead, self._templates[template], ops,
                                         self._host_counted)
            fwd += host_fwd
            bwd += host_bwd
            if overhead.layer_forward_scale is not None:
                # the layer whole against its parts as priced, measured on a reference
                # stack of blocks at two micro-batches: the arithmetic by the layer scales,
                # the host work by its own where measured (OpOverhead.host_forward_scale)
                scale_fwd, scale_bwd = overhead.layer_forward_scale, overhead.layer_backward_scale
                assert scale_bwd is not None
                host_scale_fwd, host_scale_bwd = (
                    (overhead.host_forward_scale, overhead.host_backward_scale)
                    if overhead.host_forward_scale is not None else (scale_fwd, scale_bwd))
                assert host_scale_bwd is not None
                fwd = (fwd - host_fwd) * scale_fwd + host_fwd * host_scale_fwd
                bwd = (bwd - host_bwd) * scale_bwd + host_bwd * host_scale_bwd
                core, wgrad = core * scale_fwd, wgrad * scale_bwd
            if tp > 1:
                # a column linear sharing its region's input pays its own matmul's DTensor
                # work, not the region's wrapping and gradient reduction (OpOverhead)
                tp_fwd, tp_bwd = overhead.tp_linears_s(tp_linears, tp_shared)
                fwd += tp_fwd
                bwd += tp_bwd
        hit = LayerTime(fwd, bwd, core, wgrad)
        self._template_times[key] = hit
        return hit

    def activation_bytes(self, layer: LayerCost, tp: int, sp: bool, recompute: Recompute,
                         cp: int) -> float:
        """Activation bytes one layer saves for its backward per sequence, in the graph's
        activation dtype (Korthikanti et al. 2022, Sec. 4;
        :func:`autoplan.cost.memory.activation_bytes` with this engine's fused attention)."""
        return activation_bytes(layer, tp=tp, sequence_parallel=sp, recompute=recompute, cp=cp,
                                fused_attention=self.options.fused_attention)

    # ------------------------------------------------------------------ helpers
    def _loss_reduce_s(self, lay: Layout) -> float:
        """Seconds of the step's closing all-reduce of its mean loss over every rank of
        the layout (:attr:`CostOptions.step_loss_all_reduce`): two float64 numbers."""
        devices = tuple(sorted({i for devs in lay.rank_devices for i in devs}))
        return self.collective_time("all_reduce", devices, LOSS_REDUCE_BYTES,
                                    group_key=("world", devices[0], len(devices),
                                               hash(devices)))

    def _shared_cores(self, lay: Layout) -> tuple[int, int] | None:
        """``(ranks, cores)`` when the layout's ranks outnumber the cores they share: a
        one-node cluster whose node has ``shared_cores`` (CPU ranks measured all busy at
        once, :class:`~autoplan.hardware.NodeSpec`); ``None`` otherwise."""
        if len(self.cluster.nodes) != 1:
            return None
        cores = self.cluster.profile_of(0).node.shared_cores
        if cores is None:
            return None
        ranks = sum(len(devices) for devices in lay.rank_devices)
        return (ranks, cores) if cores < ranks else None

    def _node_devices(self, device: int) -> int:
        """Devices on the node of ``device``."""
        return self.cluster.profile_of(device).node.devices_per_node

    def _dp_concurrency(self, group: tuple[int, ...]) -> int | None:
        """``concurrent_groups`` for data-parallel collectives (see ``dp_nic_per_device``)."""
        if not self.options.dp_nic_per_device:
            return None
        return self._node_devices(group[0])

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, lay: Layout, full: bool):
        s = self.summary
        opts = self.options
        recipe = self.precision_costs(lay.precision)
        pp, v, cp = lay.pp, lay.virtual_stages, lay.cp
        if len(lay.chunks) != pp * v:
            raise StrategyError(f"layout has {len(lay.chunks)} chunks for pp={pp} x v={v}")
        if cp > 1 and s.kv_bytes_per_token is None:
            raise ConfigError("context parallelism needs the model's hidden size and heads "
                              "(graph.attributes) to size the key/value exchange")
        if cp > 1 and s.seq_len is None:
            raise ConfigError("context parallelism needs a sequence length")

        # replicas with the same device types and micro-batch count cost the same
        signatures: dict[tuple, int] = {}
        runs = ((max(lay.replica_micro_batches),) * lay.dp if lay.padded
                else lay.replica_micro_batches)
        # (and the same placement: a replica whose groups straddle two NVLink domains is
        # priced apart from those inside one, and the slowest sets the step)
        alike = self._replicas_alike(lay)
        if self.homogeneous and len(set(runs)) == 1 and alike:
            signatures[()] = 0
        else:
            for r in range(lay.dp):
                sig = (tuple(self.device_of(self._replica_devices(lay, p, r)).name
                             for p in range(pp)), runs[r],
                       () if alike else tuple(self._placement(lay, p, r) for p in range(pp)))
                signatures.setdefault(sig, r)

        shared = self._shared_cores(lay) if pp > 1 else None
        best = None
        for sig, r in signatures.items():
            m = runs[r]
            ranks = [self._rank(lay, p, r, m, recipe) for p in range(pp)]
            times = [rk.per_micro_batch for rk in ranks]
            crit = max(range(pp), key=lambda p: times[p])
            zb_excess = 0.0
            if lay.schedule is Schedule.ZERO_BUBBLE:
                c = ranks[crit]
                zb_excess = max(0.0, c.fwd + (c.bwd - c.wgrad) - 2 * c.wgrad)
            t_pipe = pipeline_time(lay.schedule, times, m, virtual_stages=v, zb_excess_s=zb_excess)
            if shared is not None:
                # ranks sharing fewer cores: while a rank waits in the pipeline's bubble
                # the others run faster than measured (every rank busy at once).  The
                # step is bounded by the critical path at a whole core's speed and by
                # the busiest rank's work at the speed of the ranks that can run at once:
                # every rank where the pipeline fills (m >= pp); with fewer micro-batches
                # than stages only m stages ever run at once, and their ranks share the
                # cores with no others (one micro-batch: one stage's ranks, a core each
                # where they are no more than the cores).  (That bound at every rank's
                # speed whatever m: the four stored confirm passes of the 2-core AMD VM
                # re-priced read 268 of 324 runs within 15% against 278; all 22 stored
                # passes 1691 of 1782 against 1692, the Xeon's one-micro-batch ZeRO-2/3
                # pipelines measuring slower than either prices, 2026-11-28.  The total
                # work over the ranks, m x the ranks' mean, never exceeds the bound at
                # every rank's speed, which is pessimistic where the others idle and
                # lend the busiest rank their cores, but it offsets what the pipelines
                # leave unpriced: bounded by the total work instead, five confirm passes'
                # runs re-priced read 65, 70, 76, 55 and 68 of 81 within 15%, against
                # 60, 74, 72, 70 and 78, 2026-11-26.)  The exposed tensor, context and
                # expert-parallel collectives inside a stage's micro-batch are not CPU
                # work alone: their waits take as long with the other ranks idle, so the
                # critical path speeds up by the cores only over the rest of its time
                # (the critical rank's share; thirteen stored passes re-priced, FSDP2's
                # figures written into the older profiles: the one-micro-batch tp2 pp2 and
                # pp2 cp2 pipelines from 10% fast on average to within 8%, 1038 of 1053
                # within 15% to 1042, 2026-11-27)
                # Context parallelism's waits for the peers' turns on the cores
                # (OpOverhead.cp_gather_call_s) are paid only while the other ranks
                # compute: not on the critical path where they idle, but in the busiest
                # rank's work.
                ranks_on_node, cores = shared
                c = ranks[crit]
                alone, t_alone = times, t_pipe
                if any(rk.cp_waits for rk in ranks):
                    alone = [t - rk.cp_waits for t, rk in zip(times, ranks)]
                    t_alone = pipeline_time(lay.schedule, alone, m, virtual_stages=v,
                                            zb_excess_s=zb_excess)
                waits = min(1.0, (c.tp_exposed + c.cp_exposed - c.cp_waits + c.ep_exposed)
                            / alone[crit]) if alone[crit] > 0 else 0.0
                time_share = cores / ranks_on_node + (1 - cores / ranks_on_node) * waits
                busy = ranks_on_node * min(m, pp) / pp
                t_pipe = max(t_alone * time_share,
                             m * max(times) * max(cores, busy) / ranks_on_node)
            # rank p finishes its last backward sum_{q<p} B_q before rank 0 (1F1B drain)
            tail, slack, tail_rank, hidden = 0.0, 0.0, 0, 0.0
            for p, rk in enumerate(ranks):
                t = max(0.0, rk.dp_step_exposed - slack) + rk.optimizer
                if t > tail:
                    tail, tail_rank = t, p
                hidden += min(rk.dp_step_exposed, slack)
                slack += rk.bwd
            shared_cost = 0.0
            if shared is not None:
                # ranks sharing fewer cores: a later stage's reduction under an earlier
                # stage's backward is hidden from the step but not from the cores.  While
                # it runs, the earlier stage's ranks compute at the every-rank-busy speed
                # rather than at a whole core's each (the pipeline bound above), so the
                # step pays its seconds times the share of the speed they lose
                ranks_on_node, cores = shared
                shared_cost = hidden * (1 - cores / ranks_on_node)
            step = t_pipe + tail + shared_cost
            if best is None or step > best[0]:
                best = (step, m, ranks, crit, t_pipe, tail_rank, shared_cost)
        assert best is not None
        step, m, ranks, crit, t_pipe, tail_rank, shared_cost = best
        loss_reduce = self._loss_reduce_s(lay) if opts.step_loss_all_reduce else 0.0
        step += loss_reduce

        # memory of every rank of every replica signature: the fullest decides
        peak = 0.0
        fits = True
        for rk in ranks:
            assert rk.memory is not None
            total = rk.memory.total_bytes
            peak = max(peak, total)
            fits &= total <= rk.capacity * opts.memory_fraction
        if len(signatures) > 1:
            for sig, r in signatures.items():
                rm = runs[r]
                for p in range(pp):
                    rk = self._rank(lay, p, r, rm, recipe)
                    assert rk.memory is not None
                    peak = max(peak, rk.memory.total_bytes)
                    fits &= rk.memory.total_bytes <= rk.capacity * opts.memory_fraction
        if not full:
            return QuickEstimate(step, peak, bool(fits))

        # ---------------------------------------------------------------- records
        c = ranks[crit]
        tr = ranks[tail_rank]
        slack_before = sum(rk.bwd for rk in ranks[:tail_rank])
        step_exp = max(0.0, tr.dp_step_exposed - slack_before)
        tp_step_exp = min(tr.tp_step, step_exp)
        dp_step_exp = step_exp - tp_step_exp
        breakdown = {
            "compute_s": m * (c.fwd_compute + c.bwd_compute),
            "recompute_s": m * c.recompute,
            "tp_comm_s": m * c.tp_exposed + tp_step_exp,
            "cp_comm_s": m * c.cp_exposed,
            "ep_comm_s": m * c.ep_exposed,
            "dp_comm_s": m * c.zero_exposed + dp_step_exp + shared_cost + loss_reduce,
            "pp_comm_s": m * c.p2p,
            "bubble_s": t_pipe - m * c.per_micro_batch,
            "optimizer_s": tr.optimizer,
        }
        breakdown = {k: breakdown[k] for k in BREAKDOWN_KEYS}
        comm_total = {
            "tp_comm_s": m * c.tp_total + tr.tp_step, "cp_comm_s": m * c.cp_total,
            "ep_comm_s": m * c.ep_total,
            "dp_comm_s": m * c.zero_total + tr.dp_step_total - tr.tp_step + loss_reduce,
            "pp_comm_s": m * c.p2p,
        }
        seq = s.seq_len or 1
        tokens = lay.global_batch * seq
        model_flops = sum(l.fwd_flops + l.bwd_flops for l in s.layers) * lay.global_batch
        rc_flops = 0.0
        for chunk in lay.chunks:
            for seg in chunk:
                if seg.recompute is Recompute.FULL:
                    rc_flops += s.total("fwd_flops", seg.lo, seg.hi)
                elif seg.recompute is Recompute.SELECTIVE and not opts.fused_attention:
                    rc_flops += s.total("selective_flops", seg.lo, seg.hi)
        hw_flops = model_flops + rc_flops * lay.global_batch
        n_dev = sum(len(d) for d in lay.rank_devices)
        # MFU against the 16-bit peak also for FP8 (as Megatron-Bridge and NeMo report it)
        peak_sum = sum(self.cluster.device_type_of(i).peak("bf16" if _fp8_scaling(recipe.dtype)
                                                           else recipe.dtype)
                       for devs in lay.rank_devices for i in devs)
        stages = tuple(StageEstimate(
            rank=p, device_type=rk.device_type, layers=rk.layers,
            micro_batches_in_flight=rk.in_flight, forward_s=rk.fwd, backward_s=rk.bwd,
            busy_s=m * rk.per_micro_batch + rk.optimizer,
            dp_comm_exposed_s=rk.dp_step_exposed, memory=rk.memory,  # type: ignore[arg-type]
            memory_capacity_bytes=rk.capacity, weight_grad_s=rk.wgrad,
            fits=rk.memory.total_bytes <= rk.capacity * opts.memory_fraction)  # type: ignore[union-attr]
            for p, rk in enumerate(ranks))
        notes = []
        if len(signatures) > 1:
            notes.append(f"{len(signatures)} kinds of replica; the slowest sets the step")
        if not alike:
            notes.append("the tensor-, context- or expert-parallel groups of some replicas "
                         "straddle two nodes (NVLink domains): theirs are priced over the "
                         "inter-node network; groups that tile every node's devices avoid it")
        return Estimate(
            step_time_s=step, breakdown=breakdown, comm_total=comm_total, tokens_per_step=tokens,
            tokens_per_s=tokens / step, model_flops_per_step=model_flops,
            hardware_flops_per_step=hw_flops, model_tflops_per_gpu=model_flops / step / n_dev / 1e12,
            mfu=model_flops / step / peak_sum, hfu=hw_flops / step / peak_sum, num_devices=n_dev,
            stages=stages, peak_memory_bytes=peak, fits=bool(fits),
            memory_fraction=opts.memory_fraction, notes=tuple(notes))

    def _layer_terms(self, layer: LayerCost, seg: Segment, b: int, cp: int, device,
                     recipe: PrecisionCosts, groups: _RankGroups, ep: int = 1,
                     volumes: list | None = None) -> _LayerTerms:
        """Everything one layer of segment ``seg`` adds to its rank per micro-batch of
        ``b`` sequences on ``device`` (see the module docstring), its collectives over
        ``groups``.  ``volumes``: a list to append the collectives priced to, as
        ``(kind, group, dtype, bytes, calls, term)`` per micro-batch (:mod:`.ledger`)."""
        vol = volumes.append if volumes is not None else _no_volume
        act_dtype, grad_dtype, param_dtype = _ledger_dtypes(recipe)
        rc_full = seg.recompute is Recompute.FULL and layer.is_block
        s = self.summary
        opts = self.options
        t = seg.tp
        act_scale = recipe.activation_scale
        layer_time = self.template_time(layer.template, b, t, cp, device, recipe.dtype,
                                        seg.sequence_parallel, ep if layer.expert_params else 1)
        forward, backward = layer_time.forward_s, layer_time.backward_s
        # an FP8 recipe that torchao runs: its FP8 all-gathers under ZeRO-3 replace the
        # GEMMs' weight casts by each rank's cast of its shard (autoplan.cost.fp8)
        fp8 = self._fp8_terms(layer, seg, recipe, len(groups.dp))
        if fp8 is not None and fp8.gathered_params:
            forward -= fp8.weight_cast_s(device) / 2
            backward -= fp8.weight_cast_s(device) / 2
        core = layer_time.core_forward_s
        recompute = 0.0
        overhead = device.op_overhead
        ahead = overhead is not None and host_runs_ahead(device)
        selective = (seg.recompute is Recompute.SELECTIVE and layer.is_block
                     and not opts.fused_attention)
        # the bytes the block saves without recompute, for selective checkpointing's host
        unselected = (self.activation_bytes(layer, t, seg.sequence_parallel, Recompute.NONE, cp)
                      * b * act_scale if selective and overhead is not None else 0.0)
        if seg.recompute is Recompute.FULL and layer.is_block:
            recompute = forward
        elif selective:
            recompute = core
            if overhead is not None and not ahead:
                recompute += _selective_dispatch_s(overhead, layer,
                                                   s.op_counts[layer.template][0], unselected)
        if ahead:
            # a GPU's host dispatches ahead of it: each direction takes the longer of the
            # device's work and the host's (recompute and selective checkpointing's Python
            # mode included), the excess counted as recompute in the backward
            ops = s.op_counts[layer.template][0]
            host_fwd, host_bwd = _host_s(overhead, layer, ops, self._host_counted)
            if seg.recompute is Recompute.FULL and layer.is_block:
                host_bwd += host_fwd
            elif selective:
                host_bwd += _selective_dispatch_s(overhead, layer, ops, unselected)
            forward = max(forward, host_fwd)
            recompute = max(backward + recompute, host_bwd) - backward
        # tensor-parallel collectives of one layer
        tp_forward = tp_backward = 0.0
        if t > 1:
            tp_group = groups.tp if t == len(groups.tp) else groups.replica[:t]
            colls = layer.sp_collectives if seg.sequence_parallel else layer.tp_collectives
            # a device that prices tensor-parallel linears' host time (CPU profiles) measured
            # it with the linears' own collectives on pairs of ranks, every pair at once
            # where they share cores, as the main thread's core time at every-rank-busy
            # speed: a rank waiting there for its peer lends its core to ranks at work, so
            # the link model's arrival cost is not added (three confirm passes re-priced at
            # 3 ms per linear with it added: 69, 66 and 78 of 81 within 15%, against 77, 64
            # and 77 without, 2026-11-26)
            host = device.op_overhead
            waits_priced = (host is not None and not host_runs_ahead(device)
                            and (host.tp_linear_forward_s > 0 or host.tp_linear_backward_s > 0))
            # and its host work that grows with the payload (OpOverhead.tp_collective_byte_s)
            per_byte = host.tp_collective_byte_s if host is not None and waits_priced else 0.0
            embedding_all_reduce = (seg.sequence_parallel and layer.kind is LayerKind.PRE
                                    and opts.sp_embedding_all_reduce)
            for i, (op, phase, nbytes) in enumerate(colls):
                if embedding_all_reduce and op == "reduce_scatter" and phase == "forward":
                    # the vocab-parallel embedding's partial sums all-reduced whole, each
                    # rank then keeping its sequence shard (CostOptions.sp_embedding_all_reduce)
                    op = "all_reduce"
                payload = nbytes * b * act_scale / cp
                dtype = act_dtype
                if (fp8 is not None and seg.sequence_parallel and op == "all_gather"
                        and fp8.gathers_fp8(layer, i, phase)):
                    # torchao's float8 styles gather this activation (gradient) in FP8
                    payload, dtype = payload * DTYPE_BYTES["fp8"] / DTYPE_BYTES[act_dtype], "fp8"
                seconds = (self.collective_time(op, tp_group, payload,
                                                after_compute=not waits_priced)
                           + per_byte * payload)
                # (the recomputed forward runs its collectives again, below)
                vol((op, "tp", dtype, payload,
                     2 if rc_full and phase == "forward" else 1, "tp"))
                if phase == "forward":
                    tp_forward += seconds
                else:
                    tp_backward += seconds
            if layer.index == len(s.layers) - 1 and s.loss_logits:
                # the loss over the head's vocabulary-sharded logits: three all-reduces of
                # one fp32 number per token (max, sum of exponentials, the target's logit;
                # torch's loss_parallel, Megatron's vocab-parallel cross-entropy), or the
                # logits gathered whole on every rank
                tokens = b * (s.seq_len or 1) / cp
                if opts.loss_parallel:
                    if s.loss_shifts and cp == 1:
                        tokens -= b         # the last token of a sequence predicts nothing
                    nbytes = tokens * LOSS_PARALLEL_BYTES
                    tp_forward += LOSS_PARALLEL_REDUCES * self.collective_time(
                        "all_reduce", tp_group, nbytes, after_compute=not waits_priced)
                    vol(("all_reduce", "tp", "fp32", nbytes, LOSS_PARALLEL_REDUCES, "tp"))
                else:
                    nbytes = tokens * s.loss_logits * s.activation_bytes * act_scale
                    tp_forward += self.collective_time("all_gather", tp_group, nbytes,
                                                       after_compute=not waits_priced)
                    vol(("all_gather", "tp", act_dtype, nbytes, 1, "tp"))
            if fp8 is not None:
                # torchao's scale all-reduces over the tp group (autoplan.cost.fp8)
                for phase, nbytes, n in fp8.amax_reduces(b, cp):
                    seconds = n * self.collective_time("all_reduce", tp_group, nbytes,
                                                       after_compute=not waits_priced)
                    vol(("all_reduce", "tp", "float64", nbytes,
                         n * (2 if rc_full and phase == "forward" else 1), "fp8"))
                    if phase == "forward":
                        tp_forward += seconds
                    else:
                        tp_backward += seconds
        if seg.recompute is Recompute.FULL and layer.is_block:
            tp_backward += tp_forward   # the recomputed forward runs its collectives again
        if opts.tp_comm_overlap:
            tp_forward_exposed = max(0.0, tp_forward - forward)
            tp_backward_exposed = max(0.0, tp_backward - backward - recompute)
        else:
            tp_forward_exposed, tp_backward_exposed = tp_forward, tp_backward
        # context parallelism: all-gather of the block's keys/values (this rank's heads,
        # whole sequences) in the forward, reduce-scatter of their gradients in the
        # backward; the attention core depends on them, so they are exposed
        cp_forward = cp_backward = cp_exposed = cp_waits = 0.0
        if cp > 1 and core > 0 and layer.is_block:
            kv_bytes = s.kv_bytes_per_token * act_scale * s.seq_len * b / t  # type: ignore[operator]
            # and the runtime's copies around them (autoplan.runtime.cp.gather_sequence),
            # memory-bound, read + write: forward, the local keys and values stacked and the
            # gathered ones put in position order; backward, the gradients of keys and
            # values stacked and put back in the gathered layout for the reduce-scatter
            bw = device.memory_bw_bytes_per_s
            cp_forward = (self.collective_time("all_gather", groups.cp, kv_bytes)
                          + (2 * kv_bytes / cp + 2 * kv_bytes) / bw)
            cp_backward = (self.collective_time("reduce_scatter", groups.cp, kv_bytes)
                           + 4 * kv_bytes / bw)
            vol(("all_gather", "cp", act_dtype, kv_bytes, 2 if rc_full else 1, "cp"))
            vol(("reduce_scatter", "cp", act_dtype, kv_bytes, 1, "cp"))
            gather_waits = scatter_waits = 0.0
            if (overhead is not None and not ahead and overhead.cp_measured
                    and len(groups.cp) < self._node_devices(groups.cp[0])):
                # where ranks share cores, a collective between compute waits for its peers
                # to be scheduled while the node's other ranks compute: what a step pays
                # beyond the back-to-back time, measured in place on pairs of ranks
                # (OpOverhead.cp_gather_call_s).  Not where the group holds every rank of
                # the node: none computes meanwhile.  (The 18 stored confirm passes of
                # 2026-11-27/28, re-priced with the figures measured on 2026-11-28
                # written into their profiles: the layouts of cp = 4 on 4 ranks 4-6% fast
                # on average without them, 3-10% slow with them; those of cp pairs 4-12%
                # fast without them, -2% to +5% with them but tp2 cp2 5-8% fast.)
                gather_waits, scatter_waits = overhead.cp_collectives_s(kv_bytes)
            cp_forward += gather_waits
            cp_backward += scatter_waits
            cp_waits = gather_waits + scatter_waits
            if seg.recompute is Recompute.FULL:
                cp_backward += cp_forward   # the recomputed forward gathers again
                cp_waits += gather_waits
            cp_exposed = cp_forward + cp_backward
        # expert parallelism: the token dispatch and combine all-to-alls over the ep group
        # in the forward, their transposes in the backward (again under full recompute);
        # blocking, so exposed
        ep_forward = ep_backward = 0.0
        if ep > 1 and layer.expert_tokens:
            combine = self.dispatch_bytes(layer, b, cp, act_scale, t, groups.ep)
            dispatch = combine + self.routing_weight_bytes(layer, b, cp, act_scale, t, groups.ep)
            counts = layer.num_experts * COUNT_BYTES
            ep_forward = (self.collective_time("all_to_all", groups.ep, dispatch)
                          + self.collective_time("all_to_all", groups.ep, combine)
                          + self.collective_time("all_to_all", groups.ep, counts))
            ep_backward = (self.collective_time("all_to_all", groups.ep, dispatch)
                           + self.collective_time("all_to_all", groups.ep, combine))
            if rc_full:
                ep_backward += ep_forward   # the recomputed forward dispatches again
            runs = 2 if rc_full else 1
            vol(("all_to_all", "ep", act_dtype, dispatch, runs + 1, "ep"))
            vol(("all_to_all", "ep", act_dtype, combine, runs + 1, "ep"))
            vol(("all_to_all", "ep", "int64", counts, runs, "ep"))
        # ZeRO: parameters of this layer on this device (the expert banks' 1/ep of them
        # are sharded over the ep-replicas of the same experts, edp = dp x cp / ep)
        local_params, local_expert_params = _local_params(layer, t, ep)
        if opts.zero3_gather_unit == "module":
            gather_unit = _largest_module_local(layer, t, ep)
        else:
            gather_unit = local_params + local_expert_params
        forward_with_comm = forward + tp_forward_exposed + cp_forward + ep_forward
        backward_with_comm = backward + recompute + tp_backward_exposed + cp_backward + ep_backward
        zero_forward_exposed = zero_backward_exposed = zero_total = 0.0
        zero_degree = len(groups.dp)
        if seg.zero >= 2 and zero_degree > 1 and local_params + local_expert_params > 0:
            dp, edp, concurrent = groups.dp, groups.edp, groups.dp_concurrency
            grads = local_params * recipe.grad_bytes            # reduce-scattered
            expert_grads = local_expert_params * recipe.grad_bytes
            weights = local_params * recipe.param_bytes         # all-gathered (ZeRO-3)
            expert_weights = local_expert_params * recipe.param_bytes
            gather_dtype = param_dtype
            if fp8 is not None and fp8.gathered_params:
                # torchao's FP8 all-gather: the converted weights at one byte, the rest of
                # the unit with them (one byte buffer where dtypes mix)
                weights -= fp8.gathered_params * (recipe.param_bytes - DTYPE_BYTES["fp8"])
                gather_dtype = "uint8" if fp8.gathered_params < local_params else "fp8"
            reduce_scatter = self.collective_time("reduce_scatter", dp, grads, concurrent) + \
                self.collective_time("reduce_scatter", edp, expert_grads, concurrent)
            all_gather = self.collective_time("all_gather", dp, weights, concurrent) + \
                self.collective_time("all_gather", edp, expert_weights, concurrent) \
                if seg.zero == 3 else 0.0
            if fp8 is not None and fp8.gathered_params:
                # each rank casts its fp32 shard to FP8 before the gather, on its stream
                all_gather += fp8.shard_cast_s(device, zero_degree)
            copy_out = host_gather = host_reduce = 0.0
            fsdp_host = overhead is not None and not ahead and overhead.fsdp_measured
            if fsdp_host:
                # FSDP2's work beyond the collectives where the rank's cores run it (CPU
                # profiles measure it, its copies included): per call (one unit, a layer
                # here) and per byte of what it gathers or reduces; never hidden.  Not on
                # the once-a-step collectives (OpOverhead.fsdp_gather_call_s says why)
                host_reduce = overhead.fsdp_reduce_s(grads + expert_grads)
                if seg.zero == 3:
                    host_gather = overhead.fsdp_gather_s(weights + expert_weights)
            elif opts.zero_buffer_copies:
                # FSDP2's flat buffers, memory-bound on the device (read + write): on the
                # collectives' streams the gradients into the reduce-scatter input and the
                # shard into the all-gather input; on the compute stream, once the gather
                # lands, its output into the parameters
                bw = device.memory_bw_bytes_per_s
                reduce_scatter += 2 * (grads + expert_grads) / bw
                if seg.zero == 3:
                    gathered = weights + expert_weights
                    all_gather += 2 * gathered / zero_degree / bw
                    copy_out = 2 * gathered / bw
            # backward: one gather, or two when the recomputed forward gathers again
            gathers_backward = 2 if (opts.zero3_regather_for_recompute and
                                     seg.recompute is Recompute.FULL and layer.is_block) else 1
            all_gather_backward = all_gather * gathers_backward
            vol(("reduce_scatter", "dp", grad_dtype, grads, 1, "zero"))
            if len(edp) > 1:
                vol(("reduce_scatter", "edp", grad_dtype, expert_grads, 1, "zero"))
            if seg.zero == 3:
                vol(("all_gather", "dp", gather_dtype, weights, 1 + gathers_backward, "zero"))
                if len(edp) > 1:
                    vol(("all_gather", "edp", param_dtype, expert_weights,
                         1 + gathers_backward, "zero"))
            if opts.overlap_param_gather and seg.zero == 3 and opts.zero3_gather_unit == "module":
                # one module's gather prefetched under the module before it (module_shares)
                shares = self.module_shares(layer.template)
                zero_forward_exposed = prefetch_exposed(shares, forward_with_comm, all_gather)
                backward_only = backward_with_comm
                if gathers_backward == 2:   # the recomputed forward's gathers, in order
                    zero_backward_exposed = prefetch_exposed(shares, recompute, all_gather)
                    backward_only -= recompute
                zero_backward_exposed += prefetch_exposed(shares[::-1], backward_only,
                                                          all_gather + reduce_scatter)
            elif opts.overlap_param_gather:
                zero_forward_exposed = max(0.0, all_gather - forward_with_comm)
                zero_backward_exposed = max(0.0, all_gather_backward + reduce_scatter
                                            - backward_with_comm)
            else:
                zero_forward_exposed = all_gather
                zero_backward_exposed = all_gather_backward + reduce_scatter
            zero_forward_exposed += copy_out + host_gather
            zero_backward_exposed += (copy_out + host_gather) * gathers_backward + host_reduce
            zero_total = all_gather + all_gather_backward + reduce_scatter \
                + (copy_out + host_gather) * (1 + gathers_backward) + host_reduce
        # activations
        saved = self.activation_bytes(layer, t, seg.sequence_parallel, seg.recompute, cp) \
            * b * act_scale
        working = saved
        if seg.recompute is Recompute.FULL and layer.is_block:
            # the layer being recomputed holds all it saves, its checkpoint included
            working = self.activation_bytes(layer, t, seg.sequence_parallel, Recompute.NONE, cp) \
                * b * act_scale
        return _LayerTerms(   # positional, in field order (keywords cost a search time)
            forward, backward, recompute, layer_time.weight_grad_s,
            tp_forward + tp_backward, tp_forward_exposed + tp_backward_exposed,
            cp_forward + cp_backward, cp_exposed,
            zero_total, zero_forward_exposed + zero_backward_exposed,
            forward_with_comm + zero_forward_exposed, backward_with_comm + zero_backward_exposed,
            local_params, gather_unit, saved, working,
            ep_forward + ep_backward, ep_forward + ep_backward, local_expert_params, cp_waits)

    def module_shares(self, template: str) -> tuple[float, ...]:
        """Each weight-carrying module's share of ``template``'s weight matmul FLOPs, in
        execution order (``(1.0,)`` for a layer with fewer than two): under a per-module
        ZeRO-3 gather (``zero3_gather_unit="module"``) both its gather's and its compute's
        share of the layer's (a linear's FLOPs and parameters are in proportion), the
        attention core and memory-bound operators spread in proportion."""
        hit = self._module_shares.get(template)
        if hit is None:
            flops = [n.fwd_flops for n in self.summary.templates[template] if n.weight]
            total = sum(flops)
            hit = tuple(f / total for f in flops) if len(flops) > 1 and total > 0 else (1.0,)
            self._module_shares[template] = hit
        return hit

    def dispatch_bytes(self, l: LayerCost, b: int, cp: int, act_scale: float,
                       tp: int = 1, group: tuple[int, ...] = ()) -> float:
        """Bytes one rank sends into one token all-to-all of layer ``l`` per micro-batch
        of ``b`` sequences: ``tokens x top-k x hidden x bytes`` (tokens: this rank's
        ``b x seq / cp``, and ``/ tp`` when ``CostOptions.moe_tokens_split_over_tp``),
        its whole send buffer, times :meth:`dispatch_share` over the ep ``group`` (its
        devices; none: 1); the collective model sends the ``(ep - 1) / ep`` of it bound for
        other ranks (:mod:`autoplan.hardware.collectives`, pairwise exchange)."""
        if self.options.moe_tokens_split_over_tp:
            cp = cp * tp
        return (l.expert_tokens * b / cp * l.expert_hidden * self.summary.activation_bytes
                * act_scale * self.dispatch_share(l, group))

    def routing_weight_bytes(self, l: LayerCost, b: int, cp: int, act_scale: float,
                             tp: int = 1, group: tuple[int, ...] = ()) -> float:
        """Bytes of the routing weights that travel with one dispatch of layer ``l``: one
        number per token-to-expert assignment sent, in the activations' dtype (the
        Hugging Face routers cast their weights to it; :mod:`autoplan.runtime.ep` sends
        them as one more column of the hidden states)."""
        if self.options.moe_tokens_split_over_tp:
            cp = cp * tp
        return (l.expert_tokens * b / cp * self.summary.activation_bytes * act_scale
                * self.dispatch_share(l, group))

    def dispatch_share(self, l: LayerCost, group: tuple[int, ...]) -> float:
        """The share of a token's ``top-k`` copies that ``CostOptions.moe_dispatcher``
        sends over the ep ``group`` (device indices).

        ``"alltoall"``: 1 (a copy per token-to-expert assignment).  ``"deepep"``: a token
        crosses once to each destination holding any of its experts: the group's nodes
        when it spans several (the inter-node network, the slowest level, carries one copy
        per node; the NVLink fan-out inside a node is not priced apart), else its ranks.
        With ``u`` destinations of ``E / u`` experts each and ``k`` experts drawn uniformly
        without replacement, a destination is missed with probability ``C(E - E/u, k) /
        C(E, k)``, so a token reaches ``u (1 - that)`` of them on average; the share is that
        over ``k``.  (Uniform routing; a router limited to fewer nodes per token, as
        DeepSeek-V3's four, sends less.)
        """
        if self.options.moe_dispatcher != "deepep" or len(group) < 2 or l.num_experts <= 1:
            return 1.0
        experts = l.num_experts
        k = min(experts, max(1, round(l.expert_tokens / (self.summary.seq_len or 1))))
        nodes = len({self._node_of[d] for d in group})
        units = nodes if nodes > 1 else len(group)
        per_unit = experts / units
        missed = 1.0
        for i in range(k):
            missed *= max(0.0, experts - per_unit - i) / (experts - i)
        return min(1.0, units * (1.0 - missed) / k)

    def _groups(self, all_devs: tuple[int, ...], tp: int, cp: int, ep: int, r: int) -> _RankGroups:
        """The device groups of replica ``r`` on a pipeline rank with devices ``all_devs``
        (rank order dp, cp, tp) at tensor-parallel index 0."""
        replica = all_devs[r * cp * tp:(r + 1) * cp * tp]
        tp_group = replica[:tp]
        cp_at = 0                                               # tp index of the cp group
        node = self._node_of
        if node[replica[0]] != node[replica[-1]] or replica[-1] - replica[0] != len(replica) - 1:
            # a replica over several nodes: price the tp and cp groups that span the most
            # (a group straddling two NVLink domains is slower than one inside either)
            if tp > 1 and cp > 1:
                tp_group = max((replica[i * tp:(i + 1) * tp] for i in range(cp)),
                               key=lambda g: len({node[d] for d in g}))
            if cp > 1:
                cp_at = max(range(tp), key=lambda i: len({node[d] for d in replica[i::tp]}))
        dp_group = all_devs[0::tp]                              # same tp index: dp x cp members
        # expert parallelism: ep consecutive members of the flattened dp x cp index share
        # one copy of the experts (ep group); the members at the same position of every ep
        # group hold the same experts (edp group, what expert gradients reduce over)
        first = r * cp                                          # replica's first dp x cp index
        ep_group = dp_group[first - first % ep:first - first % ep + ep] if ep > 1 else ()
        edp_group = dp_group[first % ep::ep] if ep > 1 else ()
        cp_group = replica[cp_at::tp] if cp > 1 else ()        # same tp index
        return _RankGroups(replica, tp_group, dp_group, self._dp_concurrency(dp_group),
                           (dp_group[0], len(dp_group), hash(dp_group)), cp_group,
                           ep_group, edp_group, (ep, ep_group, hash(edp_group)))

    def layer_time_bound(self, template: str, all_devs: tuple[int, ...], tp: int, cp: int,
                         ep: int, sp: bool, b: int, precision: Precision) -> float:
        """Forward plus backward seconds of one micro-batch of a ``template`` layer on the
        pipeline rank with devices ``all_devs`` (replica 0) without recompute or ZeRO-2/3:
        compute and the exposed tensor-, context- and expert-parallel collectives, the
        least any layout of these degrees spends on it (recompute and sharding add).
        What the search bounds step times with."""
        recipe = self.precision_costs(precision)
        groups = self._groups(all_devs, tp, cp, ep, 0)
        device = self.device_of(groups.replica)
        seg = Segment(0, 0, tp, sp, 1, Recompute.NONE)
        key = (template, tp, sp, 1, Recompute.NONE, b, cp, device.name, recipe.dtype,
               recipe.activation_scale, groups.tp, groups.dp_key, groups.cp,
               groups.ep_key)
        terms = self._terms.get(key)
        if terms is None:
            vols: list = []
            terms = self._terms[key] = tuple(self._layer_terms(self._templates[template], seg, b,
                                                               cp, device, recipe, groups, ep,
                                                               vols))
            self._volumes[key] = tuple(vols)
        named = _LayerTerms._make(terms)
        return named.forward_s + named.backward_s

    def _stages_of(self, stage_ranks: tuple[int, ...]) -> dict[int, list[int]]:
        """The virtual stages of each pipeline rank, in order."""
        hit = self._rank_stages.get(stage_ranks)
        if hit is None:
            hit = {}
            for k, p in enumerate(stage_ranks):
                hit.setdefault(p, []).append(k)
            self._rank_stages[stage_ranks] = hit
        return hit

    def _placement(self, lay: Layout, p: int, r: int) -> tuple:
        """Where the groups of replica ``r`` on pipeline rank ``p`` sit
        (:meth:`Cluster.placement <autoplan.hardware.Cluster.placement>` of each)."""
        g = self._groups(lay.rank_devices[p], lay.rank_tp[p], lay.cp, lay.ep, r)
        place = self.cluster.placement
        return tuple(place(x) if x else () for x in (g.tp, g.cp, g.ep))

    def _replicas_alike(self, lay: Layout) -> bool:
        """Whether every replica's tensor-, context- and expert-parallel groups sit alike
        on every pipeline rank (then replica 0 stands for all on one device type).

        Ranks laid out over consecutive devices, as the search does, place groups of
        ``g`` (``tp x cp`` a replica, ``ep x tp`` an expert-parallel group) alike when
        every NVLink domain edge inside the rank falls on a group edge, or every group
        spans whole nodes of one size; other layouts are compared replica by replica."""
        # first by the identity of the rank -> devices map (the search reuses one per
        # degree combination; hashing a thousand devices per estimate would cost time)
        quick_key = (id(lay.rank_devices), lay.rank_tp, lay.cp, lay.ep)
        seen = self._alike_by_id.get(quick_key)
        if seen is not None and seen[0] is lay.rank_devices:
            return seen[1]
        key = (lay.rank_devices, lay.rank_tp, lay.cp, lay.ep)
        hit = self._alike.get(key)
        if hit is not None:
            self._alike_by_id[quick_key] = (lay.rank_devices, hit)
            return hit
        hit = True
        for p, devs in enumerate(lay.rank_devices):
            tp = lay.rank_tp[p]
            spans = [tp * lay.cp] + ([tp * lay.ep] if lay.ep > 1 else [])
            start, n = devs[0], len(devs)
            if devs == tuple(range(start, start + n)):
                starts = self._node_starts
                edges = starts[bisect_right(starts, start):bisect_right(starts, start + n - 1)]
                if all(all((e - start) % g == 0 for e in edges)
                       or (self._node_size is not None and g % self._node_size == 0
                           and start % self._node_size == 0) for g in spans):
                    continue
            first = self._placement(lay, p, 0)
            if any(self._placement(lay, p, r) != first for r in range(1, lay.dp)):
                hit = False
                break
        if len(self._alike) > 4096:
            self._alike.clear()
            self._alike_by_id.clear()
        self._alike[key] = hit
        self._alike_by_id[quick_key] = (lay.rank_devices, hit)
        return hit

    def _tied_owned(self, lay: Layout, chunks) -> float:
        """Parameters (on one device, after tp) of the tied weights the layers of
        ``chunks`` own and a layer of another pipeline rank holds a copy of."""
        s = self.summary
        mine = {i: sg.tp for ch in chunks for sg in ch for i in range(sg.lo, sg.hi)}
        return sum(s.layers[idx].tied_params / mine[owner]
                   for idx, owner in s.tied_owner.items()
                   if owner in mine and idx not in mine and s.layers[idx].tied_params)

    @staticmethod
    def _replica_devices(lay: Layout, p: int, r: int) -> tuple[int, ...]:
        n = lay.cp * lay.rank_tp[p]
        return lay.rank_devices[p][r * n:(r + 1) * n]

    def _rank(self, lay: Layout, rank: int, replica: int, micro_batches: int,
              recipe: PrecisionCosts, ledger: LedgerBuilder | None = None) -> _RankEval:
        """Pipeline rank ``rank`` of replica ``replica``, which runs ``micro_batches``
        micro-batches per step, priced in ``recipe``; with ``ledger``, every collective
        and matmul priced is also written to it (:meth:`ledger`)."""
        s = self.summary
        opts = self.options
        kmem = self.constants.memory
        pp, v, cp = lay.pp, lay.virtual_stages, lay.cp
        b = lay.micro_batch
        dtype, act_scale = recipe.dtype, recipe.activation_scale
        ep = lay.ep
        groups = self._groups(lay.rank_devices[rank], lay.rank_tp[rank], cp, ep, replica)
        devices, dp_group, dp_concurrency = groups.replica, groups.dp, groups.dp_concurrency
        dp_key, cp_group, ep_key = groups.dp_key, groups.cp, groups.ep_key
        device = self.device_of(devices)
        zero_degree = len(dp_group)
        edp = zero_degree // ep
        ev = _RankEval(device_type=device.name, layers=0)
        ev.capacity = float(device.memory_bytes)

        params_by_zero = [0.0, 0.0, 0.0, 0.0]   # local (after TP) parameters per ZeRO stage
        experts_by_zero = [0.0, 0.0, 0.0, 0.0]  # those of them in expert banks (after EP)
        act_per_mb = 0.0                        # saved activation bytes of one micro-batch
        work = 0.0                              # one layer's working set (full recompute)
        max_layer_params = 0.0
        # the largest module whose gradients accumulate over micro-batches (memory below)
        accumulates = opts.grad_accumulate_add and micro_batches > 1
        largest_accumulated = 0.0
        cut_out = 0.0                           # largest boundary, scattered over tp
        cut_whole = 0.0                         # ... and whole
        recv_per_micro_batch = 0.0              # pipeline receive buffers of one micro-batch
        p2p_fwd = p2p_bwd = 0.0                 # pipeline sends of one micro-batch
        shared = 0.0                            # inputs every layer shares (held once)
        tied_extra = 0.0
        # ZeRO-1/2 layers by wrapped unit (CostOptions.zero_step_per_layer): a block's
        # (zero, parameters, expert parameters) -> how many; the rest in one root unit
        step_units: dict[tuple[int, float, float], int] = {}
        # the other layers' parameters under ZeRO-1 and ZeRO-2, then their expert parameters
        root_unit = [0.0, 0.0, 0.0, 0.0]
        tensors = tp_tensors = 0                # parameter tensors (optimizer host time)
        sp_grads: dict[tuple, list[float]] = {}  # tp group -> [tensors, elements] (sequence
        # parallelism's partial gradients)
        mine = self._stages_of(lay.stage_ranks)[rank]
        chunks = [lay.chunks[k] for k in mine]

        overhead = device.op_overhead
        # a CPU rank's send is its transport's core time per message end (the pipeline's
        # host work below); gloo's isend returns at once and the receiver's wait is the
        # schedule's own dependency, so no transfer time is added to the stage
        sends_on_host = (pp > 1 and overhead is not None and not host_runs_ahead(device)
                         and overhead.pipeline_message_s > 0)

        def send(to: int, whole: float, scattered: float) -> float:
            """Seconds of one send to virtual stage ``to``'s rank: the ``whole`` tensor from
            every tp rank, or its ``scattered`` share where the stack scatters it over the
            tp ranks (every pair sends at once); 0 when that stage is on this device, or
            where the send is the host's work (``sends_on_host``), counted as a message."""
            pair = (devices[0], self._replica_devices(lay, lay.stage_ranks[to], replica)[0])
            if pair[0] == pair[1]:
                return 0.0
            nonlocal messages
            messages += 1
            if sends_on_host:
                return 0.0
            return self.collective_time("p2p", pair,
                                        scattered if opts.pp_scatter_gather else whole)
        messages = 0                            # message ends of one forward (and backward)
        # per-micro-batch sums, in locals (the hot loop of a search)
        n_layers = 0
        forward_compute = backward_compute = recompute = weight_grad = 0.0
        tp_total = tp_exposed = cp_total = cp_exposed = cp_waits = 0.0
        ep_total = ep_exposed = zero_total = zero_exposed = 0.0
        forward = backward = 0.0
        for chunk, k in zip(chunks, mine):
            for seg in chunk:
                t = seg.tp
                tp_group = groups.tp if t == len(groups.tp) else devices[:t]
                if ledger is not None:
                    self._ledger_flops(ledger, seg, b, cp, ep)
                for template, count in self.layer_counts(seg.lo, seg.hi):
                    l = self._templates[template]
                    n_layers += count
                    key = (template, seg.tp, seg.sequence_parallel, seg.zero, seg.recompute, b,
                           cp, device.name, dtype, act_scale, tp_group, dp_key, cp_group, ep_key)
                    terms = self._terms.get(key)
                    if terms is None:
                        vols: list = []
                        terms = self._terms[key] = tuple(
                            self._layer_terms(l, seg, b, cp, device, recipe, groups, ep, vols))
                        self._volumes[key] = tuple(vols)
                    if ledger is not None:
                        ledger.volumes(self._volumes[key], count)
                    # the cached _LayerTerms tuple, unpacked in field order: this is a
                    # search's hot loop, where 19 attribute reads would cost time
                    (forward_compute_s, backward_compute_s, recompute_s, weight_grad_s,
                     tp_total_s, tp_exposed_s, cp_total_s, cp_exposed_s, zero_total_s,
                     zero_exposed_s, forward_s, backward_s, local_params, gather_unit_params,
                     saved_bytes, working_bytes, ep_total_s, ep_exposed_s,
                     local_expert_params, cp_waits_s) = terms
                    forward_compute += count * forward_compute_s
                    backward_compute += count * backward_compute_s
                    recompute += count * recompute_s
                    weight_grad += count * weight_grad_s
                    tp_total += count * tp_total_s
                    tp_exposed += count * tp_exposed_s
                    cp_total += count * cp_total_s
                    cp_exposed += count * cp_exposed_s
                    cp_waits += count * cp_waits_s
                    ep_total += count * ep_total_s
                    ep_exposed += count * ep_exposed_s
                    zero_total += count * zero_total_s
                    zero_exposed += count * zero_exposed_s
                    forward += count * forward_s
                    backward += count * backward_s
                    params_by_zero[seg.zero] += count * local_params
                    experts_by_zero[seg.zero] += count * local_expert_params
                    if seg.zero in (1, 2) and (local_params or local_expert_params):
                        if l.is_block:
                            unit = (seg.zero, local_params, local_expert_params)
                            step_units[unit] = step_units.get(unit, 0) + count
                        else:
                            root_unit[seg.zero - 1] += count * local_params
                            root_unit[seg.zero + 1] += count * local_expert_params
                    tensors += count * l.param_tensors
                    if t > 1:
                        tp_tensors += count * l.tp_param_tensors
                        if seg.sequence_parallel and l.sp_params:
                            acc = sp_grads.setdefault(tp_group, [0.0, 0.0])
                            acc[0] += count * len(l.sp_params)
                            acc[1] += count * sum(l.sp_params)
                    max_layer_params = max(max_layer_params, gather_unit_params)
                    if accumulates and seg.zero <= 1:
                        largest_accumulated = max(largest_accumulated,
                                                  _largest_module_local(l, t, ep))
                    act_per_mb += count * saved_bytes
                    if working_bytes > saved_bytes:
                        work = max(work, working_bytes - saved_bytes)
                    if l.shared_input_bytes:
                        shared = max(shared, l.shared_input_bytes * b * act_scale / cp)
                    if l.tied_params and s.tied_owner.get(l.index) is not None:
                        owner = s.tied_owner[l.index]
                        if not any(sg.lo <= owner < sg.hi for ch in chunks for sg in ch):
                            tied_extra += l.tied_params / t
            # pipeline point-to-point at this chunk's boundaries (scatter/gather over tp)
            last = chunk[-1]
            cut = s.layers[last.hi - 1].send_bytes * b * act_scale / (cp * last.tp)
            cut_out = max(cut_out, cut)
            cut_whole = max(cut_whole, cut * last.tp)
            # torch's stages receive whole (replicated) activations on every tp rank.
            # Each rank pays for what it sends: its output activation in the forward, its
            # input's gradient in the backward
            if k > 0:       # this chunk's input activation arrives from the previous stage
                cut_in = s.layers[chunk[0].lo - 1].send_bytes * b * act_scale / cp
                recv_per_micro_batch += cut_in
                cut_out = max(cut_out, cut_in / chunk[0].tp)
                cut_whole = max(cut_whole, cut_in)
                p2p_bwd += send(k - 1, cut_in, cut_in / chunk[0].tp)
                if ledger is not None and lay.stage_ranks[k - 1] != rank:
                    ledger.per_micro_batch("send", "pp", ledger.act_dtype,
                                           cut_in / chunk[0].tp if opts.pp_scatter_gather
                                           else cut_in, 1, "pp")
            if k < pp * v - 1:  # and its output's gradient from the next
                recv_per_micro_batch += s.layers[last.hi - 1].send_bytes * b * act_scale / cp
                p2p_fwd += send(k + 1, cut * last.tp, cut)
                if ledger is not None and lay.stage_ranks[k + 1] != rank:
                    ledger.per_micro_batch("send", "pp", ledger.act_dtype,
                                           cut if opts.pp_scatter_gather else cut * last.tp,
                                           1, "pp")
        if pp > 1 and overhead is not None and not host_runs_ahead(device):
            # the pipeline's host work per stage action and message end (CPU devices):
            # each chunk's forward and backward of a micro-batch, and a zero-bubble
            # schedule's deferred weight backward; each sends or receives across its
            # chunk's boundaries
            actions = len(chunks) * overhead.pipeline_action_s
            host = actions + messages * overhead.pipeline_message_s
            split = deferred = 0.0
            if lay.schedule is Schedule.ZERO_BUBBLE:
                # torch splits the backward (input gradients, then the weights' in a pass
                # of their own): its walk of the graph and second pass, per autograd node,
                # half in each
                nodes = sum(s.total("autograd_nodes", seg.lo, seg.hi)
                            for chunk in chunks for seg in chunk)
                split = nodes * overhead.zero_bubble_node_s
                deferred = actions + split / 2
            forward_compute += host
            forward += host
            backward_compute += host + split / 2 + deferred
            backward += host + split / 2 + deferred
            weight_grad += deferred
        ev.layers = n_layers
        ev.fwd_compute, ev.bwd_compute = forward_compute, backward_compute
        ev.recompute, ev.wgrad = recompute, weight_grad
        ev.tp_total, ev.tp_exposed = tp_total, tp_exposed
        ev.cp_total, ev.cp_exposed, ev.cp_waits = cp_total, cp_exposed, cp_waits
        ev.ep_total, ev.ep_exposed = ep_total, ep_exposed
        ev.zero_total, ev.zero_exposed = zero_total, zero_exposed
        ev.fwd, ev.bwd = forward, backward
        if not opts.pp_comm_overlap:
            ev.p2p = p2p_fwd + p2p_bwd
            ev.fwd += p2p_fwd
            ev.bwd += p2p_bwd

        # per-step data-parallel reduction of the layers with ZeRO-0/1 (and ZeRO-2's gather)
        param_bytes, grad_bytes = recipe.param_bytes, recipe.grad_bytes   # per parameter
        reduced0 = params_by_zero[0] + tied_extra
        reduced1 = params_by_zero[1]
        gathered = reduced1 + params_by_zero[2]
        x0, x1, x2, x3 = experts_by_zero     # expert banks: over the edp group
        edp_group = groups.edp
        edp_key = ((edp_group[0], len(edp_group), ep_key[2])   # ep_key[2]: hash(edp_group)
                   if edp_group else None)
        t_reduce = self.collective_time("all_reduce", dp_group, reduced0 * grad_bytes,
                                        dp_concurrency, dp_key)
        if x0:
            t_reduce += self.collective_time("all_reduce", edp_group, x0 * grad_bytes,
                                             dp_concurrency, edp_key)
        if ledger is not None and zero_degree > 1:
            ledger.per_step("all_reduce", "dp", ledger.grad_dtype, reduced0 * grad_bytes, 1,
                            "dp_step")
        if ledger is not None and edp > 1:
            ledger.per_step("all_reduce", "edp", ledger.grad_dtype, x0 * grad_bytes, 1,
                            "dp_step")
        # ZeRO-1's reduce-scatters and ZeRO-1/2's all-gathers: (parameters, expert
        # parameters, calls) each
        if opts.zero_step_per_layer:        # one of each per wrapped unit
            scatters = [(n, x, count) for (z, n, x), count in step_units.items() if z == 1]
            gathers = [(n, x, count) for (z, n, x), count in step_units.items()]
            for z in (1, 2):
                root = (root_unit[z - 1], root_unit[z + 1], 1)
                if root[0] or root[1]:
                    gathers.append(root)
                    if z == 1:
                        scatters.append(root)
        else:                               # one of each over all of them
            scatters, gathers = [(reduced1, x1, 1)], [(gathered, x1 + x2, 1)]

        def calls(op: str, units, nbytes: float) -> float:
            """``op`` over each unit's parameters (dp group) and expert parameters (edp
            group), ``count`` times a unit."""
            return sum(count * (
                self.collective_time(op, dp_group, n * nbytes, dp_concurrency, dp_key)
                + self.collective_time(op, edp_group, x * nbytes, dp_concurrency, edp_key))
                for n, x, count in units)

        t_reduce += calls("reduce_scatter", scatters, grad_bytes)
        t_gather = calls("all_gather", gathers, param_bytes)
        if ledger is not None:
            for op, units, nbytes, dtype in (("reduce_scatter", scatters, grad_bytes,
                                              ledger.grad_dtype),
                                             ("all_gather", gathers, param_bytes,
                                              ledger.param_dtype)):
                for n, x, count in units:
                    if zero_degree > 1:
                        ledger.per_step(op, "dp", dtype, count * n * nbytes,
                                        count if n else 0, "dp_step")
                    if edp > 1:
                        ledger.per_step(op, "edp", dtype, count * x * nbytes,
                                        count if x else 0, "dp_step")
        # autoplan.parallelize wraps a data-parallel rank's parameters as DTensors (FSDP2's
        # fully_shard or replicate) unless it uses DDP
        max_zero = max((z for z in range(4) if params_by_zero[z] or experts_by_zero[z]),
                       default=0)
        fsdp2 = zero_degree > 1 and not uses_ddp(pp=pp, tp=lay.rank_tp[rank], ep=ep,
                                                 max_zero=max_zero, precision=recipe.dtype)
        # FSDP2's work beyond these collectives where the rank's cores run it (CPU
        # profiles measure it, its copies included, every rank busy): replicate's one
        # all-reduce a step (OpOverhead.replicate_call_s) and fully_shard's once-a-step
        # reduce-scatters and gathers per unit (OpOverhead.fsdp_reduce_call_s), each unit's
        # parameters and its expert banks' (over their edp group) a call of their own.
        # Not on pipelines whose ranks share cores: their step ends with the other
        # stages' ranks idle, faster than every rank busy (the replicate_call_s docstring)
        on_host = (fsdp2 and overhead is not None and not host_runs_ahead(device)
                   and not (pp > 1 and self._shared_cores(lay) is not None))
        replicated = on_host and max_zero == 0 and overhead.replicate_measured
        sharded = on_host and max_zero > 0 and overhead.fsdp_measured
        if replicated or sharded:
            assert overhead is not None

            def extra(per_call, units, nbytes: float) -> float:
                return sum(count * (per_call(n * nbytes, 1.0 if n else 0.0)
                                    + (per_call(x * nbytes, 1.0 if x else 0.0)
                                       if edp > 1 else 0.0))
                           for n, x, count in units)
            if replicated:
                t_reduce += extra(overhead.replicate_s, [(reduced0, x0, 1)], grad_bytes)
            else:
                t_reduce += extra(overhead.fsdp_reduce_s, scatters, grad_bytes)
                t_gather += extra(overhead.fsdp_gather_s, gathers, param_bytes)
        if opts.zero_buffer_copies and zero_degree > 1:
            # once per step, memory-bound (read + write) on the device: DDP's buckets and
            # FSDP2's replicate copy the gradients in and the reduced ones back out;
            # FSDP2's reduce-scatter copies them in (its output is the shard); its
            # all-gather copies the shard in and the gathered parameters out (where the
            # figures above were priced, their copies are in them)
            bw = device.memory_bw_bytes_per_s
            reduce_copies = ((0.0 if replicated else 4 * reduced0)
                             + (0.0 if sharded else 2 * reduced1))
            t_reduce += reduce_copies * grad_bytes / bw
            if not sharded:
                t_gather += 2 * gathered * (1 + 1 / zero_degree) * param_bytes / bw
            if edp > 1:   # expert banks, over their edp group (none to reduce when edp is 1)
                t_reduce += ((0.0 if replicated else 4 * x0) + (0.0 if sharded else 2 * x1)
                             ) * grad_bytes / bw
                if not sharded:
                    t_gather += 2 * (x1 + x2) * (1 + 1 / edp) * param_bytes / bw
        ev.dp_step_total = t_reduce + t_gather
        exposed_reduce = max(0.0, t_reduce - ev.bwd) if opts.overlap_grad_reduce else t_reduce
        exposed_gather = max(0.0, t_gather - ev.fwd) if opts.overlap_param_gather else t_gather
        ev.dp_step_exposed = exposed_reduce + exposed_gather
        # the tied parameters' all-reduce takes both stages: the one holding the copy
        # (tied_extra) and the one owning the parameter another stage copies
        tied_pair = tied_extra or (self._tied_owned(lay, chunks) if pp > 1 else 0.0)
        if tied_pair and pp > 1:
            pair = (devices[0], self._replica_devices(lay, 0 if rank == pp - 1 else pp - 1, replica)[0])
            if pair[0] != pair[1]:
                t_tied = self.collective_time("all_reduce", pair, tied_pair * grad_bytes)
                ev.dp_step_total += t_tied
                ev.dp_step_exposed += t_tied
                if ledger is not None:
                    ledger.per_step("all_reduce", "tied", ledger.grad_dtype,
                                    tied_pair * grad_bytes, 1, "tied")
        # sequence parallelism: the norms saw a sequence shard, their gradients are partial
        # sums over tp, reduced once per step after the backward: each in its own
        # all-reduce in FSDP2's post-backward (where it wraps the rank and the stack does
        # so), or all together in one (Megatron; autoplan.parallelize without FSDP2)
        # (under FSDP2's policy a gradient left as autograd made it, 16-bit, where one
        # micro-batch gives no accumulation in the reduction dtype first)
        sp_bytes, sp_dtype = grad_bytes, (ledger.grad_dtype if ledger is not None else "")
        if recipe.fsdp2_master and micro_batches == 1:
            sp_bytes, sp_dtype = param_bytes, (ledger.act_dtype if ledger is not None else "")
        for group, (n, elements) in sp_grads.items():
            per_tensor = ((fsdp2 or recipe.fsdp2_master)
                          and opts.sp_grads_per_tensor_under_fsdp2)
            if per_tensor:   # at their mean size
                t_sp = n * self.collective_time("all_reduce", group, elements / n * sp_bytes)
            else:
                t_sp = self.collective_time("all_reduce", group, elements * sp_bytes)
            if ledger is not None:
                ledger.per_step("all_reduce", "tp", sp_dtype, elements * sp_bytes,
                                n if per_tensor else 1, "sp_grads")
            ev.tp_step += t_sp
            ev.dp_step_total += t_sp
            ev.dp_step_exposed += t_sp
        # torchao's FP8 all-gathers: the next step's scales, after the optimizer step
        if _fp8_scaling(recipe.dtype) and self.options.fp8_library == "torchao":
            t_scales, t_read = self._fp8_step_scales(chunks, recipe, groups, ledger)
            ev.dp_step_total += t_scales
            ev.dp_step_exposed += t_scales
            ev.optimizer += t_read
        # optimizer: memory-bound Adam over the parameters this device updates
        local_opt = params_by_zero[0] + tied_extra + sum(params_by_zero[1:]) / zero_degree
        local_opt += x0 + (x1 + x2 + x3) / edp
        if overhead is not None and overhead.optimizer_element_s > 0:
            # measured per fp32 element of the fused step (CPU profiles), the recipe's
            # bytes against fp32's
            fp32_accessed = self.constants.optimizer.fp32_bytes_accessed_per_param
            ev.optimizer = (local_opt * overhead.optimizer_element_s
                            * recipe.optimizer_bytes_accessed / fp32_accessed)
        else:
            ev.optimizer = (local_opt * recipe.optimizer_bytes_accessed
                            / device.memory_bw_bytes_per_s)
        if overhead is not None and tensors:
            # the host's time per parameter tensor (CPU devices): DTensors where FSDP2
            # wraps the rank (a 16-bit plan's policy wraps it without data parallelism
            # too); without it only the linears tensor parallelism shards
            dtensors = tensors if fsdp2 or recipe.fsdp2_master else tp_tensors
            ev.optimizer += ((tensors - dtensors) * overhead.optimizer_param_s
                             + dtensors * overhead.optimizer_dtensor_param_s)
        # torch.autocast over fp32 weights (CostOptions.autocast), on every parameter this
        # device computes with
        autocast = opts.autocast and recipe.dtype != "fp32"
        computed = sum(params_by_zero) + tied_extra + sum(experts_by_zero)
        if opts.grad_accumulate_add and micro_batches > 1:
            # each micro-batch after the first adds its gradients to the accumulated ones
            # (read both, write one): whole under ZeRO-0/1, which reduce once a step, the
            # reduce-scattered shard under ZeRO-2/3; fp32 under autocast (the weights'
            # dtype); once a step, with the optimizer's share
            accumulated = (params_by_zero[0] + params_by_zero[1] + tied_extra
                           + (params_by_zero[2] + params_by_zero[3]) / zero_degree
                           + x0 + x1 + (x2 + x3) / edp)
            nbytes = GRAD_ACCUMULATE_READS_WRITES * (Precision.FP32.bytes if autocast
                                                     else grad_bytes)
            ev.optimizer += ((micro_batches - 1) * accumulated * nbytes
                             / device.memory_bw_bytes_per_s)

        # memory
        z = zero_degree
        per_param = (param_bytes, grad_bytes, recipe.optimizer_bytes)
        held_params = held_grads = held_optimizer = 0.0   # model-state bytes on this device

        def states(n: float, zero: int, shards: int) -> tuple[float, float, float]:
            if recipe.fsdp2_master:
                return fsdp2_state_bytes(n, zero=zero, shards=shards,
                                         master_bytes=DTYPE_BYTES["fp32"],
                                         compute_bytes=param_bytes, grad_bytes=grad_bytes,
                                         optimizer_bytes=recipe.optimizer_bytes,
                                         accumulates=micro_batches > 1)
            return model_state_bytes(n, zero=zero, shards=shards, per_param=per_param)

        for zero, n in enumerate(params_by_zero):
            n += tied_extra if zero == 0 else 0.0    # a tied copy is kept whole
            params, grads, optimizer = states(n, zero, z)
            held_params, held_grads, held_optimizer = \
                held_params + params, held_grads + grads, held_optimizer + optimizer
            if experts_by_zero[zero]:
                params, grads, optimizer = states(experts_by_zero[zero], zero, edp)
                held_params, held_grads, held_optimizer = \
                    held_params + params, held_grads + grads, held_optimizer + optimizer
        ev.in_flight = in_flight(lay.schedule, rank, pp, micro_batches, v)
        acts = ev.in_flight * (act_per_mb + shared) + work
        buffers = 0.0
        if (params_by_zero[3] or x3) and z > 1:
            buffers += max_layer_params * kmem.zero3_gathered_layers * param_bytes
        # ZeRO-1 reduce-scatters per wrapped layer where the stack does so
        # (CostOptions.zero_step_per_layer: FSDP2, what autoplan.parallelize runs for ZeRO-1
        # too), else in its buckets with the replicated gradients
        per_layer_1 = opts.zero_step_per_layer and bool(params_by_zero[1] or x1)
        # reduction buffers that exist only once a backward frees the activations: under
        # FSDP2's policy, replicate's one flat all-reduce input (ZeRO-0) after the last
        # backward, and ZeRO-1's per-layer reduce-scatter inputs in the last micro-batch's
        # backward, layer by layer as its activations free (DDP's buckets are allocated
        # for the whole step).  Measured on 2 CPU ranks (tests/test_memory_truth.py): bf16
        # ZeRO-0 +19% and ZeRO-1 +12% with them added to the activations, +4% and -1% so
        drained = 0.0
        if (params_by_zero[2] or params_by_zero[3] or x2 or x3 or per_layer_1) and z > 1:
            # ZeRO-2 reduce-scatters each layer's full gradients in the backward as ZeRO-3
            # does (FSDP2 for both): they wait unsharded for their reduce-scatter
            unsharded = max_layer_params * kmem.zero3_unsharded_grad_layers * grad_bytes
            buffers += unsharded
            if (recipe.fsdp2_master and micro_batches > 1 and per_layer_1
                    and not (params_by_zero[2] or params_by_zero[3] or x2 or x3)):
                drained += unsharded
        bucketed = params_by_zero[0] + x0 + (0.0 if per_layer_1 else params_by_zero[1] + x1)
        if z > 1 and bucketed:
            bucket = min(kmem.grad_bucket_bytes * kmem.grad_buckets_in_flight,
                         bucketed * grad_bytes)
            buffers += bucket
            if recipe.fsdp2_master:
                drained += bucket
        if pp > 1 and opts.pp_buffers_per_micro_batch:
            # torch.distributed.pipelining allocates a receive buffer per micro-batch of the
            # step for every chunk's input and output gradient, and keeps them
            buffers += micro_batches * recv_per_micro_batch
        elif pp > 1:
            # a receive and a send buffer of the largest boundary: its tp share where the
            # stack scatters it, whole on every tp rank where it does not
            buffers += 2 * (cut_out if opts.pp_scatter_gather else cut_whole)
        if autocast:
            buffers += AUTOCAST_COPY_BYTES * computed   # its cache of bf16 weight copies
        if accumulates:
            # a later micro-batch's gradient of a module lands in a tensor of its own before
            # it is added to the accumulated one (torch's AccumulateGrad; ZeRO-2/3's
            # unsharded gradients are the buffers above): the largest module's, in the
            # weights' dtype (fp32 under autocast).  Measured: an embedding's dense
            # gradient at the peak of a tp2 pp2 pipeline's first stage (local_truth --memory)
            buffers += largest_accumulated * (Precision.FP32.bytes if autocast
                                              else recipe.grad_bytes)
        # the loss's working set, on the stage that computes it (loss_bytes_per_logit)
        head_tp = next((sg.tp for ch in chunks for sg in ch if sg.hi == len(s.layers)), None)
        if opts.loss_fp32_copy and s.loss_logits and head_tp is not None:
            logits = (b * (s.seq_len or 1) / cp * s.loss_logits
                      / (head_tp if opts.loss_parallel else 1))
            acts += logits * loss_bytes_per_logit(recipe.dtype, s.loss_shifts)
        # (the drained buffers count only where they exceed the activations they replace)
        buffers += max(0.0, drained - acts) - drained
        allocated = held_params + held_grads + held_optimizer + acts + buffers
        reserve = kmem.runtime_reserved_bytes + kmem.allocator_fragmentation_fraction * allocated
        ev.memory = MemoryBreakdown(held_params, held_grads, held_optimizer, acts, buffers, reserve)
        return ev
