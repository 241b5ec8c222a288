"""Compute terms of the cost engine: a layer's seconds and FLOPs on one device.

* **matmuls** (:func:`template_time`, :func:`template_flops`): every FLOP-carrying node
  of a layer at ``flops / (peak[dtype] * efficiency(flops))`` (the device profile's
  table, :meth:`DeviceType.efficiency <autoplan.hardware.DeviceType.efficiency>`),
  sharded by tensor and context parallelism; an expert bank's GEMMs one expert at a
  time; under an FP8 recipe the converted linears' GEMMs at the FP8 peak, their
  operands quantized first (:mod:`autoplan.cost.fp8`; :func:`fp8_linears`,
  :func:`fp8_terms`).
* **fused attention** (Dao et al. 2022, Alg. 2/4; Dao 2023 Sec. 3.1): the core's backward
  recomputes its forward (:data:`FUSED_BACKWARD_PRODUCTS`); a causal kernel computes
  :data:`CAUSAL_BLOCK_FRACTION` of the scores (:func:`core_fraction`).
* **memory-bound operators** (the roofline of Williams et al. 2009): bytes over the
  memory bandwidth, the backward's as each derivative moves them on a CPU,
  :data:`ELEMENTWISE_BACKWARD_FACTOR` times the forward's on a GPU, or a kind's
  measured speed (``DeviceType.elementwise_rates``).
* **the host** (:func:`host_runs_ahead`): on a CPU its dispatch per operator and
  autograd node adds (:func:`_host_s`, :func:`_selective_dispatch_s`); on a GPU it runs
  ahead of the device.

The module docstring of :mod:`autoplan.cost.engine` says where each figure comes from.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from ..strategy import Precision, Recompute
from . import fp8 as _fp8
from .calibration import _is_gpu
from .layout import PrecisionCosts, Segment, _fp8_scaling
from .ledger import LedgerBuilder
from .memory import _local_params
from ..precision import fp8_all_gather
from .summary import BACKWARD_TRAFFIC_DEFAULT, LayerCost, MatmulNode

if TYPE_CHECKING:
    from .engine import CostEngine

__all__ = ["LayerTime", "CAUSAL_BLOCK_FRACTION", "FUSED_BACKWARD_PRODUCTS",
           "ELEMENTWISE_BACKWARD_FACTOR", "AUTOCAST_CAST_BYTES", "host_runs_ahead",
           "template_time", "template_flops", "expert_kernel_fraction", "core_fraction",
           "model_compute_s", "model_host_s", "fp8_linears", "fp8_terms", "ledger_flops"]


#: Backward bytes of a memory-bound operator per forward byte on a GPU, and on a CPU where
#: its derivative is not known (:func:`autoplan.cost.summary.backward_traffic` knows the
#: common ones; the module docstring says why GPUs keep this for every one): it reads
#: the output gradient and what it saved and writes the input gradient (about twice the
#: forward's one read and one write; Korthikanti et al. 2022 count the same saved
#: tensors).  A kind a profile times apart (``elementwise_rates``) is counted at this in
#: the summary's backward bytes and its measured backward replaces it.
ELEMENTWISE_BACKWARD_FACTOR = BACKWARD_TRAFFIC_DEFAULT


#: Under torch.autocast over fp32 weights (:attr:`CostOptions.autocast`): bytes moved per
#: parameter by one cast (fp32 -> bf16 in the forward, the gradient bf16 -> fp32 in the
#: backward: 4 + 2; :data:`autoplan.cost.memory.AUTOCAST_COPY_BYTES`: the copies it holds)
AUTOCAST_CAST_BYTES = 6


#: A fused attention kernel's backward matmuls against its forward's: the gradients of
#: the values, the probabilities, the queries and the keys (four products) against the
#: scores and the values (two).  The kernel's recompute of the scores is priced apart
#: (the forward again, Dao et al. 2022); torch's FLOP formula counts it in the backward.
FUSED_BACKWARD_PRODUCTS = 2.0


#: Fraction of the attention core a fused kernel computes under a causal mask: the
#: blocks above the diagonal are skipped (Dao 2023, FlashAttention-2, Sec. 3.1.1).
CAUSAL_BLOCK_FRACTION = 0.5


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


def fp8_linears(engine: CostEngine, template: str) -> dict[str, "_fp8.Fp8Linear"]:
    """The linears of ``template`` whose GEMMs the options' FP8 library converts
    (:func:`autoplan.precision.fp8_converts`), by name."""
    key = (template, engine.options.fp8_library)
    hit = engine._fp8_cache.get(key)
    if hit is None:
        linears, _ = engine.summary.linears[template]
        hit = engine._fp8_cache[key] = _fp8.fp8_linears_of(linears, engine.options.fp8_library)
    return hit


def fp8_terms(engine: CostEngine, layer: LayerCost, seg: "Segment", recipe: PrecisionCosts,
              shards: int) -> "_fp8.LayerFp8 | None":
    """torchao's FP8 terms of ``layer`` in segment ``seg`` over ``shards`` data-parallel
    ranks (:class:`autoplan.cost.fp8.LayerFp8`), or None: not an FP8 recipe, run by
    another library, or no linear of the layer converted."""
    scaling = _fp8_scaling(recipe.dtype)
    if scaling is None or engine.options.fp8_library != "torchao":
        return None
    converted = engine._fp8_linears(layer.template)
    if not converted:
        return None
    t = seg.tp
    gathered = 0.0
    if fp8_all_gather(recipe.dtype, seg.zero, shards):
        gathered = sum(math.prod(l.local(t)) for l in converted.values())
    linears, entries = engine.summary.linears[layer.template]
    regions = frozenset(e for e in entries if e and _fp8.region_fp8(e, linears, converted))
    return _fp8.LayerFp8(converted, scaling, t, seg.sequence_parallel, gathered,
                         regions if _fp8.float8_tp("torchao", scaling, t) else frozenset(),
                         engine.summary.seq_len or 1)


def te_weight_cast_s(engine: CostEngine, chunks, recipe: PrecisionCosts, device, ep: int,
                     micro_batches: int) -> float:
    """Seconds a rank holding ``chunks`` spends per step quantizing the weights of its
    converted linears under Transformer Engine (:func:`autoplan.cost.fp8
    .te_weight_cast_bytes`): once a step, or once per micro-batch where ZeRO-3 gathers
    them again; 0 for another recipe or library."""
    scaling = _fp8_scaling(recipe.dtype)
    if scaling is None or engine.options.fp8_library != "transformer-engine":
        return 0.0
    nbytes = 0.0
    for chunk in chunks:
        for seg in chunk:
            casts = micro_batches if seg.zero >= 3 else 1
            for template, count in engine.layer_counts(seg.lo, seg.hi):
                nbytes += casts * count * sum(
                    _fp8.te_weight_cast_bytes(lin, scaling, seg.tp, ep)
                    for lin in engine._fp8_linears(template).values())
    return nbytes / device.memory_bw_bytes_per_s


def model_compute_s(engine: CostEngine, b: int, dtype: str = "fp32") -> tuple[float, float]:
    """Seconds of the whole model's forward and backward on one device (the first of
    the cluster) for a micro-batch of ``b`` sequences in ``dtype``: every layer's
    :func:`template_time` without parallelism, recompute or communication."""
    device = engine.device_of((0,))
    fwd = bwd = 0.0
    for template, count in engine.layer_counts(0, len(engine.summary.layers)):
        t = engine.template_time(template, b, 1, 1, device, dtype)
        fwd += count * t.forward_s
        bwd += count * t.backward_s
    return fwd, bwd


def model_host_s(engine: CostEngine) -> tuple[float, float]:
    """The host seconds of the whole model's forward and backward on the first device
    of the cluster (a CPU's ``OpOverhead`` per dispatched operator and autograd node,
    unscaled; whatever the micro-batch), which :func:`model_compute_s` includes; 0 on
    a device without them or whose host runs ahead (GPUs)."""
    device = engine.device_of((0,))
    overhead = device.op_overhead
    if overhead is None or host_runs_ahead(device):
        return 0.0, 0.0
    fwd = bwd = 0.0
    for template, count in engine.layer_counts(0, len(engine.summary.layers)):
        host_fwd, host_bwd = _host_s(overhead, engine._templates[template],
                                     engine.summary.op_counts[template][0],
                                     engine._host_counted)
        fwd += count * host_fwd
        bwd += count * host_bwd
    return fwd, bwd


def core_fraction(engine: CostEngine, node: MatmulNode, cp: int) -> float:
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
    if not engine.summary.causal:
        return 1.0
    if engine.options.fused_attention or (node.fused and cp == 1):
        return CAUSAL_BLOCK_FRACTION
    return 1.0


def template_flops(engine: CostEngine, template: str, b: int, tp: int, cp: int,
                   fp8_only: bool = False) -> tuple[float, float, float]:
    """``(forward, backward, attention core forward)`` matmul FLOPs of one ``template``
    layer and micro-batch of ``b`` sequences on one device, as :func:`template_time`
    prices them: sharded by tensor and context parallelism; the core as its kernel
    computes it (:func:`core_fraction`), a fused kernel's backward recomputing its
    forward (the ledger's figures, :mod:`.ledger`).  ``fp8_only``: the part an FP8
    recipe runs in FP8 (its converted linears' GEMMs)."""
    fused = engine.options.fused_attention
    experts = engine._templates[template].num_experts
    token_split = tp if engine.options.moe_tokens_split_over_tp else 1
    converted = engine._fp8_linears(template) if fp8_only else {}
    banks = any(l.num_experts > 1 for l in converted.values())
    fwd = bwd = core = 0.0
    for n in engine.summary.templates[template]:
        if fp8_only and (n.core or not (n.module in converted or (n.expert and banks))):
            continue
        div = (tp if n.sharded else 1) * cp
        if n.expert and experts > 1:
            div *= token_split
        f, g = n.fwd_flops * b / div, n.bwd_flops * b / div
        if n.fused:
            g = FUSED_BACKWARD_PRODUCTS * f
        if n.core:
            causal = engine.core_fraction(n, cp)
            f, g = f * causal, g * causal
            core += f
            if fused:
                g += f
        fwd += f
        bwd += g
    return fwd, bwd, core


def ledger_flops(engine: CostEngine, ledger: LedgerBuilder, seg: Segment, b: int, cp: int,
                 ep: int) -> None:
    """The matmul FLOPs of segment ``seg``'s layers per micro-batch, into ``ledger``:
    forward, backward and what recompute runs again (a block's forward under full
    recompute, its attention core under selective, as
    :func:`autoplan.cost.comm.layer_terms` prices)."""
    selective = seg.recompute is Recompute.SELECTIVE and not engine.options.fused_attention
    fp8 = ledger.fp8
    for l in engine.summary.layers[seg.lo:seg.hi]:
        fwd, bwd, core = engine.template_flops(l.template, b, seg.tp, cp)
        rc = 0.0
        if l.is_block and seg.recompute is Recompute.FULL:
            rc = fwd
        elif l.is_block and selective:
            rc = core
        if fp8:
            # an FP8 recipe's converted GEMMs, apart from the rest (bf16)
            f8, b8, _ = engine.template_flops(l.template, b, seg.tp, cp, fp8_only=True)
            r8 = f8 if l.is_block and seg.recompute is Recompute.FULL else 0.0
            ledger.flops(l.name, f8, b8, r8, dtype="fp8")
            fwd, bwd, rc = fwd - f8, bwd - b8, rc - r8
        ledger.flops(l.name, fwd, bwd, rc)


def expert_kernel_fraction(options, experts: int, ep: int) -> float:
    """The fraction of a rank's expert-bank GEMM (its ``experts / ep`` local experts'
    rows) that one kernel runs, or the kernels running at once, which is what sets
    their efficiency (:class:`~autoplan.cost.constants.CostOptions`): the whole bank as
    one grouped kernel (``expert_grouped_gemm``); ``min(streams, experts / ep)``
    experts' GEMMs at a time on ``expert_gemm_streams`` concurrent streams (Transformer
    Engine's ``GroupedLinear``); one expert's without grouped GEMMs (a loop).

    >>> from autoplan.cost import CostOptions
    >>> expert_kernel_fraction(CostOptions(stack="megatron-core"), experts=128, ep=8)
    0.25
    >>> expert_kernel_fraction(CostOptions(stack="megatron-core"), experts=256, ep=64)
    1.0
    >>> expert_kernel_fraction(CostOptions(stack="megatron-2021"), experts=8, ep=2)
    0.25
    """
    if not options.expert_grouped_gemm:
        return ep / experts
    streams = options.expert_gemm_streams
    if streams and streams * ep < experts:
        return streams * ep / experts
    return 1.0


def template_time(engine: CostEngine, template: str, b: int, tp: int, cp: int, device, dtype: str,
                  sp: bool = False, ep: int = 1) -> LayerTime:
    """Compute seconds of one ``template`` layer and micro-batch of ``b`` sequences on
    one ``device`` (:func:`autoplan.cost.hetero.device_of`) in ``dtype``
    (:attr:`PrecisionCosts.dtype`),
    under tensor (``tp``, sequence parallel ``sp``), context (``cp``) and expert
    (``ep``) parallelism, without recompute or communication.

    Each FLOP-carrying node: ``flops / (peak * efficiency(flops))`` on one device;
    each memory-bound node: the bytes it reads and writes over the device's memory
    bandwidth and, in the backward, the bytes its derivative moves on a CPU
    (``GraphSummary.elementwise_backward``) and :data:`ELEMENTWISE_BACKWARD_FACTOR`
    times the forward's on a GPU, or at the device's measured speed for its kind
    (``elementwise_rates``).
    An expert bank's GEMMs run as the stack runs them (:func:`expert_kernel_fraction`):
    one grouped kernel over the rank's local experts, at the profile's measured
    grouped-GEMM efficiency by one expert's FLOPs where it has one (under an FP8 recipe
    times the FP8/bf16 speed ratio of a GEMM of the bank's size), else at the matmul
    curve of the whole bank; per-expert kernels on concurrent streams (Transformer
    Engine), at the matmul curve of the concurrent experts' FLOPs; or one expert at a
    time.  One expert's GEMM has ``ep x tokens x top-k / experts`` rows (this rank's
    local experts take the tokens of its ``ep`` group), and under expert parallelism
    the busiest rank runs ``expert_imbalance`` times the mean load.
    """
    fused = engine.options.fused_attention
    key = (template, b, tp, cp, device.name, dtype, fused, sp, ep,
           engine.options.attention_kernel)
    hit = engine._template_times.get(key)
    if hit is not None:
        return hit
    layer = engine._templates[template]
    experts = layer.num_experts
    imbalance = engine.options.expert_imbalance if ep > 1 else 1.0
    token_split = tp if engine.options.moe_tokens_split_over_tp else 1
    scaling = _fp8_scaling(dtype)
    fp8 = scaling is not None
    if fp8:
        # the GEMMs of the linears the recipe converts in FP8, the rest in bf16, and
        # their operands quantized as the library does (autoplan.cost.fp8)
        dtype = "bf16"
        library = engine.options.fp8_library
        converted = engine._fp8_linears(template)
        tokens = b * (engine.summary.seq_len or 1) / cp
        # an expert bank quantizes the rows its local experts take: every token-to-expert
        # assignment of this rank's tokens (its ep group's, for its 1/ep of the experts),
        # the busiest rank's share under imbalance
        routed = layer.expert_tokens * b / cp / token_split * imbalance
        cast_fwd = cast_bwd = 0.0
        for lin in converted.values():
            f8, b8 = _fp8.cast_bytes(lin, library, scaling, tokens=tokens, tp=tp,
                                     experts_tokens=routed if lin.num_experts > 1 else None)
            cast_fwd, cast_bwd = cast_fwd + f8, cast_bwd + b8
        rowwise = library == "torchao" and scaling == "row"
    # fp32 matmuls on TF32 tensor cores where asked (CostOptions.fp32_matmuls); the
    # elementwise bytes stay the recipe's
    mm = "tf32" if dtype == "fp32" and engine.options.fp32_matmuls == "tf32" else dtype
    peak = device.peak(mm)
    fwd = bwd = core = wgrad = 0.0
    # fused-attention kernels (the stack's, or a captured SDPA call) at their own speed
    attention = engine._attention_tables.get(device.name)
    # one grouped kernel over the local experts (a measured table of its own, where the
    # profile has one), per-expert kernels on concurrent streams, or one at a time
    one_kernel = engine.options.expert_grouped_gemm and not engine.options.expert_gemm_streams
    bank_share = expert_kernel_fraction(engine.options, experts, ep) if experts > 1 else 1.0
    converted_experts = fp8 and any(l.num_experts > 1 for l in converted.values())
    for n in engine.summary.templates[template]:
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
            if one_kernel:
                # a measured grouped GEMM, by the FLOPs of one expert's part of it
                grouped_eff = device.grouped_efficiency(
                    ref * imbalance * ep / experts, "bf16" if fp8 else dtype)
            # the FLOPs one kernel, or the kernels running at once, multiply
            ref = ref * imbalance * bank_share
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
            if grouped_eff is not None:
                # the measured (bf16) grouped GEMM at the FP8/bf16 speed of a GEMM of the
                # bank's size
                speedup = rate_backward / (peak * device.efficiency(ref, "bf16"))
                rate = rate_backward = peak * grouped_eff * speedup
        else:
            rate = peak * device.efficiency(ref, mm)
        tf, tb = f / rate, g / (rate_backward or rate)
        if n.core:
            causal = engine.core_fraction(n, cp)
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
    rep, shd, quad = engine.summary.elementwise[template]
    if fused:
        quad = 0.0      # inside the attention kernel
    # captured bytes are in the graph's activation dtype; the recipe's dtype moves,
    # fp32 under autocast (CostOptions.autocast)
    autocast = engine.options.autocast and dtype != "fp32"
    ew_bytes = Precision.FP32.bytes if autocast else Precision(dtype).bytes
    act_scale = ew_bytes / engine.summary.activation_bytes

    def rank_bytes(r: float, s: float, q: float) -> float:
        """This rank's bytes of a micro-batch of (replicated, sharded, quadratic)."""
        return (r / (tp if sp else 1) + (s + q) / tp) * b / cp * act_scale

    moved = rank_bytes(rep, shd, quad)
    ew = moved / device.memory_bw_bytes_per_s
    if not host_runs_ahead(device):
        # where the host is the device (CPUs): the backward's bytes as each operator's
        # derivative moves them, a dropout of probability 0 free (summary)
        r_rep, r_shd, r_quad = engine.summary.elementwise_returned[template]
        fwd += ew - rank_bytes(r_rep, r_shd, 0.0 if fused else r_quad) \
            / device.memory_bw_bytes_per_s
        b_rep, b_shd, b_quad = engine.summary.elementwise_backward[template]
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
        for kind, (k_rep, k_shd, k_quad) in engine.summary.elementwise_kinds[template].items():
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
        local = sum(_local_params(engine._templates[template], tp, ep))
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
        ops, tp_linears, tp_shared = engine.summary.op_counts[template]
        host_fwd, host_bwd = _host_s(overhead, engine._templates[template], ops,
                                     engine._host_counted)
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
    engine._template_times[key] = hit
    return hit
