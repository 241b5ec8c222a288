"""A uniform parallel layout: the same degrees and options for every layer.

:class:`Strategy` is what a user writes to force a layout and what the tests
use; the search produces the richer per-layer :class:`~autoplan.plan.Plan`.
Degrees are validated where they are built: on a mismatch the error names every
factor and the product (the torchtitan ``ParallelDims`` practice).

Examples
--------
>>> s = Strategy(dp=2, tp=2, pp=2, micro_batch=1, global_batch=8)
>>> s.world_size, s.num_micro_batches
(8, 4)
>>> Strategy(dp=3, global_batch=8)
Traceback (most recent call last):
...
autoplan.errors.StrategyError: global_batch=8 is not divisible by dp=3 x micro_batch=1 = 3; ...
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import StrategyError
from .records import Record

__all__ = ["Recompute", "Schedule", "Precision", "Strategy", "ep_problem", "schedule_problem", "stage_ranks",
           "uses_ddp"]


def uses_ddp(*, pp: int, tp: int, ep: int, max_zero: int,
             precision: "Precision | str" = "fp32") -> bool:
    """Whether :func:`autoplan.parallelize` wraps a data-parallel stage with DDP (plain
    tensor parameters) rather than FSDP2's ``replicate`` or ``fully_shard`` (DTensor
    parameters): an fp32 plan with ZeRO-0 on every layer of the stage, and no pipeline,
    tensor or expert parallelism.  (A 16-bit plan's precision policy is FSDP2's, which
    ``replicate`` installs; DDP's own mixed precision does not run on CPU ranks.)  The
    cost model prices the optimizer's host time by the same rule."""
    return (max_zero == 0 and pp == 1 and tp == 1 and ep == 1
            and Precision(precision) is Precision.FP32)


#: Why zero-bubble schedules and ZeRO-3 are never combined.
ZBV_ZERO3 = ("zero=3 with schedule='zero_bubble': ZeRO-3 reshards parameters after forward, "
             "which gives silently wrong gradients under torch 2.13's zero-bubble schedules; "
             "use zero <= 2 with zero_bubble, or another schedule with zero=3")


#: Why zero-bubble schedules and selective recompute are never combined.
ZBV_SELECTIVE = ("recompute='selective' with schedule='zero_bubble': the schedule runs each "
                 "block's backward twice (input, then weight gradients), and torch 2.13's "
                 "selective checkpointing allows one backward per region; use recompute='full' "
                 "or 'none' with zero_bubble, or another schedule")


class Recompute(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"   # attention core only (Korthikanti et al. 2022)
    FULL = "full"             # keep the layer input, recompute the whole layer


class Schedule(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"   # interleaved 1F1B with ``virtual_stages`` chunks per rank
    ZERO_BUBBLE = "zero_bubble"   # ZBV (Qi et al. 2024), two chunks per rank in a V


class Precision(str, enum.Enum):
    """The mixed-precision recipe of a layout; it, not the dtype the model was built in,
    sets what the cost model counts (a model built in fp32, in bf16 or on the meta device
    is estimated the same).

    ==============  ===================  =============  ========  =============================
    recipe          compute/activations  weights        gradients optimizer (Adam)
    ==============  ===================  =============  ========  =============================
    bf16            bf16                 bf16 + fp32    bf16      fp32 master copy, m and v
                                         master
    fp16            fp16 (loss scaling)  fp16 + fp32    fp16      fp32 master copy, m and v
                                         master
    fp32            fp32                 fp32           fp32      fp32 m and v
    fp8             linear GEMMs in FP8, bf16 + fp32    bf16      fp32 master copy, m and v
                    one scale a tensor   master
    fp8-rowwise     as fp8, one scale a row (torchao's rowwise recipe)
    fp8-blockwise   as fp8, one scale a block (Transformer Engine's MXFP8 / blockwise)
    ==============  ===================  =============  ========  =============================

    Bytes per parameter: ``2 + 2 + 12`` under bf16/fp16 (Rajbhandari et al. 2020, Sec. 3.1),
    ``4 + 4 + 8`` under fp32 (``profiles/cost/cost-model.yaml``).  Every floating
    activation is counted at :attr:`bytes` per element (norms or softmax a model upcasts
    to fp32 inside included); integer and boolean tensors (token ids, masks) at their own.
    autoplan's runtime runs bf16 with FSDP2's mixed-precision policy (:mod:`autoplan.precision`):
    fp32 parameters are the master weights, bf16 copies are gathered for compute,
    gradients are reduced in the stack's ``grad_reduce_dtype`` (fp32): 4 + 4 + 8 bytes per
    parameter as the ZeRO stage shards them, plus 2 for the compute copy while it is held.
    The FP8 recipes (Micikevicius et al. 2022, "FP8 Formats for Deep Learning") run the bf16
    program with the GEMMs of the linears :func:`autoplan.precision.fp8_linears` names in
    FP8: their inputs, weights and output gradients are quantized with the recipe's scales
    (:attr:`fp8_scaling`) and multiplied at the device's FP8 peak.  ``fp8`` and
    ``fp8-rowwise`` are torchao's recipes, which :func:`autoplan.parallelize` runs;
    ``fp8`` and ``fp8-blockwise`` Transformer Engine's (``CostOptions.fp8_library``).
    """

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"
    FP8_ROWWISE = "fp8-rowwise"
    FP8_BLOCKWISE = "fp8-blockwise"

    @property
    def bytes(self) -> int:
        """Bytes of an activation element kept between operators."""
        return 4 if self is Precision.FP32 else 2

    @property
    def is_fp8(self) -> bool:
        """Whether the recipe runs linear GEMMs in FP8."""
        return self.fp8_scaling is not None

    @property
    def fp8_scaling(self) -> str | None:
        """How an FP8 recipe scales a tensor to FP8: ``"tensor"`` (one scale a tensor,
        from its current absolute maximum: torchao's tensorwise recipe, Transformer
        Engine's ``Float8CurrentScaling``), ``"row"`` (one scale a row, rounded down to a
        power of two: torchao's rowwise recipe), ``"block"`` (one scale a block: Transformer
        Engine's MXFP8, 32 elements, and blockwise, 128); None for the other recipes.

        >>> Precision("fp8-rowwise").fp8_scaling, Precision.BF16.fp8_scaling
        ('row', None)
        """
        return _FP8_SCALING.get(self)


_FP8_SCALING = {Precision.FP8: "tensor", Precision.FP8_ROWWISE: "row",
                Precision.FP8_BLOCKWISE: "block"}


def stage_ranks(schedule: "Schedule", pp: int, num_stages: int) -> tuple[int, ...]:
    """The pipeline rank of each virtual stage, as torch's schedules place them.

    Looped for GPipe, 1F1B and interleaved 1F1B (stage ``k`` on rank ``k % pp``,
    Narayanan et al. 2021, Sec. 2.2.2); a V for zero-bubble ZBV (Qi et al. 2024,
    Sec. 5): stage ``k`` on rank ``k`` for ``k < pp``, on ``2 pp - 1 - k`` after.

    >>> stage_ranks(Schedule.INTERLEAVED, 2, 4), stage_ranks(Schedule.ZERO_BUBBLE, 2, 4)
    ((0, 1, 0, 1), (0, 1, 1, 0))
    """
    if schedule is Schedule.ZERO_BUBBLE and pp > 1:
        return tuple(k if k < pp else num_stages - 1 - k for k in range(num_stages))
    return tuple(k % pp for k in range(num_stages))


def ep_problem(ep: int, dp: int, cp: int, num_experts: int | None = None) -> str | None:
    """Why expert parallel degree ``ep`` cannot split the experts over ``dp x cp`` ranks
    (and ``num_experts`` experts, when given), or None.  The message names what does not
    divide and the degrees that would.

    >>> ep_problem(4, 2, 1)
    'ep=4 must divide dp=2 x cp=1 = 2 (expert parallel ranks are carved out of the data and context parallel ranks); ep in [1, 2] would'
    """
    if ep == 1:
        return None
    ranks = dp * cp
    if ranks % ep:
        fits = [d for d in range(1, ranks + 1) if ranks % d == 0
                and (num_experts is None or num_experts % d == 0)]
        return (f"ep={ep} must divide dp={dp} x cp={cp} = {ranks} (expert parallel ranks are "
                f"carved out of the data and context parallel ranks); ep in {fits} would")
    if num_experts is not None and num_experts % ep:
        fits = [d for d in range(1, ranks + 1) if ranks % d == 0 and num_experts % d == 0]
        return (f"ep={ep} must divide the model's {num_experts} experts (each rank holds "
                f"experts / ep of them); ep in {fits} would")
    return None


def schedule_problem(schedule: "Schedule", pp: int, chunks_per_rank: int, m: int) -> str | None:
    """Why ``m`` micro-batches per replica cannot run ``schedule`` on ``pp`` ranks with
    ``chunks_per_rank`` chunks each (as torch 2.13's schedules require), or None."""
    if pp == 1:
        return None
    if schedule is Schedule.ONE_F_ONE_B and m < pp:
        return f"1F1B needs at least as many micro-batches as stages: {m} micro-batches < pp={pp}"
    if schedule is Schedule.INTERLEAVED:
        rounds = max(1, m // pp)
        if m % rounds:
            # torch's interleaved 1F1B runs the micro-batches in rounds of equal size
            return (f"interleaved 1F1B runs {m} micro-batches in max(1, {m} // pp={pp}) = "
                    f"{rounds} rounds, which must divide them; choose a multiple of pp or "
                    "fewer than 2 x pp")
    if schedule is Schedule.ZERO_BUBBLE and m < 2 * pp - 1:
        return f"ZBV needs at least 2 x pp - 1 = {2 * pp - 1} micro-batches, got {m}"
    return None


@dataclass(frozen=True)
class Strategy(Record):
    """Data, tensor, pipeline and context parallel degrees plus the training options."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    zero: int = 0
    recompute: Recompute = Recompute.NONE
    sequence_parallel: bool = False
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    precision: Precision = Precision.BF16
    #: Expert parallel degree: each MoE layer's experts are split over ``ep`` ranks carved
    #: out of the ``dp x cp`` ranks (as Megatron-Core and torchtitan do), so ``ep`` divides
    #: ``dp x cp`` and adds no devices; dense layers keep ``dp x cp``.
    ep: int = 1

    def __post_init__(self) -> None:
        # accept plain strings for the enums (Strategy(recompute="full"))
        for name, enum_type in (("recompute", Recompute), ("schedule", Schedule),
                                ("precision", Precision)):
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                try:
                    object.__setattr__(self, name, enum_type(value))
                except ValueError:
                    raise StrategyError(f"{name}={value!r} is not one of "
                                        f"{[m.value for m in enum_type]}") from None
        for name in ("dp", "tp", "pp", "cp", "micro_batch", "global_batch", "virtual_stages", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StrategyError(f"{name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise StrategyError(f"zero must be 0, 1, 2 or 3 (ZeRO stage), got {self.zero!r}")
        per_step = self.dp * self.micro_batch
        if self.global_batch % per_step:
            raise StrategyError(
                f"global_batch={self.global_batch} is not divisible by dp={self.dp} x "
                f"micro_batch={self.micro_batch} = {per_step}; choose a global batch that is a "
                f"multiple of {per_step} or change dp/micro_batch")
        problem = ep_problem(self.ep, self.dp, self.cp)
        if problem:
            raise StrategyError(problem)
        if self.sequence_parallel and self.tp == 1:
            raise StrategyError("sequence_parallel=True needs tp > 1 (it shards the activations "
                                "outside the tensor-parallel regions over the tp group)")
        if self.schedule is Schedule.INTERLEAVED and self.virtual_stages < 2:
            raise StrategyError("schedule='interleaved' needs virtual_stages >= 2 "
                                f"(got {self.virtual_stages})")
        if self.schedule is Schedule.ZERO_BUBBLE and self.virtual_stages not in (1, 2):
            raise StrategyError("schedule='zero_bubble' (ZBV) runs two chunks per rank; "
                                f"virtual_stages must be 2 (or 1 to mean the default), got "
                                f"{self.virtual_stages}")
        if self.schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B) and self.virtual_stages != 1:
            raise StrategyError(f"schedule={self.schedule.value!r} has one chunk per rank; "
                                f"virtual_stages must be 1, got {self.virtual_stages} "
                                "(use schedule='interleaved')")
        problem = schedule_problem(self.schedule, self.pp, self.chunks_per_rank,
                                   self.num_micro_batches)
        if problem:
            raise StrategyError(
                f"global_batch={self.global_batch} / (dp={self.dp} x micro_batch="
                f"{self.micro_batch}) = {self.num_micro_batches} micro-batches: {problem}")
        if self.pp > 1 and self.schedule is Schedule.ZERO_BUBBLE and self.zero == 3:
            raise StrategyError(ZBV_ZERO3)
        if (self.pp > 1 and self.schedule is Schedule.ZERO_BUBBLE
                and self.recompute is Recompute.SELECTIVE):
            raise StrategyError(ZBV_SELECTIVE)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per data-parallel replica per step (gradient accumulation steps)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def chunks_per_rank(self) -> int:
        if self.schedule is Schedule.ZERO_BUBBLE:
            return 2
        return self.virtual_stages

    def check_world(self, world_size: int) -> None:
        """Raise unless dp x tp x pp x cp equals ``world_size``, naming every factor."""
        if self.world_size != world_size:
            raise StrategyError(
                f"dp={self.dp} x tp={self.tp} x pp={self.pp} x cp={self.cp} = {self.world_size}, "
                f"but the world has {world_size} devices; the product of the degrees must equal "
                "the number of devices")

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mb{self.micro_batch}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.recompute is not Recompute.NONE:
            parts.append(f"rc-{self.recompute.value}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.schedule.value + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        return " ".join(parts)
