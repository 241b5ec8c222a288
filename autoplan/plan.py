"""The :class:`Plan`: where every layer runs, on which devices, with which options.

The search produces a ``Plan``; the cost model prices it
(:func:`autoplan.cost.estimate_plan`); the runtime applies it.  A uniform
:class:`~autoplan.strategy.Strategy` becomes a ``Plan`` with
:meth:`Plan.from_strategy`, so ``estimate(graph, cluster, strategy)`` and
``estimate_plan(graph, cluster, Plan.from_strategy(graph, cluster, strategy))``
are the same computation.

Conventions
-----------
* **Rank order** (the mesh): ``tp`` innermost, then ``cp``, then ``dp``, with
  ``pp`` outermost::

      rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

  and ``Plan.mesh.devices[rank]`` is the cluster device index of that rank
  (by default ``device = rank``: devices are numbered node by node, so a
  tensor-parallel group of at most one node's size stays inside a node).
* **Stages** are *virtual* stages in execution order: ``pp * virtual_stages``
  of them.  Virtual stage ``k`` runs as chunk ``k // pp`` of pipeline rank
  ``k % pp`` (Narayanan et al. 2021, Sec. 2.2.2: the interleaved schedule
  gives each rank ``v`` non-consecutive chunks), or, under the zero-bubble
  schedule, of rank ``k`` for ``k < pp`` and ``2 pp - 1 - k`` after (a V, as
  torch's ZBV runs it; :func:`autoplan.strategy.stage_ranks`).
* **Blocks per stage**: evenly, the later stages taking the remainder
  (:func:`even_block_counts`): under 1F1B the first stage holds the most
  micro-batches in flight, so it gets the fewest blocks.  One function,
  :func:`chunk_bounds`, turns block counts into stages for the plan, the cost
  engine, the search and the runtime alike.
* Each stage lists its ``devices`` in rank order (``dp``, then ``cp``, then
  ``tp`` innermost), so replica ``r`` of a stage is the slice
  ``devices[r * cp * tp:(r + 1) * cp * tp]``.
* ``replica_batch[r]`` is how many sequences data-parallel replica ``r``
  processes per step: equal for a uniform strategy, uneven where replicas run
  on different device types.

Examples
--------
>>> from autoplan.models import GPT, GPTConfig
>>> from autoplan import trace
>>> from autoplan.hardware import load_cluster
>>> from autoplan.strategy import Strategy
>>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
>>> p = Plan.from_strategy(g, load_cluster("a100-sxm4-80gb"), Strategy(dp=2, tp=2, pp=2, global_batch=8))
>>> [s.layers for s in p.stages]
[('pre', 'blocks.0', 'blocks.1'), ('blocks.2', 'blocks.3', 'post')]
>>> p.stages[1].devices
(4, 5, 6, 7)
>>> Plan.from_json(p.to_json()) == p
True
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

from .cost.result import Estimate
from .errors import PlanMismatchError, RecordError, StrategyError
from .graph import LayerKind, ModelGraph
from .records import TRANSIENT, Record, to_dict
from .strategy import (ZBV_SELECTIVE, ZBV_ZERO3, Precision, Recompute, Schedule, Strategy, ep_problem,
                       schedule_problem, stage_ranks)

if TYPE_CHECKING:  # pragma: no cover
    from .cost.constants import CostOptions
    from .cost.summary import GraphSummary
    from .hardware import Cluster

__all__ = ["ClusterSummary", "ModelFingerprint", "MeshPlan", "StagePlan", "LayerPlacement", "Plan",
           "MESH_DIMS", "even_block_counts", "chunk_bounds", "expert_counts", "split_layers"]

#: Mesh dimensions, outermost first.
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ClusterSummary(Record):
    """What a plan records of the cluster it was made for."""

    name: str
    num_devices: int
    num_nodes: int
    device_types: tuple[str, ...]
    sites: tuple[str, ...]

    @classmethod
    def from_cluster(cls, cluster: "Cluster") -> "ClusterSummary":
        return cls(cluster.name, cluster.num_devices, cluster.num_nodes,
                   tuple(t.name for t in cluster.device_types), tuple(cluster.sites))


@dataclass(frozen=True)
class ModelFingerprint(Record):
    """What a plan records of the model it was made for, so that ``emit``,
    ``parallelize`` and ``replan`` can refuse a plan for another model.

    ``model`` is the model's class; ``num_params`` its parameter count (a tied
    parameter once); ``layer_params`` every captured layer's name and parameter count,
    in model order; ``attributes`` the shape figures the capture read (hidden size,
    heads, vocabulary, ...); ``linears_sha256`` a digest of every layer's linears
    (name, in and out features, experts, bias): shapes the counts could leave equal.
    Plans written before fingerprints were recorded load with ``fingerprint=None``.

    Examples
    --------
    >>> from autoplan import trace
    >>> from autoplan.models import GPT, GPTConfig
    >>> def fp(hidden):
    ...     cfg = GPTConfig(vocab_size=64, seq_len=16, hidden=hidden, heads=4, layers=2)
    ...     return ModelFingerprint.of(trace(GPT(cfg), seq_len=16))
    >>> fp(32).differences(fp(32))
    []
    >>> fp(32).differences(fp(64))[0]
    'hidden_size 32 (this model: 64)'
    """

    model: str
    num_params: int
    layer_params: dict[str, int]
    attributes: dict[str, int]
    linears_sha256: str

    @classmethod
    def of(cls, graph: ModelGraph) -> "ModelFingerprint":
        """The fingerprint of a captured model."""
        digest = hashlib.sha256()
        for layer in graph.layers:
            for lin in layer.tp.linears:
                digest.update(f"{layer.name}/{lin.name}:{lin.in_features}x{lin.out_features}"
                              f"x{lin.num_experts}:{int(lin.bias)};".encode())
        return cls(graph.model, graph.num_params, {l.name: l.param_count for l in graph.layers},
                   dict(graph.attributes), digest.hexdigest())

    def differences(self, other: "ModelFingerprint") -> list[str]:
        """What this fingerprint's model has that ``other`` ("this model") has not, the
        most telling first; empty when they match."""
        out = []
        if self.model != other.model:
            out.append(f"a {self.model} (this model: a {other.model})")
        names, theirs = list(self.layer_params), list(other.layer_params)
        if names != theirs:
            first = next((i for i, (a, b) in enumerate(zip(names, theirs)) if a != b),
                         min(len(names), len(theirs)))
            at = lambda ls: ls[first] if first < len(ls) else "none"  # noqa: E731
            count = (f"{len(names)} layers (this model: {len(theirs)}), "
                     if len(names) != len(theirs) else "")
            out.append(f"{count}layer {first} {at(names)} (this model: {at(theirs)})")
        for key in list(dict.fromkeys([*self.attributes, *other.attributes])):
            a, b = self.attributes.get(key), other.attributes.get(key)
            if a != b and a is not None and b is not None:
                out.append(f"{key} {a} (this model: {b})")
        if self.num_params != other.num_params:
            out.append(f"{self.num_params:,} parameters (this model: {other.num_params:,})")
        if names == theirs:
            for name in names:
                a, b = self.layer_params[name], other.layer_params[name]
                if a != b:
                    out.append(f"layer {name} with {a:,} parameters (this model: {b:,})")
                    break
        if not out and self.linears_sha256 != other.linears_sha256:
            out.append("linear layers of other shapes (the same parameter counts)")
        return out


@dataclass(frozen=True)
class MeshPlan(Record):
    """Named parallel dimensions (outermost first) and the rank -> device map."""

    dims: tuple[str, ...]
    degrees: tuple[int, ...]
    devices: tuple[int, ...]
    #: Expert parallel degree: a sub-dimension of ``dp x cp`` (the ``ep`` innermost
    #: consecutive ranks of the flattened ``dp x cp`` index share one MoE layer's experts).
    ep: int = 1

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.degrees):
            raise StrategyError(f"mesh dims {list(self.dims)} and degrees {list(self.degrees)} "
                                "differ in length")
        size = 1
        for d, n in zip(self.dims, self.degrees):
            if n < 1:
                raise StrategyError(f"mesh degree {d}={n} must be >= 1")
            size *= n
        if size != len(self.devices):
            factors = " x ".join(f"{d}={n}" for d, n in zip(self.dims, self.degrees))
            raise StrategyError(f"mesh {factors} = {size} ranks, but {len(self.devices)} devices "
                                "are mapped; the product of the degrees must equal the devices")
        if len(set(self.devices)) != len(self.devices):
            raise StrategyError("a device appears twice in the mesh's rank -> device map")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise StrategyError(f"mesh ep={self.ep!r} must be a positive integer")
        problem = ep_problem(self.ep, self.degree("dp"), self.degree("cp"))
        if problem:
            raise StrategyError(problem)

    def degree(self, dim: str) -> int:
        """The degree of ``dim`` (1 for a dimension the mesh does not have); ``"ep"`` is
        the expert parallel sub-dimension of ``dp x cp``."""
        if dim == "ep":
            return self.ep
        return self.degrees[self.dims.index(dim)] if dim in self.dims else 1


@dataclass(frozen=True)
class StagePlan(Record):
    """One virtual pipeline stage: its layers, devices and degrees."""

    index: int
    rank: int
    chunk: int
    layers: tuple[str, ...]
    devices: tuple[int, ...]
    device_type: str
    tp: int
    dp: int
    cp: int = 1

    def __post_init__(self) -> None:
        if len(self.devices) != self.tp * self.dp * self.cp:
            raise StrategyError(
                f"stage {self.index}: dp={self.dp} x cp={self.cp} x tp={self.tp} = "
                f"{self.dp * self.cp * self.tp} devices, but {len(self.devices)} are listed")

    def replica_devices(self, replica: int) -> tuple[int, ...]:
        """The ``cp * tp`` devices of data-parallel replica ``replica`` (rank order)."""
        n = self.cp * self.tp
        return self.devices[replica * n:(replica + 1) * n]


@dataclass(frozen=True)
class LayerPlacement(Record):
    """Where one layer runs and how: stage, tensor-parallel degree and options.

    ``tp`` must divide the stage's ``tp`` (a layer with a smaller degree is
    replicated over the rest of the stage's tensor-parallel group).
    """

    name: str
    stage: int
    tp: int
    sequence_parallel: bool
    zero: int
    recompute: Recompute

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, Recompute):
            object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.zero not in (0, 1, 2, 3):
            raise StrategyError(f"layer {self.name!r}: zero must be 0..3, got {self.zero!r}")
        if self.tp < 1:
            raise StrategyError(f"layer {self.name!r}: tp must be >= 1, got {self.tp}")
        if self.sequence_parallel and self.tp == 1:
            raise StrategyError(f"layer {self.name!r}: sequence_parallel needs tp > 1")


#: The fields of a plan written to JSON only when set (a plan without them writes what plans
#: wrote before they were added).
_WRITTEN_WHEN_SET = ("idle_reason", "fastest_for", "cost_options", "price_per_gpu_hour",
                     "search_space", "searched_precisions")


@dataclass(frozen=True)
class Plan(Record):
    """A complete parallel layout of one model on one cluster (see the module docstring)."""

    model: str
    cluster: ClusterSummary
    global_batch: int
    seq_len: int | None
    precision: Precision
    mesh: MeshPlan
    stages: tuple[StagePlan, ...]
    layers: tuple[LayerPlacement, ...]
    micro_batch: int
    num_micro_batches: int
    replica_batch: tuple[int, ...]
    schedule: Schedule
    virtual_stages: int
    estimate: Estimate | None = None
    #: The model's name for people (the graph's ``title``); ``model`` is its class.
    title: str = ""
    #: Why the plan leaves some of the cluster's devices idle (:attr:`idle_devices`), in
    #: words; empty when it uses them all.  Written to JSON only when it is not empty.
    idle_reason: str = ""
    #: What the search that made this plan proved it fastest for, as a digest of the cost
    #: model's inputs (options, constants, calibrated node profile), the search space and
    #: the precision: every layout of every subset of whole nodes of a cluster of one node
    #: profile (idle devices allowed, no budget stopping the search).  Such a plan is still
    #: the fastest on a smaller cluster of those nodes that holds it, which
    #: :func:`autoplan.replan` uses; empty where nothing was proved.  Written to JSON only
    #: when not empty.
    fastest_for: str = ""
    #: The cost model's options the plan was priced with, as
    #: :meth:`CostOptions.recorded <autoplan.cost.CostOptions.recorded>` gives them (the
    #: stack, and what differs from it); empty for the defaults.  :func:`autoplan.replan`
    #: prices the new plan with them (:meth:`cost_model_options`).  Written to JSON only
    #: when not empty.
    cost_options: dict[str, Any] = field(default_factory=dict)
    #: The price per GPU-hour of each device type the search weighed, when it made the plan
    #: the cheapest per sample (``price_per_gpu_hour``) rather than the fastest;
    #: :func:`autoplan.replan` keeps that objective.  Written to JSON only when set.
    price_per_gpu_hour: dict[str, float] = field(default_factory=dict)
    #: The search space the plan was chosen from where it is not the default one, as
    #: :meth:`SearchSpace.recorded <autoplan.search.SearchSpace.recorded>` gives it;
    #: :func:`autoplan.replan` searches the same space.  Written to JSON only when set.
    search_space: dict[str, Any] = field(default_factory=dict)
    #: The precision recipes the search chose among when it was given several
    #: (``plan(..., precision=["bf16", "fp8"])``); :func:`autoplan.replan` searches them
    #: all again.  Written to JSON only when set.
    searched_precisions: tuple[str, ...] = ()
    #: What identifies the model the plan was made for (None in plans written before it).
    fingerprint: ModelFingerprint | None = None
    # what the search knew when it made this plan: carried in memory, never written to
    # JSON nor compared (plan == Plan.from_json(plan.to_json()))
    #: The next best plans of the search that made this one (best first).
    runners_up: tuple["Plan", ...] = field(default=(), compare=False, repr=False, metadata=TRANSIENT)
    #: What that search did (:class:`autoplan.search.SearchResult`), or None.
    search_stats: Any = field(default=None, compare=False, repr=False, metadata=TRANSIENT)
    #: The captured graph the plan was made for (``replan`` searches it again), or None.
    graph: Any = field(default=None, compare=False, repr=False, metadata=TRANSIENT)
    #: Whether ``replan`` started from the old plan's layout (None: not a replan).
    warm_start: bool | None = field(default=None, compare=False, repr=False, metadata=TRANSIENT)

    def __post_init__(self) -> None:
        for name, enum_type in (("precision", Precision), ("schedule", Schedule)):
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                object.__setattr__(self, name, enum_type(value))
        if self.cost_options:
            from .cost.constants import CostOptions
            CostOptions.from_recorded(self.cost_options)        # RecordError: what is wrong
        if self.search_space:
            from .search.space import SearchSpace
            SearchSpace.from_recorded(self.search_space)        # RecordError: what is wrong
        for name in self.searched_precisions:
            try:
                Precision(name)
            except ValueError:
                raise RecordError(f"{name!r} is not one of {[m.value for m in Precision]}",
                                  "searched_precisions") from None
        for name, price in self.price_per_gpu_hour.items():
            if isinstance(price, bool) or not isinstance(price, (int, float)) \
                    or not 0 <= price < float("inf"):
                raise RecordError(f"{name!r}: a price per GPU-hour is a number >= 0, got "
                                  f"{price!r}", "price_per_gpu_hour")
        pp, v = self.pp, self.virtual_stages
        if len(self.stages) != pp * v:
            raise StrategyError(f"pp={pp} x virtual_stages={v} = {pp * v} stages expected, "
                                f"got {len(self.stages)}")
        dp = len(self.replica_batch)
        if sum(self.replica_batch) != self.global_batch:
            raise StrategyError(f"replica_batch {list(self.replica_batch)} sums to "
                                f"{sum(self.replica_batch)}, not global_batch={self.global_batch}")
        if self.micro_batch < 1:
            raise StrategyError(f"micro_batch={self.micro_batch} must be >= 1")
        for r, b in enumerate(self.replica_batch):
            if b < 1 or (b % self.micro_batch and pp > 1):
                raise StrategyError(
                    f"replica {r} gets {b} sequences per step, not a positive multiple of "
                    f"micro_batch={self.micro_batch}" + (" (pipelines run whole micro-batches)"
                                                         if b >= 1 else ""))
        if self.num_micro_batches != max(self.micro_batches_of(r) for r in range(dp)):
            raise StrategyError(f"num_micro_batches={self.num_micro_batches} but the largest "
                                f"replica runs {max(self.micro_batches_of(r) for r in range(dp))}")
        rank_devices: dict[int, tuple[int, ...]] = {}
        ranks = stage_ranks(self.schedule, pp, len(self.stages))
        for k, st in enumerate(self.stages):
            if (st.index, st.rank, st.chunk) != (k, ranks[k], k // pp):
                raise StrategyError(f"stages[{k}] has index={st.index}, rank={st.rank}, "
                                    f"chunk={st.chunk}; expected {k}, {ranks[k]}, {k // pp} "
                                    f"under schedule={self.schedule.value!r}")
            if st.dp != dp:
                raise StrategyError(f"stage {k} has dp={st.dp} but replica_batch has {dp} replicas")
            if rank_devices.setdefault(st.rank, st.devices) != st.devices:
                raise StrategyError(f"stage {k} runs on pipeline rank {st.rank} but lists other "
                                    "devices than that rank's other chunks")
        used: set[int] = set()
        for devs in rank_devices.values():
            if used & set(devs):
                raise StrategyError("two pipeline ranks share devices "
                                    f"{sorted(used & set(devs))[:8]}")
            used |= set(devs)
        placed = {}
        for lp in self.layers:
            if not 0 <= lp.stage < len(self.stages):
                raise StrategyError(f"layer {lp.name!r} is placed on stage {lp.stage}, but there "
                                    f"are {len(self.stages)} stages")
            if self.stages[lp.stage].tp % lp.tp:
                raise StrategyError(f"layer {lp.name!r} has tp={lp.tp}, which does not divide its "
                                    f"stage's tp={self.stages[lp.stage].tp}")
            if lp.name in placed:
                raise StrategyError(f"layer {lp.name!r} is placed twice")
            placed[lp.name] = lp.stage
        for st in self.stages:
            listed = tuple(n for n in st.layers)
            if any(placed.get(n) != st.index for n in listed):
                raise StrategyError(f"stage {st.index} lists layers that are placed elsewhere")
        if sum(len(st.layers) for st in self.stages) != len(self.layers):
            raise StrategyError("the stages' layer lists and the layer placements disagree")
        for r in range(dp):
            problem = schedule_problem(self.schedule, pp, v, self.micro_batches_run(r))
            if problem:
                raise StrategyError(f"replica {r} with {self.replica_batch[r]} sequences per "
                                    f"step: {problem}")
        if pp > 1 and self.schedule is Schedule.ZERO_BUBBLE:
            if any(lp.zero == 3 for lp in self.layers):
                raise StrategyError(ZBV_ZERO3)
            if any(lp.recompute is Recompute.SELECTIVE for lp in self.layers):
                raise StrategyError(ZBV_SELECTIVE)

    # ------------------------------------------------------------------ views
    @property
    def pp(self) -> int:
        return self.mesh.degree("pp")

    @property
    def dp(self) -> int:
        return len(self.replica_batch)

    @property
    def num_devices(self) -> int:
        return len(self.mesh.devices)

    def micro_batches_of(self, replica: int) -> int:
        """Micro-batches replica ``replica`` runs per step: its sequences over
        ``micro_batch``, a shorter last one counted (without pipelining a replica's batch
        need not be a multiple of the micro-batch)."""
        return -(-self.replica_batch[replica] // self.micro_batch)

    @property
    def idle_devices(self) -> tuple[int, ...]:
        """The cluster's devices the plan leaves idle (:attr:`idle_reason` says why)."""
        used = set(self.mesh.devices)
        return tuple(d for d in range(self.cluster.num_devices) if d not in used)

    @property
    def pads_micro_batches(self) -> bool:
        """Whether replicas with fewer micro-batches run extra ones of zero weight.

        Under ZeRO-2/3 every micro-batch gathers parameters or reduce-scatters
        gradients over the data-parallel group, so replicas of uneven batches must run
        the same number of micro-batches for their collectives to match: each runs the
        largest replica's count, those beyond its own with zero loss weight.  So must
        they under expert parallelism, whose token all-to-all spans replicas.  The cost
        model prices what runs (:meth:`micro_batches_run`)."""
        return len(set(self.replica_batch)) > 1 and (self.ep > 1 or any(lp.zero >= 2 for lp in self.layers))

    def micro_batches_run(self, replica: int) -> int:
        """Micro-batches replica ``replica`` runs per step, zero-weight padding included."""
        return self.num_micro_batches if self.pads_micro_batches else self.micro_batches_of(replica)

    @property
    def cp(self) -> int:
        return self.mesh.degree("cp")

    @property
    def ep(self) -> int:
        """Expert parallel degree (a sub-dimension of ``dp x cp``; 1 without it)."""
        return self.mesh.ep

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The pipeline rank of every virtual stage (looped, or a V for zero-bubble)."""
        return tuple(st.rank for st in self.stages)

    def local_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The virtual stages pipeline rank ``pp_rank`` runs, in execution order."""
        return tuple(st.index for st in self.stages if st.rank == pp_rank)

    def placement(self, name: str) -> LayerPlacement:
        """The placement of layer ``name``."""
        for lp in self.layers:
            if lp.name == name:
                return lp
        raise PlanMismatchError(f"the plan has no layer named {name!r}")

    def replica_offset(self, replica: int) -> int:
        """Index of replica ``replica``'s first sequence in the global batch."""
        return sum(self.replica_batch[:replica])

    def with_estimate(self, estimate: Estimate | None) -> "Plan":
        return replace(self, estimate=estimate)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON; ``idle_reason`` only when the plan leaves devices idle
        (so a plan that uses every device writes what it always wrote), ``fastest_for``
        only when set, ``cost_options`` only when not the defaults, ``price_per_gpu_hour``
        only for a plan made the cheapest, ``search_space`` only when not the default,
        ``searched_precisions`` only when several were searched."""
        out = to_dict(self)
        for name in _WRITTEN_WHEN_SET:
            if not getattr(self, name):
                del out[name]
        return out

    def cost_model_options(self, memory_fraction: float | None = None) -> "CostOptions":
        """The :class:`~autoplan.cost.CostOptions` this plan was priced with
        (:attr:`cost_options`), at ``memory_fraction`` (default: its estimate's)."""
        from .cost.constants import CostOptions
        if memory_fraction is None:
            memory_fraction = self.estimate.memory_fraction if self.estimate is not None else 0.9
        return CostOptions.from_recorded(self.cost_options, memory_fraction)

    def to_json(self, *, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False) + ("\n" if indent else "")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_strategy(cls, graph: "ModelGraph | GraphSummary", cluster: "Cluster | int",
                      strategy: Strategy,
                      *, devices: tuple[int, ...] | None = None,
                      blocks_per_stage: tuple[int, ...] | None = None) -> "Plan":
        """The plan of a uniform strategy, laid out as Megatron-LM does.

        The blocks are split evenly over the ``pp * virtual_stages`` virtual
        stages, the later stages taking the remainder (``blocks_per_stage``
        gives the counts instead); the layers before the first block
        (embeddings) go to the first stage, those after the last block (final
        norm, head, loss) to the last.  Ranks follow the module's convention
        (``tp`` innermost, ``pp`` outermost) and map to ``devices`` (default:
        device ``i`` for rank ``i``).  ``cluster`` may be a number of processes
        (a plan for the runtime made without a hardware profile).

        Raises
        ------
        StrategyError
            When the degrees do not fit the cluster or the model.
        """
        num_devices = cluster if isinstance(cluster, int) else cluster.num_devices
        strategy.check_world(num_devices if devices is None else len(devices))
        devices = tuple(range(num_devices)) if devices is None else tuple(devices)
        pp, dp, cp, tp, v = (strategy.pp, strategy.dp, strategy.cp, strategy.tp,
                             strategy.chunks_per_rank)
        _check_blocks(graph, tp=tp, cp=cp, stages=pp * v)
        _check_tp(graph, tp)
        _check_ep(graph, strategy.ep, dp, cp)
        chunks = split_layers(graph, pp * v, blocks_per_stage)
        per_rank = dp * cp * tp
        kinds = {l.name: l.kind for l in graph.layers}
        ranks = stage_ranks(strategy.schedule, pp, pp * v)
        type_names: dict[int, str] = {}
        stages, placements = [], []
        for k, names in enumerate(chunks):
            rank = ranks[k]
            devs = devices[rank * per_rank:(rank + 1) * per_rank]
            if rank not in type_names:
                type_names[rank] = (_PROCESS if isinstance(cluster, int)
                                    else _type_name(cluster, devs))
            stages.append(StagePlan(k, rank, k // pp, tuple(names), devs, type_names[rank],
                                    tp, dp, cp))
            for n in names:
                # Megatron recomputes transformer layers only, never embeddings or the head
                rc = strategy.recompute if kinds[n] is LayerKind.BLOCK else Recompute.NONE
                placements.append(LayerPlacement(n, k, tp, strategy.sequence_parallel,
                                                 strategy.zero, rc))
        mesh = MeshPlan(MESH_DIMS, (pp, dp, cp, tp), devices, ep=strategy.ep)
        per_replica = strategy.global_batch // dp
        summary = (ClusterSummary("processes", num_devices, 1, (_PROCESS,), ())
                   if isinstance(cluster, int) else ClusterSummary.from_cluster(cluster))
        fingerprint = ModelFingerprint.of(graph) if isinstance(graph, ModelGraph) else None
        return cls(
            model=graph.model, title=getattr(graph, "title", ""), fingerprint=fingerprint,
            cluster=summary,
            global_batch=strategy.global_batch, seq_len=graph.seq_len,
            precision=strategy.precision, mesh=mesh, stages=tuple(stages),
            layers=tuple(placements),
            micro_batch=strategy.micro_batch, num_micro_batches=strategy.num_micro_batches,
            replica_batch=(per_replica,) * dp, schedule=strategy.schedule,
            virtual_stages=v)

    def check_model(self, graph: ModelGraph) -> None:
        """Raise :class:`PlanMismatchError`, in one line saying what differs, unless this
        plan was made for the model ``graph`` captures: its fingerprint, or, in a plan
        written before fingerprints, its model class and layer names."""
        if self.fingerprint is not None:
            diffs = self.fingerprint.differences(ModelFingerprint.of(graph))
        else:
            mine = [lp.name for lp in self.layers]
            theirs = [l.name for l in graph.layers]
            diffs = ([f"a {self.model} (this model: a {graph.model})"]
                     if self.model != graph.model else [])
            if sorted(mine) != sorted(theirs):
                diffs.append(f"{len(mine)} layers (this model: {len(theirs)}), "
                             f"e.g. {sorted(set(mine) ^ set(theirs))[0]!r} in one only")
        if diffs:
            raise PlanMismatchError("the plan was made for another model: "
                                    f"{'; '.join(diffs[:3])}; make a plan for this model "
                                    "(autoplan plan MODEL ...)")

    def check(self, graph: ModelGraph, cluster: "Cluster") -> None:
        """Raise :class:`PlanMismatchError` unless this plan fits ``graph`` and ``cluster``."""
        self.check_model(graph)
        names = [l.name for l in graph.layers]
        mine = [lp.name for lp in self.layers]
        if sorted(names) != sorted(mine):
            missing = sorted(set(names) - set(mine))[:5]
            extra = sorted(set(mine) - set(names))[:5]
            raise PlanMismatchError(f"the plan's layers do not match the model {graph.model!r}: "
                                    f"missing {missing}, unknown {extra}")
        _check_ep(graph, self.ep, self.dp, self.cp)
        bad = [d for d in self.mesh.devices if not 0 <= d < cluster.num_devices]
        if bad:
            raise PlanMismatchError(f"the plan uses devices {bad[:5]} but the cluster "
                                    f"{cluster.name!r} has {cluster.num_devices}")

    # ------------------------------------------------------------------ text
    def __repr__(self) -> str:
        extra = len(getattr(self, "runners_up", ()))
        return f"<Plan {self.summary()}" + (f"; {extra} runners-up>" if extra else ">")

    def label(self, *, compact: bool = False) -> str:
        """The layout in a few words: degrees, micro-batching, ZeRO stages, recompute,
        sequence parallelism, schedule.  Every stage's ``tp`` and every option some layer
        uses is listed, so a mixed plan never reads as a uniform one.  ``compact`` drops
        the micro-batch count and abbreviates ZeRO as ``z`` (tables and figures)."""
        tps = sorted({s.tp for s in self.stages})
        parts = [f"dp{self.dp}", "tp" + "/".join(map(str, tps)), f"pp{self.pp}"]
        cp = self.mesh.degree("cp")
        if cp > 1:
            parts.append(f"cp{cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mb{self.micro_batch}" if compact
                     else f"mb{self.micro_batch}x{self.num_micro_batches}")
        zeros = sorted({lp.zero for lp in self.layers})
        if zeros != [0]:
            parts.append(("z" if compact else "zero") + "/".join(map(str, zeros)))
        rcs = self._recompute_options()
        if rcs:
            parts.append("rc-" + "/".join(rcs))
        if any(lp.sequence_parallel for lp in self.layers):
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.schedule.value + (f"x{self.virtual_stages}"
                                                if self.virtual_stages > 1 else ""))
        return " ".join(parts)

    def _recompute_options(self) -> list[str]:
        """The recompute options the label lists: every one some layer uses but ``none``,
        and ``none`` too where a repeated block (``<stack>.<index>``) is left without
        recompute while another block of its stack is recomputed (a mixed plan; the
        layers before and after the blocks are never recomputed in any plan)."""
        used = sorted({lp.recompute.value for lp in self.layers} - {"none"})
        if not used:
            return []
        recomputed, kept = set(), set()
        for lp in self.layers:
            match = _BLOCK_NAME.match(lp.name)
            if match:
                (kept if lp.recompute is Recompute.NONE else recomputed).add(match.group(1))
        return sorted(used + ["none"]) if recomputed & kept else used

    def summary(self) -> str:
        """One line: degrees, batch, schedule, and the estimate when there is one."""
        text = f"{self.title or self.model} {self.label()} on {self.num_devices}x " \
            f"{'+'.join(self.cluster.device_types)}"
        if self.estimate is not None:
            text += f": {self.estimate.summary()}"
        return text

    def describe(self) -> str:
        """Several lines: the summary and one line per stage."""
        lines = [self.summary()]
        for st in self.stages:
            first, last = (st.layers[0], st.layers[-1]) if st.layers else ("-", "-")
            devs = st.devices
            span = f"{devs[0]}..{devs[-1]}" if len(devs) > 1 else str(devs[0])
            lines.append(f"  stage {st.index} (rank {st.rank}, chunk {st.chunk}): "
                         f"{len(st.layers)} layers {first} .. {last}; devices {span} "
                         f"[{st.device_type}] dp{st.dp} cp{st.cp} tp{st.tp}"
                         + (f" ep{self.ep}" if self.ep > 1 else ""))
        if len(set(self.replica_batch)) > 1:
            lines.append(f"  replica batch: {list(self.replica_batch)}")
        if self.idle_reason:
            lines.append(f"  idle: {self.idle_reason}")
        return "\n".join(lines)

    def report(self) -> str:
        """:meth:`describe` followed by the estimate's report, when there is one."""
        text = self.describe()
        if self.estimate is not None:
            text += "\n" + self.estimate.report()
        return text


