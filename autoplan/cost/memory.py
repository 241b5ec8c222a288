"""Memory formulas: saved activations of one layer, model states per ZeRO stage.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Sec. 4, Table 2), from a layer's captured saved bytes
split three ways (:class:`~autoplan.cost.summary.LayerCost`):

* ``R`` saved outside tensor-parallel regions (layer norms, dropout masks,
  the inputs of the column-parallel linears): divided by ``tp`` only under
  sequence parallelism;
* ``S`` saved inside them and linear in the sequence: divided by ``tp``;
* ``Q`` the attention core's ``s x s`` tensors: divided by ``tp``; dropped by
  selective recompute and by a fused attention kernel.

So ``act = R / (tp if sp else 1) + (S + Q) / tp``; for Megatron's GPT layer
(``R = 10 sbh``, ``S = 24 sbh``, ``Q = 5 a s^2 b``) this is exactly
``sbh (10 + 24/t + 5as/(ht))`` (tensor parallel), ``sbh/t (34 + 5as/h)``
(with sequence parallel) and ``34 sbh / t`` (plus selective recompute).  Full
recompute keeps only each layer's input, ``2 sbh`` (``/t`` with sequence
parallelism, whose checkpoint is the sharded input).  Context parallelism
divides everything by ``cp`` (each rank holds ``s / cp`` tokens).

Model states per parameter (Rajbhandari et al. 2020, Sec. 5): ZeRO-1
partitions the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also the
parameters, over the ``dp * cp`` ranks.

Examples
--------
>>> model_state_bytes(1000, zero=0, shards=4, per_param=(2, 2, 12))
(2000.0, 2000.0, 12000.0)
>>> model_state_bytes(1000, zero=3, shards=4, per_param=(2, 2, 12))
(500.0, 500.0, 3000.0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..precision import DTYPE_BYTES
from ..strategy import Precision, Recompute
from .layout import Layout, PrecisionCosts
from .result import MemoryBreakdown
from .schedules import in_flight
from .summary import LayerCost

if TYPE_CHECKING:
    from .engine import CostEngine

__all__ = ["activation_bytes", "model_state_bytes", "fsdp2_state_bytes", "loss_bytes_per_logit",
           "AUTOCAST_COPY_BYTES", "RankHoldings", "rank_memory"]


def activation_bytes(layer: LayerCost, *, tp: int = 1, sequence_parallel: bool = False,
                     recompute: Recompute = Recompute.NONE, cp: int = 1,
                     fused_attention: bool = False) -> float:
    """Saved activation bytes of ``layer`` per sequence on one device (captured dtype).

    See the module docstring for the formula (Korthikanti et al. 2022, Sec. 4).
    Recompute applies to blocks only (embeddings and heads are never recomputed).
    """
    drop_quadratic = fused_attention or (recompute is Recompute.SELECTIVE and layer.is_block)
    quad = 0.0 if drop_quadratic else layer.saved_quadratic_bytes
    outside = layer.saved_replicated_bytes / (tp if sequence_parallel else 1)
    whole = (outside + (layer.saved_sharded_bytes + quad) / tp) / cp
    if recompute is Recompute.FULL and layer.is_block:
        # the checkpoint is the layer's input, never more than the layer saves anyway
        return min(whole, layer.stream_bytes / ((tp if sequence_parallel else 1) * cp))
    return whole


def model_state_bytes(params: float, *, zero: int, shards: int,
                      per_param: tuple[int, int, int]) -> tuple[float, float, float]:
    """``(parameter, gradient, optimizer)`` bytes of ``params`` parameters on one device.

    ``per_param`` is ``(param, grad, optimizer)`` bytes per parameter; ``shards``
    the number of ranks ZeRO partitions over (Rajbhandari et al. 2020, Sec. 5).
    """
    pb, gb, ob = per_param
    return (params * pb / (shards if zero >= 3 else 1),
            params * gb / (shards if zero >= 2 else 1),
            params * ob / (shards if zero >= 1 else 1))


def fsdp2_state_bytes(params: float, *, zero: int, shards: int, master_bytes: int,
                      compute_bytes: int, grad_bytes: int, optimizer_bytes: int,
                      accumulates: bool) -> tuple[float, float, float]:
    """``(parameter, gradient, optimizer)`` bytes of ``params`` parameters on one device
    during a step, as FSDP2 holds them under a ``MixedPrecisionPolicy``
    (``CostOptions.master_weights == "fsdp2"``, :mod:`autoplan.precision`).

    The parameters are the master weights (``master_bytes``), sharded over ``shards``
    ranks under ZeRO-1/2/3 (``fully_shard``; whole under ZeRO-0's ``replicate``).  Their
    ``compute_bytes`` copies are gathered for the forward and kept until the last
    micro-batch's backward under ZeRO-0/1/2 (``reshard_after_forward=False``); under
    ZeRO-3 only the layers being computed hold them (the engine's gathered-layer
    buffers, not counted here).  Gradients (``grad_bytes``, the reduction dtype) are
    whole under ZeRO-0; under ZeRO-1 whole while they accumulate over micro-batches
    (no reduce-scatter before the last), else sharded as under ZeRO-2/3.  The
    optimizer's moments shard with the parameters.

    >>> fsdp2_state_bytes(1000, zero=1, shards=4, master_bytes=4, compute_bytes=2,
    ...                   grad_bytes=4, optimizer_bytes=8, accumulates=True)
    (3000.0, 4000.0, 2000.0)
    >>> fsdp2_state_bytes(1000, zero=3, shards=4, master_bytes=4, compute_bytes=2,
    ...                   grad_bytes=4, optimizer_bytes=8, accumulates=True)
    (1000.0, 1000.0, 2000.0)
    """
    split = shards if zero >= 1 else 1
    held = params * master_bytes / split + (params * compute_bytes if zero <= 2 else 0.0)
    whole_grads = zero == 0 or (zero == 1 and accumulates)
    return held, params * grad_bytes / (1 if whole_grads else shards), \
        params * optimizer_bytes / split


#: Under torch.autocast over fp32 weights (:attr:`CostOptions.autocast`): bytes per
#: parameter of the bf16 copies it caches during a forward
#: (:data:`autoplan.cost.compute.AUTOCAST_CAST_BYTES`: what its casts move)
AUTOCAST_COPY_BYTES = 2


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


class RankHoldings(NamedTuple):
    """What the layers of one pipeline rank hold on one of its devices, as
    :func:`autoplan.cost.pipeline.rank_eval` sums them (parameters after tensor and expert
    parallelism, bytes in the recipe's activation dtype)."""

    params_by_zero: list[float]     # local parameters per ZeRO stage (0..3)
    experts_by_zero: list[float]    # those of them in expert banks
    tied_extra: float               # a tied weight's copy owned by another rank (whole)
    act_per_mb: float               # saved activation bytes of one micro-batch
    shared: float                   # inputs every layer shares (held once per micro-batch)
    work: float                     # one layer's working set beyond it saves (full recompute)
    max_layer_params: float         # the largest ZeRO-3 gather unit
    largest_accumulated: float      # the largest module whose gradient accumulates
    recv_per_micro_batch: float     # pipeline receive buffers of one micro-batch
    cut_out: float                  # largest chunk boundary, scattered over tp
    cut_whole: float                # ... and whole


def rank_memory(engine: CostEngine, lay: Layout, rank: int, micro_batches: int,
                recipe: PrecisionCosts, chunks, held: RankHoldings, zero_degree: int
                ) -> tuple[float, MemoryBreakdown]:
    """``(micro-batches in flight, memory)`` of one device of pipeline rank ``rank`` holding
    ``held`` (see the module docstring of :mod:`autoplan.cost.engine`): model states per
    ZeRO stage over the ``zero_degree`` data-parallel ranks (an expert bank's over the
    ``zero_degree / ep`` holding the same experts; fp32 masters under FSDP2's policy,
    :func:`fsdp2_state_bytes`), the activations of the micro-batches in flight
    (:func:`autoplan.cost.schedules.in_flight`) with the loss's working set
    (:func:`loss_bytes_per_logit`), buffers (gathered ZeRO-3 layers, unsharded gradients,
    gradient buckets, pipeline send/receive, autocast's weight copies, an accumulating
    gradient) and the runtime reserve (``profiles/cost/cost-model.yaml``)."""
    s = engine.summary
    opts = engine.options
    kmem = engine.constants.memory
    pp, v, cp = lay.pp, lay.virtual_stages, lay.cp
    b = lay.micro_batch
    edp = zero_degree // lay.ep
    param_bytes, grad_bytes = recipe.param_bytes, recipe.grad_bytes   # per parameter
    (params_by_zero, experts_by_zero, tied_extra, act_per_mb, shared, work, max_layer_params,
     largest_accumulated, recv_per_micro_batch, cut_out, cut_whole) = held
    x0, x1, x2, x3 = experts_by_zero
    accumulates = opts.grad_accumulate_add and micro_batches > 1
    autocast = opts.autocast and recipe.dtype != "fp32"
    computed = sum(params_by_zero) + tied_extra + sum(experts_by_zero)
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
    flight = in_flight(lay.schedule, rank, pp, micro_batches, v)
    acts = flight * (act_per_mb + shared) + work
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
    return flight, MemoryBreakdown(held_params, held_grads, held_optimizer, acts, buffers,
                                   reserve)
