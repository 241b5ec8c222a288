"""Constants and options of the cost model.

:class:`CostConstants` holds the numbers the cost model needs that are not a
property of one device or link (bytes of model state per parameter, the
allocator reserve, communication buffers).  They are read from
``profiles/cost/cost-model.yaml``; each carries its source there.

:class:`CostOptions` holds the choices of the training *implementation* that
change the cost of a layout without being part of it: whether the attention
core runs as a fused kernel, which communications overlap with compute.  They
default to what autoplan's own runtime does.

Examples
--------
>>> c = load_constants()
>>> c.model_states.mixed_param_bytes + c.model_states.mixed_grad_bytes + \\
...     c.model_states.mixed_optimizer_bytes
16
>>> CostOptions().overlap_grad_reduce
True
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import yaml

from ..errors import ConfigError, RecordError
from ..hardware.profiles import shipped_profiles_dir
from ..precision import FP8_LIBRARIES, GRAD_REDUCE_DTYPES
from ..records import Record

__all__ = [
    "ModelStateBytes",
    "OptimizerTraffic",
    "MemoryConstants",
    "CostConstants",
    "CostOptions",
    "Stack",
    "STACKS",
    "ATTENTION_KERNELS",
    "MOE_DISPATCHERS",
    "TE_GEMM_STREAMS",
    "cost_profiles_dir",
    "load_constants",
]


@dataclass(frozen=True)
class ModelStateBytes(Record):
    """Bytes per parameter of parameters, gradients and optimizer states.

    Rajbhandari et al. 2020 (ZeRO), Sec. 3.1: mixed-precision Adam keeps
    ``2 + 2 + 12`` bytes per parameter.
    """

    mixed_param_bytes: int
    mixed_grad_bytes: int
    mixed_optimizer_bytes: int
    fp32_param_bytes: int
    fp32_grad_bytes: int
    fp32_optimizer_bytes: int
    source: str

    def per_param(self, mixed: bool) -> tuple[int, int, int]:
        """``(param, grad, optimizer)`` bytes per parameter."""
        if mixed:
            return self.mixed_param_bytes, self.mixed_grad_bytes, self.mixed_optimizer_bytes
        return self.fp32_param_bytes, self.fp32_grad_bytes, self.fp32_optimizer_bytes


@dataclass(frozen=True)
class OptimizerTraffic(Record):
    """Device-memory bytes one Adam step reads and writes per parameter."""

    mixed_bytes_accessed_per_param: int
    fp32_bytes_accessed_per_param: int
    source: str


@dataclass(frozen=True)
class MemoryConstants(Record):
    """Memory outside the model states and activations (see the YAML for sources)."""

    runtime_reserved_bytes: int
    runtime_reserved_source: str
    allocator_fragmentation_fraction: float
    allocator_source: str
    grad_bucket_bytes: int
    grad_buckets_in_flight: int
    grad_bucket_source: str
    zero3_gathered_layers: int
    zero3_unsharded_grad_layers: int
    zero3_source: str

    def __post_init__(self) -> None:
        if not 0 <= self.allocator_fragmentation_fraction < 1:
            raise ConfigError("allocator_fragmentation_fraction must be in [0, 1), got "
                              f"{self.allocator_fragmentation_fraction!r}")
        for name in ("runtime_reserved_bytes", "grad_bucket_bytes", "grad_buckets_in_flight",
                     "zero3_gathered_layers", "zero3_unsharded_grad_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class CostConstants(Record):
    """Every constant of the cost model that is not in a device profile."""

    name: str
    model_states: ModelStateBytes
    optimizer: OptimizerTraffic
    memory: MemoryConstants


@dataclass(frozen=True)
class CostOptions(Record):
    """Implementation choices that change the cost of a layout.

    Parameters
    ----------
    fused_attention : bool
        The attention core runs as one fused kernel (FlashAttention, Dao et al.
        2022): its ``s x s`` intermediates (``saved_quadratic_bytes``) are never
        stored, the backward recomputes them (the attention-core forward FLOPs
        again), and for causal models the kernel skips the masked half of the
        score blocks (Dao 2023, FlashAttention-2, Sec. 3.1).  ``False``: the
        captured graph is costed as it is.
    overlap_grad_reduce : bool
        The data-parallel gradient reduction runs in buckets during the last
        backward pass (PyTorch DDP; Megatron ``--overlap-grad-reduce``).
    overlap_param_gather : bool
        ZeRO parameter all-gathers are prefetched under compute (FSDP
        forward/backward prefetch; Megatron ``--overlap-param-gather``).
    tp_comm_overlap : bool
        Tensor-parallel collectives are split and overlapped with the GEMMs
        they feed (Transformer Engine userbuffers, Megatron ``--tp-comm-overlap``).
    pp_comm_overlap : bool
        Pipeline sends/receives are asynchronous and hidden behind compute.
    zero3_regather_for_recompute : bool
        Under full recompute, ZeRO-3 gathers a layer's parameters once more for
        the recomputed forward (DeepSpeed's hooks release them after every
        forward); FSDP gathers once for recompute and backward together.
    zero3_gather_unit : {"layer", "module"}
        What ZeRO-3 gathers at once: a whole layer (FSDP wrapping each block) or
        one submodule's parameters (DeepSpeed's per-module hooks); sets the
        gathered-parameter buffers.  A per-module gather is prefetched one module
        ahead, under the module before it (:func:`autoplan.cost.comm.prefetch_exposed`),
        a per-layer one under the layer before it.
    dp_nic_per_device : bool
        Data-parallel collectives get only each device's own share of its node's
        NICs (``concurrent_groups = devices per node``) instead of all the NICs of
        the node aggregated over the intra-node fabric (NCCL with one channel per
        NIC, the default).
    memory_fraction : float
        A plan fits when its peak memory is at most this fraction of each
        device's memory.
    expert_imbalance : float
        Under expert parallelism, the busiest expert-parallel rank's routed tokens
        over the mean (>= 1): its expert GEMMs take this many times the mean work and
        the layer waits for it.  Default 1.0, balanced routing, because no published
        measurement of the imbalance between expert-parallel *ranks* was found: Wang
        et al. 2024 ("Auxiliary-Loss-Free Load Balancing Strategy for
        Mixture-of-Experts", arXiv:2408.15664) measure auxiliary-loss routing as
        MaxVio (the most loaded *expert* over the mean, minus one), which overstates a
        rank holding ``experts / ep`` of them; and the published MoE benchmark runs
        (``validation/published_moe.csv``) balance their routing by force or drop
        tokens.  Set it to ``1 + MaxVio`` of your router for a pessimistic price.
    expert_grouped_gemm : bool
        A rank's local experts run as one grouped GEMM per projection (Megatron-Core
        ``--moe-grouped-gemm``, Transformer Engine ``GroupedLinear``, Hugging Face's default
        ``grouped_mm`` experts under :func:`autoplan.parallelize`): priced at the
        profile's measured grouped-GEMM efficiency by one expert's rows
        (``DeviceType.grouped_matmul_efficiency``, :mod:`autoplan.hardware.grouped_gemm`),
        or without one at the efficiency of all their rows as one matmul, with one
        kernel's overhead.
        ``False``: one GEMM per local expert, each at one expert's size (a loop over
        experts, the Hugging Face families' eager expert forward).
    expert_gemm_streams : int
        With ``expert_grouped_gemm``: ``0``, the local experts' GEMMs are one grouped
        kernel (``torch._grouped_mm``); ``n >= 1``, one GEMM kernel per local expert,
        ``n`` of them at a time on concurrent streams (Transformer Engine's
        ``GroupedLinear``, bf16 and FP8 alike: :data:`TE_GEMM_STREAMS`).  The concurrent
        kernels are priced as one GEMM of their combined size, ``min(n, local experts)``
        experts' rows: they share the device and overlap their fixed cost (the
        calibration's ``matmul_overhead_s``), at the dense matmul curve (the profile's
        grouped table measures torch's grouped kernel, not these).
    moe_tokens_split_over_tp : bool
        Under tensor parallelism, each tp rank routes, dispatches and computes the
        experts of only its ``1/tp`` of the tokens (Megatron-Core: the MoE layer runs on
        the sequence-parallel shard, expert tensor parallelism 1).  ``False``: every tp
        rank routes all tokens and runs whole experts on them (what
        :func:`autoplan.parallelize` does).
    moe_dispatcher : {"alltoall", "deepep"}
        How MoE tokens reach their experts.  ``"alltoall"``: every token-to-expert
        assignment is a row of an all-to-all, ``top-k`` copies of each token (Megatron-Core's
        ``alltoall`` dispatcher, what :func:`autoplan.parallelize` runs).  ``"deepep"``: each
        token crosses to a node (a rank, inside one node) once however many of its experts
        live there, and fans out past that over NVLink (DeepSeek's DeepEP and NVIDIA's
        HybridEP, Megatron-Core's ``flex`` dispatcher): priced at the expected number of
        distinct destinations of ``top-k`` experts drawn uniformly, over ``top-k``
        (:func:`~autoplan.cost.comm.dispatch_share`).
    pp_buffers_per_micro_batch : bool
        Pipeline receive buffers: one per micro-batch of a step for every chunk's input
        activation and output gradient, allocated once and kept (torch.distributed
        .pipelining's stages as they come); ``False``: those of the micro-batches in
        flight, one receive and one send buffer beyond the activations (Megatron's p2p
        communication; :func:`autoplan.parallelize`, whose stages allocate a buffer when
        its receive is posted and release it after its micro-batch's backward).
    zero_buffer_copies : bool
        Data parallelism copies through flat communication buffers (FSDP2 and DDP, what
        :func:`autoplan.parallelize` runs): each all-gather copies the local shards into
        its input and its output into the parameters, each reduce-scatter the gradients
        into its input, each all-reduce (DDP's buckets, FSDP2's ``replicate``) the
        gradients into its input and the result back out; memory-bound work on the
        device, priced at its memory bandwidth.  ``False``: parameters and gradients are
        views of the buffers (FSDP1's flat parameters, Megatron's contiguous buffers).
    attention_kernel : {"cudnn", "flash-attention-2"}
        The fused attention kernel, when ``fused_attention``: ``"cudnn"`` (Transformer
        Engine's cuDNN fused attention, what Megatron-Core runs; on Hopper and Blackwell the
        kernels of FlashAttention-3's class) or ``"flash-attention-2"`` (the ``flash-attn``
        2.x package, PyTorch SDPA's flash backend: LLM Foundry, torchtitan, HF
        ``flash_attention_2``), which has no Hopper or Blackwell code path and runs slower
        there.  Each is priced at the fraction of peak
        :meth:`~autoplan.cost.calibration.Calibration.attention_fraction` gives (on Hopper
        both from Ampere's fitted FlashAttention-2 fraction and published comparisons of the
        kernels).
    pp_scatter_gather : bool
        Under tensor parallelism, each tp rank sends ``1/tp`` of a pipeline boundary's
        activation (and gradient) and the receiving stage all-gathers it (Megatron-LM's
        scatter/gather optimisation, Narayanan et al. 2021, Sec. 4.1).  ``False``: every
        tp rank sends the whole activation to its peer (torch.distributed.pipelining,
        what :func:`autoplan.parallelize` runs).
    fp8_library : {"torchao", "transformer-engine"}
        What runs an FP8 recipe (``Precision.is_fp8``), priced as that library runs it
        (:mod:`autoplan.cost.fp8`): which linears compute in FP8
        (:func:`autoplan.precision.fp8_converts`), the scalings it offers
        (:data:`autoplan.precision.FP8_LIBRARIES`), the passes over memory its casts make
        and the collectives its scales need.  ``"torchao"``: torchao's float8 training in
        eager mode (``Float8Linear``, what :func:`autoplan.parallelize` runs): every
        operand cast once per GEMM it enters, FP8 all-gathers of weights under ZeRO-3 and
        of activations under sequence parallelism, tensorwise scales all-reduced over the
        ranks a tensor is split over.  ``"transformer-engine"``: Transformer Engine's fused
        casts, each operand quantized once with its transpose (Megatron-Core, NeMo).
    kernel_tables : str
        Measured kernels (:mod:`autoplan.cost.kernels`, ``profiles/cost/kernels-<name>.yaml``):
        the GPUs of each architecture they list run their matmuls, fused attention and
        memory-bound operators at the measured speeds, on top of the published-run fit.
        ``"torch-eager"``: torch's kernels as :func:`autoplan.parallelize` runs them,
        measured on one H100 (within 10% of the committed one-GPU runs, where the fit is
        13-19% slow).  Default ``""`` on every stack: the fit alone.  Published runs on
        many GPUs, torchtitan's eager FSDP2 on 8 H100 among them, reach about 0.57 of the
        16-bit peak where one GPU measured 0.76 (docs/gpu-truth.md); until a multi-GPU run
        of :func:`autoplan.parallelize` shows otherwise, plans are priced as they do.
    fp32_matmuls : {"fp32", "tf32"}
        With ``Precision.FP32``, what the matmuls run in: FP32 (``"fp32"``, PyTorch's
        default since 1.12, ``torch.set_float32_matmul_precision("highest")``) or TF32
        tensor cores (``"tf32"``: PyTorch 1.7 to 1.11's default,
        ``torch.backends.cuda.matmul.allow_tf32 = True``, or ``set_float32_matmul_precision
        ("high")``), at the device's TF32 peak where it has one (FP32 where not: V100).
        Weights, activations and memory stay FP32.
    sp_grads_per_tensor_under_fsdp2 : bool
        Under sequence parallelism the norms see a sequence shard, so their weights'
        gradients are partial sums over the tp group, all-reduced once per step.  ``True``:
        where FSDP2 wraps the data-parallel ranks, its post-backward reduces each tensor in
        its own all-reduce (torch 2.13; :func:`autoplan.parallelize`, torchtitan).
        ``False``, or without FSDP2: all of them in one all-reduce (Megatron-LM's
        ``_allreduce_layernorm_grads``; :func:`autoplan.parallelize` without FSDP2).
    zero_step_per_layer : bool
        The once-per-step data-parallel collectives of ZeRO-1 (the gradient
        reduce-scatter) and ZeRO-1/2 (the parameter all-gather) run one per wrapped unit:
        each block is its own unit and the rest of a rank's layers (embedding, final norm,
        head) one more (FSDP2's ``fully_shard`` per block and on the root, what
        :func:`autoplan.parallelize` runs; FSDP1 wraps alike).  Every call pays the
        collective's latency, which is large where collectives are slow to start (gloo on
        CPU: a millisecond per ring step).  ``False``: one collective over all of them
        (Megatron's distributed optimizer and DeepSpeed bucket tens of millions of
        parameters per call).
    step_loss_all_reduce : bool
        Every step ends with one small all-reduce over every rank of the job: the step's
        mean loss over the global batch, which :meth:`autoplan.runtime.ParallelModel.step`
        returns on every rank (two float64 numbers).  Its latency is all it costs: tens of
        microseconds over NCCL, several milliseconds over gloo on CPU ranks that share
        cores.  ``False`` where a stack reduces the loss for its logs only every few steps.
    autocast : bool
        A 16-bit precision runs as ``torch.autocast`` over fp32 weights
        (:func:`autoplan.parallelize`), not over 16-bit weights with fp32 master copies
        in the optimizer (Megatron, DeepSpeed, FSDP's mixed-precision policy).  Memory:
        autocast caches the bf16 copy of every weight it casts until the forward (and the
        loss, computed inside it) ends, 2 bytes per parameter a device computes with on
        top of its model states (unsharded: under ZeRO-3, copies of the gathered
        weights).  Time, memory-bound on the device: each micro-batch's forward casts its
        weights (4 bytes read, 2 written per parameter; a recomputed forward again), its
        backward casts the weight gradients up (2 read, 4 written), they accumulate in
        fp32 (``grad_accumulate_add``), and the operators that are not matmuls run on
        fp32 tensors (the residual stream stays fp32: priced at 4 bytes per captured
        element, not the recipe's 2).
        Measured on an H100 (``benchmarks/gpu_truth.py``).
    loss_fp32_copy : bool
        The loss is torch's cross-entropy over an fp32 copy of the logits, as Hugging Face
        computes it (:func:`autoplan.runtime.loss.token_cross_entropy`, what
        :func:`autoplan.parallelize` runs): the stage that computes it holds
        :func:`~autoplan.cost.memory.loss_bytes_per_logit` bytes per logit of a micro-batch
        beyond what capture counts (measured on an H100: ``benchmarks/gpu_truth.py``).
        ``False``: a fused cross-entropy that works in place (flash-attn's in LLM Foundry,
        Megatron's vocab-parallel one), whose working set capture's count stands for.
    grad_accumulate_add : bool
        Each micro-batch after the first adds its weight gradients to the accumulated
        ones in a separate pass (torch's ``AccumulateGrad``: read both, write one, three
        times the gradient's bytes per parameter, on the device's memory bandwidth, in
        ``optimizer_s``): the whole gradients under ZeRO-0/1 (DDP's ``no_sync``, FSDP2
        without gradient sync), the reduce-scattered shard under ZeRO-2/3; fp32 under
        ``autocast``.  On 4 CPU ranks of the confirm models it is 2-3% of a step of four
        one-sequence micro-batches.  Memory: until it is added, a module's new gradient
        is a tensor of its own, so ZeRO-0/1 ranks hold the largest module's gradient more
        (in ``buffers_bytes``).  ``False`` where the stack accumulates inside the
        weight-gradient GEMM (Megatron's ``gradient_accumulation_fusion``) or in its
        reduction buffers.
    loss_parallel : bool
        Under tensor parallelism the loss runs over the head's vocabulary-sharded logits
        (torch's ``loss_parallel``, what :func:`autoplan.parallelize` runs with its own
        loss; Megatron-LM's vocab-parallel cross-entropy): three all-reduces of one fp32
        number per token, and each rank holds ``1/tp`` of the logits.  ``False``: the
        logits are all-gathered whole on every rank before the loss.
    sp_embedding_all_reduce : bool
        Under sequence parallelism, the vocabulary-parallel embedding's partial sums are
        all-reduced whole and each rank keeps its sequence shard (DTensor's
        ``RowwiseParallel`` with a replicated output, what :func:`autoplan.parallelize`
        runs: the package GPT adds position embeddings to the whole sequence).
        ``False``: reduce-scattered straight to the shards (Megatron-LM).
    grad_reduce_dtype : {"fp32", "bf16"}
        Under a 16-bit precision, the dtype the data-parallel gradient reduction moves
        (all-reduce, reduce-scatter), in which gradients accumulate over micro-batches and
        which the optimizer reads (:mod:`autoplan.precision`).  ``"fp32"``: torchtitan's
        and :func:`autoplan.parallelize`'s FSDP2 ``MixedPrecisionPolicy(reduce_dtype=
        torch.float32)``; ``"bf16"``: Megatron-Core's default (``grad_reduce_in_fp32=False``)
        and the published-run stacks as fitted.  fp32 plans reduce fp32 either way.
    master_weights : {"optimizer", "fsdp2"}
        Where the fp32 master weights of a 16-bit precision live.  ``"optimizer"``: the
        model holds 16-bit parameters and gradients, the optimizer an fp32 copy beside its
        moments (Megatron, DeepSpeed: ``2 + 2 + 12`` bytes a parameter, Rajbhandari et al.
        2020, Sec. 3.1).  ``"fsdp2"``: the parameters are the fp32 master weights, sharded
        by ZeRO-1/2/3 between steps, and 16-bit copies are made when a unit is gathered
        (FSDP2's ``MixedPrecisionPolicy``: torchtitan, :func:`autoplan.parallelize`):
        ``4 + 4 + 8`` bytes a parameter as the ZeRO stage shards them, plus 2 for the
        compute copy while it is held (:func:`autoplan.cost.memory.fsdp2_state_bytes`).
    stack : str
        The training software the layout runs on (:data:`STACKS`): the implementation
        fields above that are not given take its values.  Default ``"autoplan"``, what
        :func:`autoplan.parallelize` runs.  ``CostOptions.preset(name, **overrides)`` is
        the same as ``CostOptions(stack=name, **overrides)``.

    Examples
    --------
    >>> CostOptions.preset("megatron-core").tp_comm_overlap
    True
    >>> CostOptions(stack="megatron-2021", fused_attention=True).overlap_grad_reduce
    False
    """

    fused_attention: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    tp_comm_overlap: bool | None = None
    pp_comm_overlap: bool | None = None
    zero3_regather_for_recompute: bool | None = None
    zero3_gather_unit: str | None = None
    dp_nic_per_device: bool | None = None
    expert_grouped_gemm: bool | None = None
    expert_gemm_streams: int | None = None
    moe_tokens_split_over_tp: bool | None = None
    pp_buffers_per_micro_batch: bool | None = None
    pp_scatter_gather: bool | None = None
    attention_kernel: str | None = None
    zero_buffer_copies: bool | None = None
    moe_dispatcher: str | None = None
    sp_grads_per_tensor_under_fsdp2: bool | None = None
    zero_step_per_layer: bool | None = None
    step_loss_all_reduce: bool | None = None
    autocast: bool | None = None
    loss_fp32_copy: bool | None = None
    grad_accumulate_add: bool | None = None
    grad_reduce_dtype: str | None = None
    master_weights: str | None = None
    loss_parallel: bool | None = None
    sp_embedding_all_reduce: bool | None = None
    fp8_library: str | None = None
    kernel_tables: str | None = None
    memory_fraction: float = 1.0
    expert_imbalance: float = 1.0
    fp32_matmuls: str = "fp32"
    stack: str = "autoplan"

    def __post_init__(self) -> None:
        preset = STACKS.get(self.stack)
        if preset is None:
            near = difflib.get_close_matches(str(self.stack), list(STACKS), n=3, cutoff=0.3)
            raise ConfigError(f"unknown software stack {self.stack!r}; "
                              + (f"did you mean {', '.join(near)}? " if near else "")
                              + f"known: {', '.join(STACKS)}")
        # the fields left unset take the stack's value
        for name, value in preset.settings.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.fp8_library not in FP8_LIBRARIES:
            raise ConfigError(f"fp8_library must be one of {', '.join(FP8_LIBRARIES)}, got "
                              f"{self.fp8_library!r}")
        if self.fp32_matmuls not in ("fp32", "tf32"):
            raise ConfigError(f"fp32_matmuls must be 'fp32' or 'tf32', got {self.fp32_matmuls!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(f"attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, "
                              f"got {self.attention_kernel!r}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ConfigError(f"moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, "
                              f"got {self.moe_dispatcher!r}")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ConfigError(f"grad_reduce_dtype must be one of {', '.join(GRAD_REDUCE_DTYPES)}, "
                              f"got {self.grad_reduce_dtype!r}")
        if self.master_weights not in MASTER_WEIGHTS:
            raise ConfigError(f"master_weights must be one of {', '.join(MASTER_WEIGHTS)}, "
                              f"got {self.master_weights!r}")
        if (isinstance(self.expert_gemm_streams, bool)
                or not isinstance(self.expert_gemm_streams, int)
                or self.expert_gemm_streams < 0):
            raise ConfigError("expert_gemm_streams (concurrent per-expert GEMM kernels; 0: one "
                              "grouped kernel) must be an integer >= 0, got "
                              f"{self.expert_gemm_streams!r}")
        if self.zero3_gather_unit not in ("layer", "module"):
            raise ConfigError(f"zero3_gather_unit must be 'layer' or 'module', got "
                              f"{self.zero3_gather_unit!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if not 1 <= self.expert_imbalance < float("inf"):
            raise ConfigError("expert_imbalance (busiest expert-parallel rank's load over the "
                              f"mean) must be a number >= 1, got {self.expert_imbalance!r}")


    @classmethod
    def preset(cls, stack: str, **overrides) -> "CostOptions":
        """The options of the named software stack (:data:`STACKS`), with ``overrides``."""
        return cls(stack=stack, **overrides)

    def recorded(self) -> dict:
        """What a plan records of these options (``Plan.cost_options``): the stack when it
        is not the default and every field its stack does not set to this value, without
        ``memory_fraction`` (the plan's estimate records it).  ``CostOptions(**recorded)``
        is these options at ``memory_fraction`` 1; empty for the defaults.

        >>> CostOptions.preset("megatron-core", memory_fraction=0.8).recorded()
        {'stack': 'megatron-core'}
        >>> CostOptions(expert_imbalance=1.2).recorded()
        {'expert_imbalance': 1.2}
        """
        base = CostOptions(stack=self.stack)
        out = {} if self.stack == "autoplan" else {"stack": self.stack}
        for f in fields(self):
            if f.name not in ("stack", "memory_fraction") \
                    and getattr(self, f.name) != getattr(base, f.name):
                out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_recorded(cls, recorded: dict, memory_fraction: float = 1.0) -> "CostOptions":
        """The options a plan recorded (:meth:`recorded`), at ``memory_fraction``; a
        :class:`RecordError` naming what is wrong with a bad record."""
        names = {f.name for f in fields(cls)} - {"memory_fraction"}
        unknown = sorted(set(recorded) - names)
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(names), n=1)
            raise RecordError(f"unknown cost option {unknown[0]!r}"
                              + (f" (did you mean {near[0]!r}?)" if near else "")
                              + "; a plan records only CostOptions fields", "cost_options")
        try:
            return cls(**recorded, memory_fraction=memory_fraction)
        except ConfigError as exc:
            raise RecordError(str(exc), "cost_options") from None


@dataclass(frozen=True)
class Stack:
    """A named software stack: what its implementation overlaps and fuses.

    ``settings`` are :class:`CostOptions` implementation fields; ``assumes`` says in
    words what the stack runs (documented in docs/stacks-and-precision.md).
    """

    name: str
    assumes: str
    settings: dict

    def __post_init__(self) -> None:
        unknown = set(self.settings) - set(_IMPLEMENTATION_FIELDS)
        missing = set(_IMPLEMENTATION_FIELDS) - set(self.settings)
        if unknown or missing:
            raise ConfigError(f"stack {self.name!r}: unknown settings {sorted(unknown)}, "
                              f"missing {sorted(missing)}")


#: The :class:`CostOptions` fields a stack sets (the rest are per-run: memory_fraction,
#: expert_imbalance).
_IMPLEMENTATION_FIELDS = ("fused_attention", "overlap_grad_reduce", "overlap_param_gather",
                          "tp_comm_overlap", "pp_comm_overlap", "zero3_regather_for_recompute",
                          "zero3_gather_unit", "dp_nic_per_device", "expert_grouped_gemm",
                          "expert_gemm_streams",
                          "moe_tokens_split_over_tp", "pp_buffers_per_micro_batch",
                          "pp_scatter_gather", "attention_kernel", "zero_buffer_copies",
                          "moe_dispatcher", "sp_grads_per_tensor_under_fsdp2",
                          "zero_step_per_layer", "step_loss_all_reduce",
                          "autocast", "loss_fp32_copy", "grad_accumulate_add",
                          "grad_reduce_dtype", "master_weights", "loss_parallel",
                          "sp_embedding_all_reduce", "fp8_library", "kernel_tables")

#: Fused attention kernels a stack may run (``CostOptions.attention_kernel``).
ATTENTION_KERNELS = ("cudnn", "flash-attention-2")

#: MoE token dispatchers a stack may run (``CostOptions.moe_dispatcher``).
MOE_DISPATCHERS = ("alltoall", "deepep")

#: Concurrent streams Transformer Engine runs an expert bank's per-expert GEMMs on
#: (``CostOptions.expert_gemm_streams`` of the ``megatron-core`` stack): ``GroupedLinear``
#: calls ``general_grouped_gemm``, which launches one cuBLAS GEMM per local expert,
#: round-robin over ``nvte_get_num_compute_streams()`` streams, 4
#: (TransformerEngine ``transformer_engine/common/gemm/cublaslt_gemm.cu``,
#: ``multi_stream_cublas_gemm``; ``common/util/multi_stream.cpp``,
#: ``get_num_compute_streams``).  Its CUTLASS grouped kernel is opt-in
#: (``NVTE_USE_CUTLASS_GROUPED_GEMM``), Hopper and 16-bit only.
TE_GEMM_STREAMS = 4

#: Where a 16-bit precision keeps its fp32 master weights (``CostOptions.master_weights``).
MASTER_WEIGHTS = ("optimizer", "fsdp2")


def _stack(name: str, assumes: str, *, fused_attention: bool, overlap_grad_reduce: bool,
           overlap_param_gather: bool, tp_comm_overlap: bool, pp_comm_overlap: bool,
           zero3_regather_for_recompute: bool = False, zero3_gather_unit: str = "layer",
           dp_nic_per_device: bool = False, expert_grouped_gemm: bool = False,
           expert_gemm_streams: int = 0, moe_tokens_split_over_tp: bool = False,
           pp_buffers_per_micro_batch: bool = False, pp_scatter_gather: bool = False,
           attention_kernel: str = "flash-attention-2",
           zero_buffer_copies: bool = False, moe_dispatcher: str = "alltoall",
           sp_grads_per_tensor_under_fsdp2: bool = False,
           zero_step_per_layer: bool = False, step_loss_all_reduce: bool = False,
           autocast: bool = False, loss_fp32_copy: bool = False,
           grad_accumulate_add: bool = False, grad_reduce_dtype: str = "bf16",
           master_weights: str = "optimizer", loss_parallel: bool = False,
           sp_embedding_all_reduce: bool = False,
           fp8_library: str = "transformer-engine", kernel_tables: str = "") -> Stack:
    return Stack(name, assumes, dict(
        fused_attention=fused_attention, overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather, tp_comm_overlap=tp_comm_overlap,
        pp_comm_overlap=pp_comm_overlap,
        zero3_regather_for_recompute=zero3_regather_for_recompute,
        zero3_gather_unit=zero3_gather_unit, dp_nic_per_device=dp_nic_per_device,
        expert_grouped_gemm=expert_grouped_gemm, expert_gemm_streams=expert_gemm_streams,
        moe_tokens_split_over_tp=moe_tokens_split_over_tp,
        pp_buffers_per_micro_batch=pp_buffers_per_micro_batch,
        pp_scatter_gather=pp_scatter_gather, attention_kernel=attention_kernel,
        zero_buffer_copies=zero_buffer_copies, moe_dispatcher=moe_dispatcher,
        sp_grads_per_tensor_under_fsdp2=sp_grads_per_tensor_under_fsdp2,
        zero_step_per_layer=zero_step_per_layer, step_loss_all_reduce=step_loss_all_reduce,
        autocast=autocast, loss_fp32_copy=loss_fp32_copy,
        grad_accumulate_add=grad_accumulate_add, grad_reduce_dtype=grad_reduce_dtype,
        master_weights=master_weights, loss_parallel=loss_parallel,
        sp_embedding_all_reduce=sp_embedding_all_reduce, fp8_library=fp8_library,
        kernel_tables=kernel_tables))


#: Software stacks by name (``CostOptions(stack=...)``, ``--stack NAME``).  The layout
#: choices a stack offers (ZeRO stage, Megatron's distributed optimizer = ``zero=1``) are
#: part of the Strategy/Plan, not of the stack.
STACKS: dict[str, Stack] = {s.name: s for s in (
    _stack("autoplan",
           "what autoplan.parallelize runs: DDP for fp32 data parallelism alone (bucketed, "
           "overlapped gradient all-reduce, copying the gradients into its buckets and "
           "back), FSDP2's replicate for the rest of ZeRO-0, or "
           "FSDP2 per layer (ZeRO-1/2/3, all-gathers prefetched, reduce-scatters in the "
           "backward, both through flat buffers it copies into and out of, one collective "
           "per block and one for the rest of a rank's layers); tensor-parallel "
           "collectives not overlapped (DTensor); torch.distributed.pipelining sends not "
           "overlapped, whole on every tp rank, its receive buffers allocated for the "
           "micro-batches in flight only; the model's own attention as captured; MoE: the family's "
           "own expert forward (Hugging Face's default grouped_mm: one grouped GEMM per "
           "projection over the local experts, at the profile's measured grouped-GEMM speed "
           "where it has one), every tp rank routing all tokens; "
           "sequence parallelism's norm gradients reduced over tp once per step, one "
           "all-reduce each under FSDP2, all in one without it; the step's mean loss "
           "all-reduced over every rank at its end; a 16-bit precision as FSDP2's "
           "MixedPrecisionPolicy on every layout (fp32 master weights sharded with ZeRO, "
           "bf16 copies gathered for compute, bf16 activations, so every tensor-, "
           "context-, pipeline- and expert-parallel transfer is 16-bit; gradients "
           "reduced, accumulated and stepped in fp32); the loss as "
           "Hugging Face computes it, over an fp32 copy of the logits; gradients of "
           "micro-batches after the first added to the accumulated ones in a pass of "
           "their own; FP8 recipes as torchao's float8 linears (eager); a captured "
           "scaled_dot_product_attention at the speed of cuDNN-class kernels (torch's "
           "SDPA on the committed H100 and H200 runs, benchmarks/gpu_truth/, measured "
           "0.38-0.87 of the best 16-bit matmul: above FlashAttention-2's Hopper rate)",
           fused_attention=False, attention_kernel="cudnn", overlap_grad_reduce=True, overlap_param_gather=True,
           tp_comm_overlap=False, pp_comm_overlap=False, pp_buffers_per_micro_batch=False,
           zero_buffer_copies=True, sp_grads_per_tensor_under_fsdp2=True,
           zero_step_per_layer=True, step_loss_all_reduce=True, autocast=False,
           loss_fp32_copy=True, grad_accumulate_add=True, grad_reduce_dtype="fp32",
           master_weights="fsdp2", loss_parallel=True, sp_embedding_all_reduce=True,
           expert_grouped_gemm=True, fp8_library="torchao"),
    _stack("megatron-2021",
           "Megatron-LM as in Narayanan et al. 2021: gradient all-reduce after the last "
           "backward (no overlap), no tensor- or pipeline-parallel communication overlap, "
           "pipeline sends scattered over the tp ranks and gathered on arrival, "
           "attention core materialised (fused softmax, no FlashAttention)",
           fused_attention=False, overlap_grad_reduce=False, overlap_param_gather=True,
           tp_comm_overlap=False, pp_comm_overlap=False, pp_scatter_gather=True,
           loss_parallel=True),
    _stack("megatron-core",
           "Megatron-Core with Transformer Engine: --overlap-grad-reduce, "
           "--overlap-param-gather (with the distributed optimizer, zero=1), "
           "--tp-comm-overlap (userbuffers), overlapped pipeline p2p (scattered over the tp "
           "ranks), fused attention (Transformer Engine's cuDNN kernels); "
           "MoE: --moe-grouped-gemm (Transformer Engine's GroupedLinear: one GEMM per local "
           "expert, four streams at a time), each tp rank routing its sequence-parallel shard",
           fused_attention=True, overlap_grad_reduce=True, overlap_param_gather=True,
           tp_comm_overlap=True, pp_comm_overlap=True, expert_grouped_gemm=True,
           expert_gemm_streams=TE_GEMM_STREAMS,
           moe_tokens_split_over_tp=True, pp_scatter_gather=True, attention_kernel="cudnn",
           loss_parallel=True),
    _stack("deepspeed-zero3",
           "DeepSpeed ZeRO-3: overlap_comm (gradient reduction under the backward), parameter "
           "prefetch per submodule (stage3_max_live_parameters), parameters released after "
           "every forward so a recomputed forward gathers again; no tensor- or "
           "pipeline-parallel overlap; the model's attention as captured",
           fused_attention=False, overlap_grad_reduce=True, overlap_param_gather=True,
           tp_comm_overlap=False, pp_comm_overlap=False, zero3_regather_for_recompute=True,
           zero3_gather_unit="module"),
    _stack("fsdp",
           "PyTorch FSDP with FlashAttention-2 (flash-attn, SDPA's flash backend): all-gathers "
           "prefetched, reduce-scatters under the backward, one gather per layer for recompute "
           "and backward, gathered in place into flat parameters (FSDP1; FSDP2 copies through "
           "its buffers: zero_buffer_copies=True); no tensor- or pipeline-parallel overlap "
           "(e.g. MosaicML LLM Foundry, torchtitan without async TP); one collective per "
           "wrapped layer",
           fused_attention=True, overlap_grad_reduce=True, overlap_param_gather=True,
           tp_comm_overlap=False, pp_comm_overlap=False, zero_step_per_layer=True),
)}


def cost_profiles_dir() -> Path:
    """``profiles/cost/``: the cost model's constants and fits, shipped with the profiles
    (``autoplan/_profiles/cost`` in a wheel; see ``shipped_profiles_dir``)."""
    return shipped_profiles_dir() / "cost"


@lru_cache(maxsize=32)
def read_yaml_record(cls: type, path: str, mtime_ns: int, what: str):
    """The record ``cls`` stored as YAML at ``path`` (cached per file version).

    Raises :class:`ConfigError` naming the file and ``what`` it should hold, or the
    offending field.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read {what} ({exc})") from None
    try:
        return cls.from_dict(data)
    except RecordError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _load(path: str, mtime_ns: int) -> CostConstants:
    return read_yaml_record(CostConstants, path, mtime_ns, "cost-model constants")


def load_constants(path: str | os.PathLike[str] | None = None) -> CostConstants:
    """Load the cost-model constants (default ``profiles/cost/cost-model.yaml``).

    Raises
    ------
    ConfigError
        Naming the file and the offending field on a missing, unknown or ill-typed key.
    """
    p = Path(path) if path is not None else cost_profiles_dir() / "cost-model.yaml"
    if not p.is_file():
        raise ConfigError(f"no cost-model constants file at {p}")
    return _load(str(p.resolve()), p.stat().st_mtime_ns)