def _type_name(cluster: "Cluster", devices: tuple[int, ...]) -> str:
    names = list(dict.fromkeys(cluster.device_type_of(d).name for d in devices))
    return "+".join(names)


def _check_blocks(graph, *, tp: int, cp: int, stages: int) -> None:
    """Raise unless ``graph`` has the repeated blocks that tensor, context and pipeline
    parallelism split: without them (a model captured as one layer) nothing would be
    split, and a price would count the work whole on every device."""
    if any(l.kind is LayerKind.BLOCK for l in graph.layers):
        return
    asked = [f"{name}={n}" for name, n in (("tp", tp), ("cp", cp), ("pp x virtual stages", stages))
             if n > 1]
    if asked:
        raise StrategyError(
            f"{', '.join(asked)}: the model {graph.model!r} has no repeated blocks (capture "
            f"found no stack of identical layers, so its {len(graph.layers)} layer(s) run as "
            "one), and tensor, context and pipeline parallelism split blocks; use tp=1, "
            "cp=1, pp=1, or keep the model's blocks in an nn.ModuleList")


def _check_tp(graph, tp: int) -> None:
    """``graph``: a ModelGraph, or the cost model's GraphSummary (layers with ``max_tp``)."""
    for layer in graph.layers:
        if layer.kind is not LayerKind.BLOCK:
            continue
        if hasattr(layer, "max_tp"):
            if layer.max_tp and layer.max_tp % tp:
                raise StrategyError(f"tp={tp} does not divide layer {layer.name!r}; valid "
                                    f"degrees divide {layer.max_tp}")
            continue
        if layer.tp.divisors and layer.tp.max_degree() % tp:
            raise StrategyError(
                f"tp={tp} does not divide layer {layer.name!r} (heads/features "
                f"{list(layer.tp.divisors)}); valid degrees are {list(layer.tp.valid_degrees())}")


