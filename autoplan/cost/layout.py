"""What the cost engine prices: a layout of segments on devices, and a precision recipe.

:class:`Layout` is a :class:`~autoplan.plan.Plan` (or, through
:meth:`Plan.from_strategy <autoplan.plan.Plan.from_strategy>`, a Strategy) compiled to
virtual stages made of :class:`Segment` s, runs of consecutive layers with the same
options (:func:`layout_from_plan`); :class:`PrecisionCosts` is what a
:class:`~autoplan.strategy.Precision` recipe costs per parameter and activation byte
(:func:`precision_costs`, ``profiles/cost/cost-model.yaml``; Rajbhandari et al. 2020,
Sec. 3.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..errors import ConfigError, StrategyError
from ..precision import fp8_problem, precision_program
from ..strategy import Precision, Recompute, Schedule, stage_ranks
from .summary import GraphSummary

if TYPE_CHECKING:
    from .engine import CostEngine

__all__ = ["Segment", "Layout", "layout_from_plan", "PrecisionCosts", "precision_costs"]


_DTYPE = {Precision.BF16: "bf16", Precision.FP16: "fp16", Precision.FP32: "fp32",
          Precision.FP8: "fp8", Precision.FP8_ROWWISE: "fp8-rowwise",
          Precision.FP8_BLOCKWISE: "fp8-blockwise"}


def _fp8_scaling(dtype: str) -> str | None:
    """The FP8 scaling of a :attr:`PrecisionCosts.dtype` (``"fp8"``, ``"fp8-rowwise"``,
    ``"fp8-blockwise"``), or None for a 16- or 32-bit recipe."""
    return Precision(dtype).fp8_scaling if dtype.startswith("fp8") else None


def _ledger_dtypes(recipe: "PrecisionCosts") -> tuple[str, str, str]:
    """``(activations, gradient reduction, gathered weights)`` dtypes of a recipe as the
    ledger names them (:mod:`.ledger`)."""
    if recipe.dtype == "fp32":
        return "fp32", "fp32", "fp32"
    act = "fp16" if recipe.dtype == "fp16" else "bf16"     # bf16 under FP8 recipes
    return act, {4: "fp32", 2: "bf16"}[recipe.grad_bytes], act


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


def precision_costs(engine: CostEngine, precision: Precision) -> PrecisionCosts:
    """The compute dtype, bytes per parameter (weights, gradients, optimizer states),
    optimizer traffic per parameter and activation scale of a precision recipe
    (``profiles/cost/cost-model.yaml``; Rajbhandari et al. 2020, Sec. 3.1)."""
    hit = engine._precision_costs.get(precision)
    if hit is None:
        opts = engine.options
        problem = fp8_problem(precision, opts.fp8_library)
        if problem:
            raise ConfigError(problem)
        program = precision_program(precision, opts.grad_reduce_dtype)
        mixed = program.mixed
        param_bytes, grad_bytes, optimizer_bytes = engine.constants.model_states.per_param(mixed)
        traffic = engine.constants.optimizer
        accessed = (traffic.mixed_bytes_accessed_per_param if mixed
                    else traffic.fp32_bytes_accessed_per_param)
        fsdp2_master = mixed and opts.master_weights == "fsdp2" and not opts.autocast
        if mixed:
            # gradients are reduced, accumulated and read by the optimizer in the
            # stack's dtype (autoplan.precision)
            grad_bytes = program.grad_reduce_bytes
        if fsdp2_master:
            # the optimizer steps the fp32 parameters themselves: as fp32 does
            optimizer_bytes = engine.constants.model_states.fp32_optimizer_bytes
            accessed = traffic.fp32_bytes_accessed_per_param
        hit = PrecisionCosts(_DTYPE[precision], param_bytes, grad_bytes, optimizer_bytes,
                             accessed, precision.bytes / engine.summary.activation_bytes,
                             fsdp2_master)
        engine._precision_costs[precision] = hit
    return hit
