"""What the runtime reads from a :class:`~autoplan.plan.Plan`, and what it checks first.

The runtime has no layout record of its own: :func:`~autoplan.runtime.parallelize`
turns every target into the one record the search and the cost model use, a
:class:`~autoplan.plan.Plan` (a uniform :class:`~autoplan.Strategy` through
:meth:`Plan.from_strategy`, with the same stage split and stage placement the
cost model prices), and applies it.  :func:`check_plan` rejects what one process
can see is wrong before a single collective is issued, so every rank raises the
same error and none is left waiting.

Examples
--------
>>> from autoplan import Strategy, trace
>>> from autoplan.models import GPT, GPTConfig
>>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
>>> p = plan_of(Strategy(pp=3, global_batch=6, precision="fp32"), g, world_size=3)
>>> [len(s.layers) for s in p.stages]      # 1, 1, 2 blocks: the last stage takes the remainder
[2, 1, 3]
>>> p.stage_ranks
(0, 1, 2)
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ConfigError, PlanMismatchError, StrategyError
from ..graph import ModelGraph
from ..plan import Plan
from ..strategy import Strategy

__all__ = ["plan_of", "check_plan", "uniform_degrees"]


def plan_of(strategy: Strategy, graph: ModelGraph, *, world_size: int,
            blocks_per_stage: Sequence[int] | None = None) -> Plan:
    """The plan of a uniform ``strategy`` over ``world_size`` processes (no cluster: the
    plan's devices are the process ranks), optionally with an uneven pipeline split."""
    strategy.check_world(world_size)
    return Plan.from_strategy(graph, world_size, strategy,
                              blocks_per_stage=None if blocks_per_stage is None
                              else tuple(blocks_per_stage))


def uniform_degrees(plan: Plan) -> tuple[int, int, bool]:
    """``(tp, dp, sequence_parallel)`` of a plan the runtime can lay out on one device mesh.

    Raises
    ------
    PlanMismatchError
        When stages use different tensor-parallel degrees, a layer another degree than
        its stage, or only some layers sequence parallelism (the search never proposes
        these; a hand-edited plan may).
    """
    tps = sorted({st.tp for st in plan.stages})
    if len(tps) > 1:
        raise PlanMismatchError(f"the plan's stages use tp {tps}; the runtime lays every stage "
                                "out on one device mesh and needs the same tp on all of them")
    tp = tps[0]
    odd = [lp.name for lp in plan.layers if lp.tp != tp]
    if odd:
        raise PlanMismatchError(f"layers {odd[:5]} have a tensor-parallel degree other than their "
                                f"stage's tp={tp}; the runtime shards every layer of a stage alike")
    sps = {lp.sequence_parallel for lp in plan.layers}
    if len(sps) > 1:
        raise PlanMismatchError("the plan turns sequence parallelism on for some layers only; the "
                                "runtime needs one setting for the whole model")
    return tp, plan.dp, sps.pop()


def check_plan(plan: Plan, world_size: int, graph: ModelGraph,
               global_batch: int | None = None) -> None:
    """Reject a plan that does not fit the world or the model, before any collective.

    Checks the process count, the layer names and their order, tensor-parallel
    divisibility, one device mesh (:func:`uniform_degrees`), ZeRO within a stage,
    the global batch and the sequence length.
    """
    if global_batch is not None and global_batch != plan.global_batch:
        raise ConfigError(f"global_batch={global_batch} but the plan says "
                          f"global_batch={plan.global_batch}; they must agree")
    if plan.num_devices != world_size:
        factors = " x ".join(f"{d}={n}" for d, n in zip(plan.mesh.dims, plan.mesh.degrees))
        raise StrategyError(f"{factors} = {plan.num_devices}, but the world has {world_size} "
                            "processes; the product of the degrees must equal the number of "
                            "processes")
    bad = [d for d in plan.mesh.devices if not 0 <= d < world_size]
    if bad:
        raise PlanMismatchError(f"the plan maps its ranks to devices {bad[:5]}, but the processes "
                                f"are 0..{world_size - 1}")
    if plan.seq_len is not None and graph.seq_len is not None and plan.seq_len != graph.seq_len:
        raise PlanMismatchError(f"the plan was made for seq_len={plan.seq_len}, the program is "
                                f"built for seq_len={graph.seq_len}")
    known = [l.name for l in graph.layers]
    placed = [n for st in plan.stages for n in st.layers]
    unknown = [n for n in placed if n not in known]
    if unknown:
        raise PlanMismatchError(f"the plan names layers the model does not have: {unknown[:8]}; "
                                f"the model's layers are {known}")
    if placed != known:
        missing = [n for n in known if n not in placed]
        if missing:
            raise PlanMismatchError(f"the pipeline stages leave out layers {missing[:8]}; every "
                                    "layer must be placed in exactly one stage")
        raise PlanMismatchError(
            "the pipeline stages must hold the layers in model order, each once, as contiguous "
            f"runs; got {[list(s.layers) for s in plan.stages]} for layers {known}")
    tp, dp, _ = uniform_degrees(plan)
    if tp > 1:
        for layer in graph.layers:
            bad = [d for d in layer.tp.divisors if d % tp]
            if bad:
                raise StrategyError(
                    f"tp={tp} does not divide the sizes {bad} of layer {layer.name!r} (heads, "
                    f"key/value heads, features: {list(layer.tp.divisors)}); choose a tp that "
                    "divides them")
    if dp * plan.cp > 1:
        for st in plan.stages:
            zeros = {plan.placement(n).zero for n in st.layers}
            if 0 in zeros and len(zeros) > 1:
                raise PlanMismatchError(
                    f"stage {st.index} mixes replicated (zero=0) and sharded layers "
                    f"{sorted(zeros)}; within a stage all layers must be replicated or all "
                    "sharded (ZeRO 1-3)")