def expert_counts(graph) -> tuple[int, ...]:
    """The distinct expert counts of ``graph``'s MoE layers (empty for a dense model);
    ``graph`` is a ModelGraph or the cost model's GraphSummary."""
    return tuple(sorted({l.num_experts for l in graph.layers if l.num_experts > 1}))


def _check_ep(graph, ep: int, dp: int, cp: int) -> None:
    """Raise unless ``ep`` splits every expert bank of ``graph`` over ``dp x cp`` ranks."""
    if ep == 1:
        return
    counts = expert_counts(graph)
    if not counts:
        raise StrategyError(f"ep={ep} needs a model with expert layers (mixture of experts); "
                            f"{graph.model!r} has none: use ep=1")
    for n in counts:
        problem = ep_problem(ep, dp, cp, n)
        if problem:
            raise StrategyError(problem)


#: A repeated block's layer name: its stack (a ModuleList's path) and its index in it.
_BLOCK_NAME = re.compile(r"^(.*)\.(\d+)$")

#: The device type of a plan made for a number of processes rather than a cluster.
_PROCESS = "process"


def even_block_counts(num_blocks: int, num_chunks: int) -> list[int]:
    """Blocks per chunk, as even as possible, later chunks taking the remainder.

    Chunk ``i`` gets ``floor((i+1) n / k) - floor(i n / k)`` of the ``n`` blocks
    (Megatron-LM's split).  Under 1F1B the first stage keeps the most
    micro-batches in flight (:func:`autoplan.cost.schedules.in_flight`), so it
    is the one to hold fewer blocks.

    >>> even_block_counts(4, 3)
    [1, 1, 2]

    Raises
    ------
    StrategyError
        When there are fewer blocks than chunks.
    """
    if num_blocks == 0 and num_chunks == 1:
        return [0]          # a model without repeated blocks runs as one stage
    if num_blocks < num_chunks:
        raise StrategyError(f"the model has {num_blocks} blocks, fewer than the {num_chunks} "
                            "pipeline (virtual) stages; lower pp or virtual_stages")
    return [((i + 1) * num_blocks) // num_chunks - (i * num_blocks) // num_chunks
            for i in range(num_chunks)]


