"""The cost engine: step time and memory of a layout, from a captured graph and a cluster.

One engine prices both a uniform :class:`~autoplan.strategy.Strategy` and a
per-layer :class:`~autoplan.plan.Plan`: both become the same internal layout
(virtual stages made of *segments*, runs of consecutive layers with the same
options), so the search and :func:`autoplan.cost.estimate` never disagree.

Where each term lives
---------------------
The terms below are functions of modules of their own, each taking the engine first;
:class:`CostEngine` keeps a method for each (its public building blocks among them:
:meth:`~CostEngine.template_time`, :meth:`~CostEngine.collective_time`...):

* :mod:`autoplan.cost.layout`: what is priced, the :class:`Layout` of :class:`Segment` s
  (:func:`layout_from_plan`) and a precision recipe's :class:`PrecisionCosts`;
* :mod:`autoplan.cost.compute`: compute, memory-bound operators, the host, fused
  attention and FP8 GEMMs of one layer on one device (``template_time``,
  ``template_flops``);
* :mod:`autoplan.cost.comm`: collectives (tensor, context and expert parallelism, ZeRO-2/3
  per micro-batch, the loss) and everything one layer adds to its rank per micro-batch,
  recompute included (``layer_terms``);
* :mod:`autoplan.cost.pipeline`: one pipeline rank assembled (pipeline point-to-point, the
  per-step data-parallel reduction, tied embeddings, sequence parallelism's gradients,
  the optimizer; ``rank_eval``) and the ranks combined through the schedule
  (:mod:`autoplan.cost.schedules`) into the step (``step_time``);
* :mod:`autoplan.cost.memory`: memory of one device (``rank_memory``);
* :mod:`autoplan.cost.hetero`: the device type pricing a group, where groups sit on
  nodes, ranks sharing cores;
* this module: :class:`CostEngine`, which holds the caches, groups the replicas that
  cost alike and assembles the :class:`~autoplan.cost.result.Estimate` and its
  :class:`~autoplan.cost.ledger.Ledger`.

Time of one step (per data-parallel replica; the step waits for the slowest)
----------------------------------------------------------------------------
Per pipeline rank ``p`` and micro-batch, ``F_p`` and ``B_p`` are the forward
and backward times of all its chunks:

* **compute** (:mod:`~autoplan.cost.compute`) of every FLOP-carrying node ``n`` of the
  layer: ``flops_n / (peak[dtype] * efficiency(flops_n))`` with ``flops_n`` the node's
  FLOPs on one device (``/tp`` inside tensor-parallel regions, ``/cp`` under context
  parallelism), ``peak`` and the efficiency table from the device profile
  (:meth:`DeviceType.efficiency`).  The backward of a matmul runs two matmuls of the
  forward's size (input and weight gradients), so it is priced at the forward's
  efficiency.  Under an FP8 recipe (``Precision.is_fp8``) the GEMMs of the linears it
  converts run at the FP8 peak and efficiency, and their operands are quantized first,
  memory-bound, as the library that runs it does (``CostOptions.fp8_library``;
  :mod:`autoplan.cost.fp8`: torchao's casts, scale all-reduces and FP8 all-gathers,
  Transformer Engine's fused casts).
* **memory-bound operators** (:mod:`~autoplan.cost.compute`; norms, activations,
  softmax, residual adds, copies; the roofline of Williams et al. 2009): the bytes each
  captured node without FLOPs reads and writes, over the device's memory bandwidth, and
  in the backward, where the host is the device (CPUs), the bytes its derivative moves
  (nothing for an add or a dropout of probability 0, twice the forward for a product of
  two tensors: :func:`autoplan.cost.summary.backward_traffic`), on a GPU twice the
  forward's (:data:`~autoplan.cost.compute.ELEMENTWISE_BACKWARD_FACTOR`: session-38
  H100/H200 step times of 0.5-3B models priced 7-15% fast with the derivative's bytes,
  within their tests' bounds with twice the forward's; the GPU's backward kernels of
  memory-bound operators, or something else there, run slower than the bytes say);
  sharded like the activations they touch.  Kinds a profile timed apart
  (``DeviceType.elementwise_rates``: on CPU ranks GELU, SiLU, softmax, layer norm,
  masked_fill, arithmetic per byte there; on a GPU these and broadcasts and layout
  copies, which run on a non-vectorized path) move their bytes at their own measured
  forward and backward speeds instead.
* **host and composition** (:mod:`~autoplan.cost.compute`; CPU devices, where the host
  is the device): the host's dispatch per forward operator and backward autograd node
  (``DeviceType.op_overhead``) adds to a layer's time, and a profile that timed a
  reference stack of blocks whole scales the sum of these parts by what it found
  (``OpOverhead.layer_forward_scale`` / ``layer_backward_scale``).
* **recompute** (:func:`~autoplan.cost.comm.layer_terms`; Chen et al. 2016; Korthikanti
  et al. 2022, Sec. 5): full recompute re-runs each block's forward (and its
  tensor-parallel collectives) before its backward; selective recompute re-runs only the
  attention core.
* **fused attention** (:mod:`~autoplan.cost.compute`; Dao et al. 2022, Alg. 2/4; Dao
  2023 Sec. 3.1): the attention core's backward recomputes its forward; a causal mask
  halves the core's work (:data:`~autoplan.cost.compute.CAUSAL_BLOCK_FRACTION`).
* **tensor parallelism** (:mod:`~autoplan.cost.comm`; Shoeybi et al. 2019, Sec. 3;
  Korthikanti et al. 2022, Sec. 4.2.2): the collectives captured per layer, all-reduces
  or (sequence parallel) all-gathers and reduce-scatters, over the tensor-parallel group;
  exposed unless ``tp_comm_overlap``, then hidden behind the layer's compute.
* **context parallelism** (:mod:`~autoplan.cost.comm`), all-gather attention as
  :mod:`autoplan.runtime.cp` runs it (Dubey et al. 2024, "The Llama 3 Herd of Models",
  Sec. 3.3.2): each block all-gathers the keys/values of the whole sequences over the
  replica's context-parallel group in the forward
  (``kv_bytes_per_token * seq_len * b / tp`` gathered bytes) and reduce-scatters their gradients in the backward (again under
  full recompute, whose forward gathers again).  The attention core waits for the gather
  and the input gradient for the reduce-scatter, so both are exposed, not overlapped; so
  are the runtime's memory-bound copies around them at the device's copy bandwidth (2 x
  local + 2 x gathered bytes forward, 4 x gathered backward: the stack of keys and values
  and the copy into position order, each way).
* **expert parallelism** (:mod:`~autoplan.cost.comm`; mixture-of-experts layers;
  Lepikhin et al. 2021, GShard; Megatron-Core and torchtitan carve the ``ep`` ranks out
  of ``dp x cp``): the ``ep`` consecutive ranks of the flattened ``dp x cp`` index (same
  ``tp`` index, so ``ep x tp`` devices apart at most; inside a node when ``ep x tp`` fits
  one) share one copy of the experts.  Per MoE layer and micro-batch each rank sends
  ``tokens x top-k x hidden x bytes`` (its ``b x seq / cp`` tokens) through an
  all-to-all, ``(ep - 1) / ep`` of it to other ranks, for the dispatch and the combine in
  the forward and their transposes in the backward (again under full recompute),
  blocking, so exposed (:meth:`CostEngine.dispatch_bytes`; pairwise exchange in
  :mod:`autoplan.hardware.collectives`); a DeepEP-style dispatcher
  (``CostOptions.moe_dispatcher="deepep"``) sends one copy per destination node or rank
  instead of one per assignment (:meth:`CostEngine.dispatch_share`).  One expert's GEMM
  has ``ep x tokens x top-k / experts`` rows (the tokens of the ep group spread over all
  experts); the bank runs as one grouped kernel, as per-expert kernels on concurrent
  streams (Transformer Engine) or one expert at a time, each priced at the size of what
  runs at once (:func:`~autoplan.cost.compute.expert_kernel_fraction`), and the
  busiest rank computes ``CostOptions.expert_imbalance`` times the mean.  The router and
  shared experts are ordinary (dense) matmuls.
* **ZeRO-3 / FSDP** (:mod:`~autoplan.cost.comm`; Rajbhandari et al. 2020, Sec. 5.3;
  Zhao et al. 2023, Sec. 3.3): each micro-batch all-gathers every layer's parameters in
  the forward and again in the backward and reduce-scatters its gradients; with prefetch
  a layer's collectives run under the previous layer's compute: ``sum_i max(f_i, ag_i)``
  in the forward and ``sum_i max(b_i, ag_i + rs_i)`` in the backward.  ZeRO-2
  reduce-scatters gradients per micro-batch the same way.
* **pipeline point-to-point** (:mod:`~autoplan.cost.pipeline`): each chunk sends its
  output activation forward (in its forward) and its input's gradient backward (in its
  backward), and its rank pays for the sends it makes (the first and last stage one per
  micro-batch, a middle stage two); with tensor parallelism each rank sends ``1/tp`` of
  it when the stack scatters (Narayanan et al. 2021, Sec. 4.1), the whole tensor
  otherwise. A CPU rank whose profile measured the host work per message end
  (``OpOverhead.pipeline_message_s``: gloo's transport threads) pays that instead of the
  link's time: gloo's isend returns at once.

The ranks combine through the schedule (:mod:`autoplan.cost.schedules`;
:func:`~autoplan.cost.pipeline.step_time`).  After the last backward, each rank
(:func:`~autoplan.cost.pipeline.rank_eval`) reduces its gradients over its data-parallel (x
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
does, which hides more.  Where ranks share fewer cores (``NodeSpec.shared_cores``;
:mod:`~autoplan.cost.hetero`),
what that hides still takes the cores: the step pays the hidden seconds times
``1 - cores / ranks``.  Tied embeddings split over the first and last stages
all-reduce their gradient between the two (Shoeybi et al. 2019).  The
**optimizer** step is memory-bound: ``local params * bytes accessed per param /
memory bandwidth``; on a device whose host is the device (a CPU's ``op_overhead``) it
adds the host's time per parameter tensor, for a DTensor (the parameters FSDP2's
``fully_shard``/``replicate`` and tensor parallelism leave) at its own figure.

Memory of one device
--------------------
(:func:`~autoplan.cost.memory.rank_memory`.)  Model states per ZeRO stage (Rajbhandari et
al. 2020, Sec. 5) over the ``dp * cp`` group (an expert bank's: ``1/ep`` of it per
device, sharded over the ``dp * cp / ep`` ranks holding the same experts, which also
reduce its gradients); activations per micro-batch from the captured saved bytes
(Korthikanti et al. 2022, Sec. 4: the part outside tensor-parallel regions shrinks by
``tp`` only with sequence parallelism, the part inside by ``tp``; selective recompute and
fused attention drop the ``s x s`` part; full recompute keeps each block's input) times
the micro-batches in flight, plus one layer's working set under full recompute, and on
the stage computing the loss its fp32 logits (``CostOptions.loss_fp32_copy``,
:func:`~autoplan.cost.memory.loss_bytes_per_logit`); buffers (gathered ZeRO-3 layers,
gradient buckets or, where ZeRO-1/2 reduce-scatter per layer, one layer's unsharded
gradients, pipeline send/receive, under ``CostOptions.autocast`` the bf16 weight copies
torch.autocast caches, and under ``CostOptions.grad_accumulate_add`` the largest ZeRO-0/1
module's fresh gradient of a later micro-batch) and the runtime reserve from
``profiles/cost/cost-model.yaml``.

The host
--------
On a CPU the host is the device: a measured ``op_overhead`` adds per operator.  On a GPU
the host dispatches ahead of the device; with a measured ``op_overhead``
(``autoplan profile`` on CUDA) each layer takes the longer of the host's work and the
device's, per direction (:func:`~autoplan.cost.compute.host_runs_ahead`); without one
(datasheet profiles) the device's alone.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..errors import ConfigError, StrategyError
from ..strategy import Precision, Recompute, Strategy
from . import comm as _comm
from .comm import LOSS_REDUCE_BYTES
from . import compute as _compute
from . import hetero as _hetero
from . import layout as _layout
from . import pipeline as _pipeline
from .calibration import (DEFAULT_CALIBRATION, Calibration, apply_calibration, attention_tables,
                          resolve_calibration)
from .constants import CostConstants, CostOptions, load_constants
from .kernels import apply_kernel_tables, load_kernel_tables
from .layout import Layout, PrecisionCosts, _fp8_scaling, _ledger_dtypes, layout_from_plan
from .ledger import Ledger, LedgerBuilder
from .memory import activation_bytes
from .result import BREAKDOWN_KEYS, Estimate, StageEstimate
from .summary import LayerCost, summarize
# names that moved to the term modules, importable from here as before
from .comm import prefetch_exposed  # noqa: F401
from .compute import (AUTOCAST_CAST_BYTES, CAUSAL_BLOCK_FRACTION,  # noqa: F401
                      ELEMENTWISE_BACKWARD_FACTOR, FUSED_BACKWARD_PRODUCTS, LayerTime, _host_s,
                      host_runs_ahead)
from .layout import Segment  # noqa: F401
from .memory import AUTOCAST_COPY_BYTES, _local_params, loss_bytes_per_logit  # noqa: F401
from .pipeline import GRAD_ACCUMULATE_READS_WRITES  # noqa: F401

__all__ = ["CostEngine", "QuickEstimate", "LayerTime", "PrecisionCosts", "CAUSAL_BLOCK_FRACTION",
           "ELEMENTWISE_BACKWARD_FACTOR", "layout_from_plan", "Layout", "Segment"]


# --------------------------------------------------------------------------- results
class QuickEstimate(NamedTuple):
    """The three numbers a search needs, without building records."""

    step_time_s: float
    peak_memory_bytes: float
    fits: bool


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
        self.options = options or CostOptions()
        self.cluster = apply_calibration(cluster, calibration) if calibration else cluster
        # measured kernel tables over the fit (calibration None: the profiles as they are)
        if calibration and self.options.kernel_tables:
            self.cluster = apply_kernel_tables(self.cluster,
                                               load_kernel_tables(self.options.kernel_tables))
        self._module_shares: dict[str, tuple[float, ...]] = {}   # per template
        #: fused-attention curves per device type, for the options' attention kernel
        self._attention_tables = (attention_tables(self.cluster, calibration,
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
        self._peaks: dict[object, tuple[float, ...]] = {}    # dtype -> every device's peak

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
    # engine itself prices layouts with them too.  Each is a function of its term's
    # module taking the engine first (see the module docstring).

    precision_costs = _layout.precision_costs

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

    template_time = _compute.template_time
    template_flops = _compute.template_flops
    core_fraction = _compute.core_fraction
    model_compute_s = _compute.model_compute_s
    model_host_s = _compute.model_host_s

    def activation_bytes(self, layer: LayerCost, tp: int, sp: bool, recompute: Recompute,
                         cp: int) -> float:
        """Activation bytes one layer saves for its backward per sequence, in the graph's
        activation dtype (Korthikanti et al. 2022, Sec. 4;
        :func:`autoplan.cost.memory.activation_bytes` with this engine's fused attention)."""
        return activation_bytes(layer, tp=tp, sequence_parallel=sp, recompute=recompute, cp=cp,
                                fused_attention=self.options.fused_attention)

    device_of = _hetero.device_of
    collective_time = _comm.collective_time
    module_shares = _comm.module_shares
    dispatch_bytes = _comm.dispatch_bytes
    routing_weight_bytes = _comm.routing_weight_bytes
    dispatch_share = _comm.dispatch_share
    layer_time_bound = _comm.layer_time_bound

    # ------------------------------------------------------------------ terms
    # compute (autoplan.cost.compute)
    _fp8_linears = _compute.fp8_linears
    _fp8_terms = _compute.fp8_terms
    _te_weight_cast_s = _compute.te_weight_cast_s
    _ledger_flops = _compute.ledger_flops
    # communication and one layer's terms (autoplan.cost.comm)
    _groups = _comm.rank_groups
    _layer_terms = _comm.layer_terms
    _fp8_step_scales = _comm.fp8_step_scales
    _loss_reduce_s = _comm.loss_reduce_s
    # devices, placement and shared cores (autoplan.cost.hetero)
    _shared_cores = _hetero.shared_cores
    _node_devices = _hetero.node_devices
    _dp_concurrency = _hetero.dp_concurrency
    _placement = _hetero.placement
    _replicas_alike = _hetero.replicas_alike
    # one pipeline rank (autoplan.cost.pipeline; its memory autoplan.cost.memory)
    _stages_of = _pipeline.stages_of
    _tied_owned = _pipeline.tied_owned
    _replica_devices = staticmethod(_pipeline.replica_devices)
    _rank = _pipeline.rank_eval

    def _device_peaks(self, dtype) -> tuple[float, ...]:
        """Every device's peak FLOP/s at ``dtype``, in device order (read once per dtype:
        an estimate sums them over its devices, a thousand on large clusters)."""
        hit = self._peaks.get(dtype)
        if hit is None:
            hit = self._peaks[dtype] = tuple(self.cluster.device_type_of(i).peak(dtype)
                                             for i in range(self.cluster.num_devices))
        return hit

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
            step, crit, t_pipe, tail_rank, shared_cost = _pipeline.step_time(lay, ranks, m,
                                                                              shared)
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
        peaks = self._device_peaks("bf16" if _fp8_scaling(recipe.dtype) else recipe.dtype)
        peak_sum = sum(peaks[i] for devs in lay.rank_devices for i in devs)
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
