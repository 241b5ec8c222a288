"""The resolved layout the runtime applies: degrees, pipeline stages, per-layer options.

A :class:`Layout` is what :func:`~autoplan.runtime.parallelize` turns every
target into before it touches the model: a uniform :class:`~autoplan.Strategy`
(:func:`layout_from_strategy`), a searched :class:`~autoplan.plan.Plan`, or a
``Layout`` written by hand (e.g. an uneven pipeline split).  It names layers
exactly as :func:`autoplan.trace` does (``"pre"``, ``"blocks.3"``,
``"model.layers.3"``, ``"post"``), so every option is checked against the
captured model (:func:`check_layout`) before a single collective is issued.

Examples
--------
>>> from autoplan import Strategy
>>> names = ["pre", "blocks.0", "blocks.1", "blocks.2", "post"]
>>> lay = layout_from_strategy(Strategy(pp=2, global_batch=4, precision="fp32"), names)
>>> lay.stages
(('pre', 'blocks.0', 'blocks.1'), ('blocks.2', 'post'))
>>> lay.stage_ranks()
(0, 1)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..errors import PlanMismatchError, StrategyError
from ..records import Record
from ..strategy import Precision, Recompute, Schedule, Strategy

__all__ = ["LayerLayout", "Layout", "layout_from_strategy", "layout_from_plan", "check_layout",
           "even_stages"]


@dataclass(frozen=True)
class LayerLayout(Record):
    """Options of one layer.

    ``zero`` is the ZeRO stage of the layer's parameters over the data-parallel
    group (0 = replicated; 1, 2, 3 as mapped onto FSDP2 in
    :mod:`autoplan.runtime.fsdp`).  ``recompute`` applies to blocks only.
    """

    name: str
    recompute: Recompute = Recompute.NONE
    zero: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, Recompute):
            object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise StrategyError(f"layer {self.name!r}: zero must be 0, 1, 2 or 3, got {self.zero!r}")


@dataclass(frozen=True)
class Layout(Record):
    """Degrees, pipeline stages and per-layer options of one training program.

    ``stages`` lists the layer names of every pipeline stage in stage order
    (``pp x virtual stages`` of them); their concatenation is the model's
    layer order.  Stage ``s`` runs on pipeline rank ``stage_ranks()[s]``
    (looped for GPipe/1F1B/interleaved, V-shaped for zero-bubble).
    ``mesh_dims`` orders the device-mesh dimensions outermost first: the
    last one varies fastest over consecutive ranks, so tensor parallelism,
    the most communication-heavy, stays inside a node.  ``ranks`` lists the
    process rank at each mesh position in that order (empty: position ``i`` is
    rank ``i``), which is how a plan maps its ranks onto devices.
    """

    dp: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int
    stages: tuple[tuple[str, ...], ...]
    layers: tuple[LayerLayout, ...]
    cp: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    sequence_parallel: bool = False
    precision: Precision = Precision.FP32
    mesh_dims: tuple[str, ...] = ("pp", "dp", "tp")
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name, enum_type in (("schedule", Schedule), ("precision", Precision)):
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                object.__setattr__(self, name, enum_type(value))
        object.__setattr__(self, "stages", tuple(tuple(s) for s in self.stages))
        object.__setattr__(self, "layers", tuple(
            l if isinstance(l, LayerLayout) else LayerLayout(**l) for l in self.layers))
        for name in ("dp", "tp", "pp", "cp", "micro_batch", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StrategyError(f"{name} must be a positive integer, got {value!r}")
        if sorted(self.mesh_dims) != ["dp", "pp", "tp"]:
            raise StrategyError(f"mesh_dims must order 'pp', 'dp' and 'tp', got {self.mesh_dims}")
        per_step = self.dp * self.micro_batch
        if self.global_batch % per_step:
            raise StrategyError(
                f"global_batch={self.global_batch} is not divisible by dp={self.dp} x "
                f"micro_batch={self.micro_batch} = {per_step}")
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if self.ranks and sorted(self.ranks) != list(range(self.world_size)):
            raise StrategyError(f"ranks must be a permutation of 0..{self.world_size - 1}, "
                                f"got {list(self.ranks)}")
        if self.sequence_parallel and self.tp == 1:
            raise StrategyError("sequence_parallel=True needs tp > 1")
        if not self.stages or any(len(s) == 0 for s in self.stages):
            raise StrategyError(f"every pipeline stage needs at least one layer; stages={self.stages}")
        if len(self.stages) % self.pp:
            raise StrategyError(f"{len(self.stages)} stages cannot be spread over pp={self.pp} "
                                "ranks: the number of stages must be a multiple of pp")
        v = len(self.stages) // self.pp
        if self.pp == 1 and v != 1:
            raise StrategyError(f"pp=1 runs one stage, got {len(self.stages)}")
        if self.pp > 1:
            if self.schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B) and v != 1:
                raise StrategyError(f"schedule={self.schedule.value!r} runs one stage per rank; "
                                    f"got {len(self.stages)} stages for pp={self.pp}")
            if self.schedule is Schedule.INTERLEAVED and v < 2:
                raise StrategyError("schedule='interleaved' needs at least two stages per rank; "
                                    f"got {len(self.stages)} stages for pp={self.pp}")
            if self.schedule is Schedule.ZERO_BUBBLE and v != 2:
                raise StrategyError("schedule='zero_bubble' (ZBV) runs exactly two stages per rank; "
                                    f"got {len(self.stages)} stages for pp={self.pp}")
            m = self.num_micro_batches
            if self.schedule is Schedule.ONE_F_ONE_B and m < self.pp:
                raise StrategyError(f"1F1B needs at least as many micro-batches as stages: "
                                    f"{m} micro-batches < pp={self.pp}")
            rounds = max(1, m // self.pp)
            if self.schedule is Schedule.INTERLEAVED and m % rounds:
                # torch's interleaved 1F1B runs the micro-batches in rounds of equal size
                raise StrategyError(f"interleaved 1F1B runs {m} micro-batches in "
                                    f"max(1, {m} // pp={self.pp}) = {rounds} rounds, which must "
                                    "divide them; choose a multiple of pp or fewer than 2 x pp")
            if self.schedule is Schedule.ZERO_BUBBLE and m < 2 * self.pp - 1:
                raise StrategyError(f"ZBV needs at least 2 x pp - 1 = {2 * self.pp - 1} "
                                    f"micro-batches, got {m}")

    # ------------------------------------------------------------------ views
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per data-parallel replica per step."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(n for s in self.stages for n in s)

    def layer(self, name: str) -> LayerLayout:
        for l in self.layers:
            if l.name == name:
                return l
        raise PlanMismatchError(f"the layout has no layer named {name!r}")

    def mesh_ranks(self) -> tuple[int, ...]:
        """The process rank at each mesh position (mesh order, last dim fastest)."""
        return self.ranks or tuple(range(self.world_size))

    def stage_ranks(self) -> tuple[int, ...]:
        """Pipeline rank of every stage: looped (``s % pp``) or V-shaped for zero-bubble."""
        n = len(self.stages)
        if self.schedule is Schedule.ZERO_BUBBLE and self.pp > 1:
            return tuple(s if s < self.pp else n - 1 - s for s in range(n))
        return tuple(s % self.pp for s in range(n))

    def local_stages(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks()) if r == pp_rank)

    def describe(self) -> str:
        zeros = sorted({l.zero for l in self.layers})
        rcs = sorted({l.recompute.value for l in self.layers} - {"none"})
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"mb{self.micro_batch}"]
        if zeros != [0]:
            parts.append("zero" + "/".join(map(str, zeros)))
        if rcs:
            parts.append("rc-" + "/".join(rcs))
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(f"{self.schedule.value}[" + "|".join(str(len(s)) for s in self.stages) + "]")
        return " ".join(parts)

    def with_options(self, **changes) -> "Layout":
        return replace(self, **changes)


def even_stages(names: Sequence[str], blocks: Sequence[str], num_stages: int) -> tuple[tuple[str, ...], ...]:
    """Split the blocks as evenly as possible over ``num_stages`` (earlier stages take the
    remainder); layers before the first block join the first stage, layers after the
    last block the last stage."""
    if num_stages == 1:
        return (tuple(names),)
    if len(blocks) < num_stages:
        raise StrategyError(f"{len(blocks)} blocks cannot fill {num_stages} pipeline stages; "
                            "lower pp or virtual_stages")
    first = names.index(blocks[0])
    last = names.index(blocks[-1])
    if list(names[first:last + 1]) != list(blocks):
        raise StrategyError("the blocks are not contiguous in the layer order; "
                            "pass an explicit Layout with the stage boundaries")
    q, r = divmod(len(blocks), num_stages)
    stages, i = [], 0
    for s in range(num_stages):
        n = q + (1 if s < r else 0)
        stages.append(list(blocks[i:i + n]))
        i += n
    stages[0] = list(names[:first]) + stages[0]
    stages[-1] = stages[-1] + list(names[last + 1:])
    return tuple(tuple(s) for s in stages)


def layout_from_strategy(strategy: Strategy, names: Sequence[str],
                         blocks: Sequence[str] | None = None) -> Layout:
    """The uniform ``strategy`` over the layers ``names`` (blocks: those that pipeline
    stages split; default every name but the first and last)."""
    if strategy.cp != 1:
        raise StrategyError(f"cp={strategy.cp}: the runtime does not implement context "
                            "parallelism; use cp=1")
    if blocks is None:
        blocks = list(names[1:-1]) if len(names) > 2 else list(names)
    v = strategy.chunks_per_rank if strategy.pp > 1 else 1
    stages = even_stages(list(names), list(blocks), strategy.pp * v)
    block_set = set(blocks)
    layers = tuple(LayerLayout(n, strategy.recompute if n in block_set else Recompute.NONE,
                               strategy.zero) for n in names)
    return Layout(dp=strategy.dp, tp=strategy.tp, pp=strategy.pp, cp=strategy.cp,
                  micro_batch=strategy.micro_batch, global_batch=strategy.global_batch,
                  stages=stages, layers=layers, schedule=strategy.schedule,
                  sequence_parallel=strategy.sequence_parallel, precision=strategy.precision)


def check_layout(layout: Layout, world_size: int, names: Sequence[str],
                 tp_divisors: dict[str, tuple[int, ...]] | None = None) -> None:
    """Reject a layout that does not fit the world or the model, before any collective.

    ``names`` are the model's layers in order (from :func:`autoplan.trace`);
    ``tp_divisors`` maps a layer to the sizes a TP degree must divide.
    """
    if layout.cp != 1:
        raise StrategyError(f"cp={layout.cp}: the runtime does not implement context "
                            "parallelism; use cp=1")
    if layout.world_size != world_size:
        raise StrategyError(
            f"dp={layout.dp} x tp={layout.tp} x pp={layout.pp} x cp={layout.cp} = "
            f"{layout.world_size}, but the world has {world_size} processes; the product of "
            "the degrees must equal the number of processes")
    known = list(names)
    unknown = [n for n in layout.layer_names if n not in known]
    unknown += [l.name for l in layout.layers if l.name not in known and l.name not in unknown]
    if unknown:
        raise PlanMismatchError(
            f"the layout names layers the model does not have: {unknown}; the model's layers "
            f"are {known}")
    if list(layout.layer_names) != known:
        missing = [n for n in known if n not in layout.layer_names]
        if missing:
            raise PlanMismatchError(f"the pipeline stages leave out layers {missing}; every layer "
                                    "must be placed in exactly one stage")
        raise PlanMismatchError(
            "the pipeline stages must hold the layers in model order, each once, as contiguous "
            f"runs; got {[list(s) for s in layout.stages]} for layers {known}")
    per_layer = {l.name for l in layout.layers}
    if per_layer != set(known) or len(layout.layers) != len(known):
        raise PlanMismatchError(f"the per-layer options must name every layer once; missing "
                                f"{sorted(set(known) - per_layer)}")
    if tp_divisors and layout.tp > 1:
        for name, divs in tp_divisors.items():
            bad = [d for d in divs if d % layout.tp]
            if bad:
                raise StrategyError(
                    f"tp={layout.tp} does not divide the sizes {bad} of layer {name!r} (heads, "
                    f"key/value heads, features: {list(divs)}); choose a tp that divides them")
    if layout.dp > 1:
        for s, stage in enumerate(layout.stages):
            zeros = {layout.layer(n).zero for n in stage}
            if 0 in zeros and len(zeros) > 1:
                raise PlanMismatchError(
                    f"stage {s} mixes replicated (zero=0) and sharded layers {sorted(zeros)}; "
                    "within a stage all layers must be replicated or all sharded (ZeRO 1-3)")


def layout_from_plan(plan) -> Layout:
    """The runtime layout of a searched :class:`~autoplan.plan.Plan`.

    The runtime runs one device mesh: every stage must have the same ``tp`` and
    ``dp``, every layer the stage's ``tp``, the replicas equal batches, one
    sequence-parallel setting, and ``cp = 1``.  Plans outside that are
    rejected with the reason (:class:`PlanMismatchError`).  The plan's rank ->
    device map becomes the mesh's rank order (process rank = device index).
    """
    mesh = plan.mesh
    if mesh.degree("cp") != 1:
        raise PlanMismatchError(f"the plan uses cp={mesh.degree('cp')}; the runtime does not "
                                "implement context parallelism")
    tps = sorted({st.tp for st in plan.stages})
    dps = sorted({st.dp for st in plan.stages})
    if len(tps) > 1 or len(dps) > 1:
        raise PlanMismatchError(f"the plan's stages use tp {tps} and dp {dps}; the runtime needs "
                                "the same tp and dp on every stage")
    tp, dp = tps[0], dps[0]
    if tp != mesh.degree("tp") or dp != mesh.degree("dp"):
        raise PlanMismatchError(f"the stages' tp={tp}, dp={dp} disagree with the mesh's "
                                f"tp={mesh.degree('tp')}, dp={mesh.degree('dp')}")
    odd = [lp.name for lp in plan.layers if lp.tp != tp]
    if odd:
        raise PlanMismatchError(f"layers {odd[:5]} have a tensor-parallel degree other than their "
                                f"stage's tp={tp}; the runtime shards every layer of a stage alike")
    sps = {lp.sequence_parallel for lp in plan.layers}
    if len(sps) > 1:
        raise PlanMismatchError("the plan turns sequence parallelism on for some layers only; the "
                                "runtime needs one setting for the whole model")
    if len(set(plan.replica_batch)) > 1:
        raise PlanMismatchError(f"the replicas get uneven batches {list(plan.replica_batch)}; the "
                                "runtime splits the global batch evenly")
    stages = tuple(tuple(st.layers) for st in sorted(plan.stages, key=lambda s: s.index))
    order = {n: i for i, n in enumerate(n for s in stages for n in s)}
    layers = tuple(LayerLayout(lp.name, lp.recompute, lp.zero)
                   for lp in sorted(plan.layers, key=lambda lp: order.get(lp.name, len(order))))
    dims = tuple(d for d in mesh.dims if d != "cp")
    return Layout(dp=dp, tp=tp, pp=mesh.degree("pp"), micro_batch=plan.micro_batch,
                  global_batch=plan.global_batch, stages=stages, layers=layers,
                  schedule=plan.schedule, sequence_parallel=bool(sps and sps.pop()),
                  precision=plan.precision, mesh_dims=dims, ranks=tuple(mesh.devices))