def chunk_bounds(is_block: Sequence[bool], counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` layer indices of each chunk when chunk ``c`` holds ``counts[c]`` blocks.

    The one stage-split rule of the plan, the cost engine, the search and the
    runtime: layers before the first block join the first chunk, layers after the
    last block the last chunk, and glue between two blocks the chunk of the block
    that follows it.

    >>> chunk_bounds([False, True, True, True, True, False], [1, 1, 2])
    [(0, 2), (2, 3), (3, 6)]

    Raises
    ------
    StrategyError
        When a count is not positive or the counts do not add up to the blocks.
    """
    blocks = [i for i, b in enumerate(is_block) if b]
    counts = list(counts)
    if not blocks and counts == [0]:
        return [(0, len(is_block))]      # no repeated blocks: one stage holds every layer
    if not counts or any(c < 1 for c in counts) or sum(counts) != len(blocks):
        raise StrategyError(f"blocks per stage {counts} must be positive and add up to the "
                            f"model's {len(blocks)} blocks")
    starts, b = [0], 0
    for c in counts[:-1]:
        b += c
        i = blocks[b]
        # glue layers before a block belong to the block's chunk
        while i - 1 > blocks[b - 1]:
            i -= 1
        starts.append(i)
    return list(zip(starts, starts[1:] + [len(is_block)]))


def split_layers(graph: ModelGraph, num_chunks: int,
                 counts: Sequence[int] | None = None) -> list[list[str]]:
    """Layer names of each of ``num_chunks`` consecutive chunks (:func:`chunk_bounds` of
    ``counts`` blocks per chunk, default :func:`even_block_counts`).

    Raises
    ------
    StrategyError
        When there are fewer blocks than chunks, or ``counts`` does not fit.
    """
    layers = graph.layers
    is_block = [l.kind is LayerKind.BLOCK for l in layers]
    if counts is None:
        counts = even_block_counts(sum(is_block), num_chunks)
    elif len(counts) != num_chunks:
        raise StrategyError(f"blocks_per_stage {list(counts)} names {len(counts)} stages, but "
                            f"the layout has {num_chunks}")
    return [[l.name for l in layers[lo:hi]] for lo, hi in chunk_bounds(is_block, counts)]
