"""``parallelize``: turn a model and a layout into a running torch.distributed program.

Called in every process of a job, after ``torch.distributed.init_process_group``.
The order of application follows torchtitan: pipeline split, then tensor (and
sequence) parallelism, context parallelism, expert parallelism (MoE experts split
over ep groups carved out of ``dp x cp``), then activation checkpointing, then
data parallelism (DDP, ``replicate`` or FSDP2; expert banks over their ``edp``
replicas), then one optimizer per local stage.  Everything
a rank can check on its own (degrees against the world, layer names against the
model, divisibility, schedule constraints) is checked before the first
collective, so every rank raises the same error and none is left waiting.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .cpu_heap import keep_cpu_heap
from .loss import token_cross_entropy
from ..errors import ConfigError, PlanMismatchError
from ..graph import LayerKind, LinearRole, ModelGraph
from ..hardware import Cluster
from ..plan import Plan
from ..precision import fp8_problem
from ..strategy import Precision, Recompute, Strategy, uses_ddp
from .ac import apply_ac
from .agree import on_rank0
from .cp import NextTokenLoss, apply_cp, check_cp, shard_batch
from .adapters import adapter_for, is_hf, model_output
from .ep import ExpertBank, apply_ep, check_ep
from .fsdp import apply_ddp, apply_expert_dp, apply_fsdp, apply_replicate, set_micro_batch_sync
from .fp8 import LIBRARY as FP8_LIBRARY, apply_fp8, check_fp8_device, float8_tp_styles, \
    has_fp8_all_gather, import_torchao, precompute_fsdp_scales
from .idle import IdleProgram, split_idle
from .precision import FP32_POLICY as _FP32_POLICY, mixed_precision_policy
from .layout import check_plan, plan_of, uniform_degrees
from .mesh import build_mesh, expert_meshes, mesh_coordinates, rank_at
from .optim import default_optimizer
from .pipeline import TiedGrads, build_schedule, build_stage_module, cross_stage_ties, make_stage
from .tp import apply_tp, reduce_partial_grads

__all__ = ["parallelize", "ParallelModel", "resolve_plan"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


# ---------------------------------------------------------------------- capture
_GRAPHS: dict[tuple, ModelGraph] = {}


def _graph_of(model: nn.Module, seq_len: int | None, example_inputs: Any) -> ModelGraph:
    """The captured graph of ``model`` (layer names, TP roles), memoised per structure:
    every rank and every call with the same architecture reuses one capture."""
    from ..capture import trace

    shapes = None
    if example_inputs is not None:
        flat = (list(example_inputs.values()) if isinstance(example_inputs, dict) else
                example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
        shapes = tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))
    key = (type(model).__qualname__, repr(model),
           tuple((n, tuple(p.shape)) for n, p in model.named_parameters()), seq_len, shapes)
    if key not in _GRAPHS:
        if len(_GRAPHS) > 16:
            _GRAPHS.clear()
        # without its fx GraphModule, which holds the captured model's own parameters: kept,
        # it keeps a whole unsharded copy of them alive on every rank after sharding
        _GRAPHS[key] = replace(trace(model, seq_len=seq_len, example_inputs=example_inputs),
                               fx_graph=None)
    return _GRAPHS[key]


def _check_graph(model: nn.Module, graph: ModelGraph, seq_len: int | None) -> None:
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if graph.model != type(model).__name__ or graph.num_params != n:
        raise PlanMismatchError(f"the graph is a capture of {graph.model} with {graph.num_params} "
                                f"parameters, the model a {type(model).__name__} with {n}")
    if seq_len is not None and graph.seq_len is not None and seq_len != graph.seq_len:
        raise PlanMismatchError(f"the graph was captured at seq_len={graph.seq_len}, the program "
                                f"is built for seq_len={seq_len}")


# ---------------------------------------------------------------------- targets
def resolve_plan(model: nn.Module, target: Any, graph: ModelGraph, *, world_size: int,
                 global_batch: int | None = None) -> Plan:
    """The :class:`~autoplan.Plan` of ``target`` for this model and world, validated
    (no collective but a Cluster's plan broadcast)."""
    if isinstance(target, Strategy):
        if global_batch is not None and global_batch != target.global_batch:
            raise ConfigError(f"global_batch={global_batch} but the strategy says "
                              f"global_batch={target.global_batch}; they must agree")
        plan = plan_of(target, graph, world_size=world_size)
    elif isinstance(target, Plan):
        target.check_model(graph)      # one line saying what differs, for another model's plan
        plan = target
    elif isinstance(target, Cluster):
        if global_batch is None:
            raise ConfigError("parallelize(model, cluster) needs global_batch to plan for")
        if target.num_devices != world_size:
            raise ConfigError(f"the cluster {target.name!r} has {target.num_devices} devices, but "
                              f"the world has {world_size} processes; they must agree")
        plan = _plan_on_rank0(graph, target, global_batch)
    else:
        raise ConfigError(f"target must be an autoplan.Strategy, Plan or Cluster, got "
                          f"{type(target).__name__}")
    check_plan(plan, world_size, graph, global_batch)
    return plan


def _plan_on_rank0(graph: ModelGraph, cluster: Cluster, global_batch: int) -> Plan:
    """Rank 0 searches (a time-bounded search need not agree across ranks) and every
    rank gets its plan, or its error, by broadcast: the one collective before validation."""
    from ..search import plan as search

    return Plan.from_json(on_rank0(lambda: search(
        graph, cluster, global_batch=global_batch, seq_len=graph.seq_len).to_json()))


# ---------------------------------------------------------------------- the program
@dataclass
class ParallelModel:
    """A model laid out over the processes of a job, with its optimizer(s).

    Attributes
    ----------
    plan : Plan
        The plan it runs (degrees, stages, per-layer options, replica batches):
        the record the search made and the cost model priced.
    mesh : DeviceMesh
        The plan's ``pp x dp x cp x tp`` device mesh.
    parts : list of nn.Module
        The wrapped local modules: the whole model without pipelining, else
        this rank's pipeline stages (two for ZBV, ``virtual_stages`` for
        interleaved).  Parameter names are the model's own.
    optimizers : list of torch.optim.Optimizer
        One per part.
    schedule : torch pipeline schedule or None
    graph : ModelGraph
        The capture the plan was checked against.
    """

    plan: Plan
    mesh: DeviceMesh
    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    graph: ModelGraph
    seq_len: int | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    token_model: bool
    hf: bool
    schedule: Any = None
    stages: list = field(default_factory=list)
    steps: int = 0
    tied: Any = None                     # TiedGrads of cross-stage tied parameters
    aliases: dict[str, str] = field(default_factory=dict)   # stage copy -> canonical name
    split: Any = None                    # IdleSplit when the plan leaves processes idle
    #: The logits stay sharded over the vocabulary and the loss runs under torch's
    #: ``loss_parallel`` (the built-in loss under tensor parallelism)
    vocab_parallel: bool = False
    #: FSDP2 all-gathers FP8 weights (ZeRO-3 under the tensorwise FP8 recipe): their
    #: scales are computed after every optimizer step (:mod:`.fp8`)
    fp8_scales: bool = False

    def finish(self) -> None:
        """Every process of the job back in one process group, when the plan left some
        idle (:mod:`.idle`; call it on every process when training ends); else nothing."""
        if self.split is not None:
            self.split.rejoin()

    # ------------------------------------------------------------ coordinates
    @property
    def coords(self) -> dict[str, int]:
        return mesh_coordinates(self.plan)

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        return self.coords["dp"]

    @property
    def replica_weight(self) -> float:
        """``dp x`` this replica's share of the global batch: its loss is scaled by this,
        so that the data-parallel mean of the replicas' gradients is the gradient of the
        mean loss over the global batch when replicas get uneven batches (1 when even)."""
        plan = self.plan
        return plan.dp * plan.replica_batch[self.replica] / plan.global_batch

    @property
    def holds_loss(self) -> bool:
        """Whether this rank computes losses (it holds the last pipeline stage)."""
        return self.plan.pp == 1 or any(s.is_last for s in self.stages)

    @property
    def holds_input(self) -> bool:
        return self.plan.pp == 1 or any(s.is_first for s in self.stages)

    # ------------------------------------------------------------ training
    def _local(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel replica's inputs and targets from the global batch."""
        plan = self.plan
        if self.token_model:
            if not isinstance(batch, torch.Tensor) or batch.dim() != 2:
                raise ConfigError("a token model's batch is a (global_batch, seq_len) tensor of ids, "
                                  f"got {type(batch).__name__}"
                                  f"{tuple(batch.shape) if isinstance(batch, torch.Tensor) else ''}")
            inputs = targets = batch
        else:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ConfigError("the batch of a non-token model is (inputs, targets), each with "
                                  "global_batch rows")
            inputs, targets = batch
        rows = _rows_of(inputs) | _rows_of(targets)     # inputs: a tensor, tuple or dict
        if rows != {plan.global_batch}:
            raise ConfigError(f"the batch has {sorted(rows)} rows; the plan's global batch "
                              f"is {plan.global_batch} (every input and target tensor has one "
                              "row per sample)")
        if self.token_model and self.seq_len is not None and inputs.shape[1] != self.seq_len:
            raise ConfigError(f"the batch has sequences of {inputs.shape[1]} tokens; the program "
                              f"was built for seq_len={self.seq_len}")
        r = self.replica
        lo, n = plan.replica_offset(r), plan.replica_batch[r]
        # this rank's rows on its device (a batch built on the host, a program on a GPU)
        inputs, targets = split_rows(inputs, lo, n, self.device), split_rows(targets, lo, n, self.device)
        if plan.cp > 1:
            # this rank's load-balanced share of every sequence, targets shifted before the split
            local = shard_batch(inputs, plan.cp, self.coords["cp"])
            inputs, targets = local.ids, local.targets
        return inputs, targets

    @property
    def device(self) -> torch.device:
        """The device this rank's parts live on (the collectives' and the batch's)."""
        return next(self.parts[0].parameters()).device

    def _forward(self, part: nn.Module, x: torch.Tensor) -> torch.Tensor:
        builtin = self.loss_fn is _next_token_loss or isinstance(self.loss_fn, NextTokenLoss)
        with _root_view_warning_silenced(part) if builtin else contextlib.nullcontext():
            out = (part(input_ids=x, use_cache=False) if self.hf else
                   part(**x) if isinstance(x, dict) else
                   part(*x) if isinstance(x, (tuple, list)) else part(x))
        return model_output(out)

    def _loss_context(self):
        """torch's ``loss_parallel`` around a loss and its backward over vocabulary-sharded
        logits (:attr:`vocab_parallel`)."""
        if not self.vocab_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def step(self, batch: Any) -> float:
        """One training step on the global ``batch``; returns the mean loss over it on every rank."""
        inputs, targets = self._local(batch)
        plan = self.plan
        weight = self.replica_weight
        m, runs = plan.micro_batches_of(self.replica), plan.micro_batches_run(self.replica)
        if plan.pp == 1:
            part = self.parts[0]
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            xs, ys = _micro_batches(inputs, plan.micro_batch), _micro_batches(targets, plan.micro_batch)
            # the replica's sequences (its last micro-batch may be short)
            n = next(iter(_rows_of(inputs)))
            for i in range(runs):
                # micro-batches beyond this replica's own (Plan.pads_micro_batches) repeat
                # its data with zero weight: their collectives match the other replicas'
                x, y = xs[i % m], ys[i % m]
                last = i == runs - 1
                set_micro_batch_sync(part, last)
                sync = (part.no_sync() if isinstance(part, nn.parallel.DistributedDataParallel)
                        and not last else contextlib.nullcontext())
                with sync, self._loss_context():
                    loss = self.loss_fn(self._forward(part, x), y)
                    rows = next(iter(_rows_of(x)))
                    (loss * (weight * rows / n if i < m else 0.0)).backward()
                if i < m:
                    total += _local_value(loss).detach().double() * rows
            local = total / n
        else:
            if not isinstance(inputs, torch.Tensor):
                raise ConfigError("pipeline parallelism runs models of one input tensor; use pp=1 "
                                  "for a model of several inputs")
            if runs > m:   # zero-weight micro-batches repeat the replica's first ones, their
                # targets marked (torch's schedules do not compute losses in micro-batch order)
                extra = (runs - m) * plan.micro_batch
                pad = torch.arange(extra, device=inputs.device) % inputs.shape[0]
                inputs = torch.cat([inputs, inputs[pad]])
                targets = torch.cat([targets, targets[pad] - _PAD_OFFSET])
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = {}
            if self.holds_loss:
                kwargs = {"target": targets, "losses": losses}
            args = (inputs,) if self.holds_input else ()
            # return_outputs=False: the last stage would otherwise keep every micro-batch's
            # output (the logits) until the step ends, to merge them for a caller that
            # only needs the losses
            with self._loss_context():
                self.schedule.step(*args, return_outputs=False, **kwargs)
            if self.tied is not None:
                self.tied()
            # the schedule's losses are scaled by weight / m, padding by 0 (_attach_pipeline)
            local = (torch.stack([_local_value(l).detach().double() for l in losses]).sum() / weight
                     if self.holds_loss else torch.zeros((), dtype=torch.float64,
                                                         device=self.device))
        reduce_partial_grads(self.parts)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self.fp8_scales:
            precompute_fsdp_scales(self.parts)   # the next step's FP8 all-gathers'
        self.steps += 1
        # mean over the global batch: each replica's mean weighted by its sequences, from
        # the ranks that hold the loss (every tensor-parallel rank of a replica alike)
        share = float(plan.replica_batch[self.replica]) if self.holds_loss else 0.0
        buf = torch.stack([local * share, torch.tensor(share, dtype=torch.float64,
                                                        device=self.device)])
        dist.all_reduce(buf)
        if self.split is not None:
            self.split.publish(self.steps, float(buf[0] / buf[1]))   # for the idle processes
        return float(buf[0] / buf[1])

    # ------------------------------------------------------------ state
    def _gather_to_rank0(self, sd: dict) -> dict | None:
        """Merge the per-stage dicts on global rank 0 (over the pipeline group of rank 0)."""
        if self.plan.pp == 1:
            return sd if dist.get_rank() == 0 else None
        c, c0 = self.coords, mesh_coordinates(self.plan, 0)
        if any(c[d] != c0[d] for d in c if d != "pp"):
            return None   # not in rank 0's pipeline group
        group = self.mesh["pp"].get_group()
        out: list | None = [None] * self.plan.pp if dist.get_rank() == 0 else None
        dist.gather_object(sd, out, dst=0, group=group)
        if out is None:
            return None
        merged: dict = {}
        for d in out:
            merged.update(d)
        return merged

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full, unsharded model state dict on rank 0 (None elsewhere); collective."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
        sd: dict[str, torch.Tensor] = {}
        for part in self.parts:
            sd.update(get_model_state_dict(part, options=opts))
        return self._gather_to_rank0({k: v.detach().clone() for k, v in sd.items()})

    def full_optimizer_state_dict(self) -> dict[str, Any] | None:
        """The full optimizer state, flattened (``state.<param>.<key>``), on rank 0; collective."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=False,
                                flatten_optimizer_state_dict=True)
        sd: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            sd.update(self._canonical(get_optimizer_state_dict(part, opt, options=opts)))
        # copies: the optimizer updates its state tensors (e.g. Adam's step) in place
        return self._gather_to_rank0({k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                      for k, v in sd.items()})

    def _canonical(self, optim_sd: dict[str, Any]) -> dict[str, Any]:
        """Optimizer keys of a tied parameter's stage copy under the parameter's canonical
        name, as a layout without the copy names it (the copies hold equal state)."""
        if not self.aliases:
            return optim_sd
        out = {}
        for key, value in optim_sd.items():
            kind, _, rest = key.partition(".")
            for alias, canonical in self.aliases.items():
                if rest.startswith(alias + "."):
                    key = f"{kind}.{canonical}{rest[len(alias):]}"
                    break
            out[key] = value
        return out

    def _aliased(self, optim_sd: dict[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`_canonical`: canonical keys also under each copy's name,
        as copies (``Optimizer.load_state_dict`` keeps the tensors it is given, and two
        optimizers stepping one state tensor would update it twice)."""
        if not self.aliases:
            return optim_sd
        out = dict(optim_sd)
        for key, value in optim_sd.items():
            kind, _, rest = key.partition(".")
            for alias, canonical in self.aliases.items():
                if rest.startswith(canonical + "."):
                    out[f"{kind}.{alias}{rest[len(canonical):]}"] = (
                        value.detach().clone() if isinstance(value, torch.Tensor) else value)
        return out

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Sharded model and optimizer state for torch.distributed.checkpoint, keyed by the
        model's parameter names (independent of the layout)."""
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            m, o = get_state_dict(part, opt, options=opts)
            model_sd.update(m)
            optim_sd.update(self._canonical(o))
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, opt in zip(self.parts, self.optimizers):
            set_state_dict(part, opt, model_state_dict=state["model"],
                           optim_state_dict=self._aliased(state["optim"]), options=opts)
        if self.fp8_scales:
            precompute_fsdp_scales(self.parts)   # the loaded weights' FP8 scales

    def save(self, path: str) -> None:
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path)

    def load(self, path: str) -> None:
        from .checkpoint import load_checkpoint

        load_checkpoint(self, path)


# ---------------------------------------------------------------------- parallelize
def _is_token_model(model: nn.Module, graph: ModelGraph) -> bool:
    return graph.seq_len is not None or "vocab_size" in graph.attributes


def parallelize(model: nn.Module, target: Any, *, global_batch: int | None = None,
                seq_len: int | None = None, example_inputs: Any = None,
                loss_fn: Callable | None = None,
                optimizer: OptimizerFactory | None = None,
                graph: ModelGraph | None = None, fp8_emulate: bool = False) -> ParallelModel:
    """Lay ``model`` out over the current torch.distributed world and return the program.

    Parameters
    ----------
    model : nn.Module
        The full model, materialised and identical on every rank (same
        initialisation).  Without pipelining it is modified in place; with it,
        each rank builds its stages from it (sharing its tensors); do not use
        it afterwards.
    target : Strategy, Plan, Cluster or SparsePlan
        A uniform :class:`~autoplan.Strategy` to apply (laid out as
        :meth:`Plan.from_strategy` lays it out for the cost model), a searched or
        hand-made :class:`~autoplan.Plan`, or a :class:`~autoplan.Cluster` to plan
        for (rank 0 searches and broadcasts the plan).  An embedding model's
        :class:`~autoplan.sparse.SparsePlan` runs its tables sharded and on servers
        (:func:`autoplan.sparse.runtime.parallelize_sparse`, which this returns).
    global_batch : int, optional
        Sequences per step; must agree with the target's (required for a Cluster).
    seq_len : int, optional
        Tokens per sequence of a token model (default: the model's context).
    example_inputs : optional
        One micro-batch of inputs, for non-token models.
    loss_fn : callable, optional
        ``loss_fn(output, targets) -> scalar``, a mean over the batch; default
        next-token cross-entropy (as Hugging Face computes with ``labels=input_ids``).
    optimizer : callable, optional
        ``optimizer(params) -> torch.optim.Optimizer``, called once per local
        stage; default :func:`~autoplan.runtime.optim.default_optimizer`
        (``torch.optim.AdamW(fused=True)``, the optimizer the cost model prices).
    graph : ModelGraph, optional
        ``autoplan.trace(model, seq_len=...)``, when the caller has it (the
        planner does); otherwise every rank traces the model (~1-3 s).
    fp8_emulate : bool
        Under an FP8 precision, run torchao's FP8 numerics on a device without FP8
        matmuls (CPU ranks, GPUs before Ada/Hopper): every FP8 GEMM multiplies the
        dequantized values in fp32 (:mod:`autoplan.runtime.fp8`).  Without it such a
        device is refused.

    Returns
    -------
    ParallelModel

    Raises
    ------
    StrategyError, PlanMismatchError, ConfigError
        Before any collective, on every rank alike, when the target does not
        fit the world size, the model, the batch or the schedule.

    Notes
    -----
    Failures of other ranks: a crashed rank closes its connections and the
    others' next collective raises at once; a hung rank makes them raise
    after the process group's timeout, which is the one given to
    ``init_process_group(timeout=...)`` (the mesh's groups inherit it).

    Examples
    --------
    >>> # in every process, after init_process_group("gloo"):
    >>> # pm = parallelize(GPT(cfg), Strategy(dp=2, tp=2, global_batch=8, precision="fp32"), seq_len=16)
    >>> # loss = pm.step(ids)   # ids: (8, 16), the same on every rank
    """
    from ..sparse.plan import SparsePlan
    if isinstance(target, SparsePlan):
        # an embedding-heavy model's plan (autoplan.sparse): sharded tables, servers
        from ..sparse.runtime import parallelize_sparse
        return parallelize_sparse(model, target, loss_fn=loss_fn, optimizer=optimizer)
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("parallelize() runs inside a torch.distributed job: call "
                          "torch.distributed.init_process_group first (e.g. under torchrun)")
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("the model has parameters on the meta device; materialise and "
                          "initialise it (identically on every rank) before parallelize()")
    if graph is None:
        graph = _graph_of(model, seq_len, example_inputs)
    else:
        _check_graph(model, graph, seq_len)
    seq_len = seq_len or graph.seq_len
    if isinstance(target, Cluster) and global_batch is not None \
            and target.num_devices == dist.get_world_size():
        target = _plan_on_rank0(graph, target, global_batch)  # may leave processes idle
    # a plan that leaves processes idle: they wait (idle.py), the others run it in a group
    target, split = split_idle(target, graph, global_batch)
    if split is not None and not split.active:
        return IdleProgram(target, split)
    plan = resolve_plan(model, target, graph, world_size=dist.get_world_size(),
                        global_batch=global_batch)
    token_model = _is_token_model(model, graph) and example_inputs is None
    device = next(model.parameters()).device
    banks = _check_program(model, graph, plan, seq_len, token_model, loss_fn, device=device,
                           fp8_emulate=fp8_emulate)
    # the built-in loss over logits sharded on the vocabulary (torch's loss_parallel): no
    # rank gathers the whole logits; a loss of the user's gets them whole
    vocab_parallel = (loss_fn is None and uniform_degrees(plan)[0] > 1
                      and any(l.role is LinearRole.VOCAB_HEAD
                              for layer in graph.layers for l in layer.tp.linears))
    loss_fn = loss_fn or (NextTokenLoss(seq_len, plan.cp) if plan.cp > 1 else _next_token_loss)
    optimizer = optimizer or default_optimizer
    # ---- no collective before this point (but for a Cluster's plan broadcast)
    if device.type == "cpu":
        keep_cpu_heap()   # freed activations stay for the next step (cpu_heap.py)
    mesh = build_mesh(plan, device.type)
    expert_mesh = expert_meshes(mesh, plan) if plan.ep > 1 else None
    if plan.pp == 1:
        stage_ids: tuple[int, ...] = (0,)
        parts, ties = [model], []
    else:
        stage_ids = plan.local_stages(mesh_coordinates(plan)["pp"])
        parts, ties = _build_stages(model, graph, plan, stage_ids, seq_len)
    for i, s in enumerate(stage_ids):
        parts[i] = _apply_parallelisms(parts[i], plan.stages[s].layers, model, graph, plan,
                                       mesh, seq_len, banks, expert_mesh, vocab_parallel,
                                       fp8_emulate)
    fp8_scales = plan.precision.is_fp8 and has_fp8_all_gather(parts)
    if fp8_scales:
        precompute_fsdp_scales(parts)    # the first step's, as every later step's
    pm = ParallelModel(plan=plan, mesh=mesh, parts=parts,
                       optimizers=[optimizer(p.parameters()) for p in parts], graph=graph,
                       seq_len=seq_len, loss_fn=loss_fn, token_model=token_model,
                       hf=is_hf(model), split=split, vocab_parallel=vocab_parallel,
                       fp8_scales=fp8_scales)
    if plan.pp > 1:
        _attach_pipeline(pm, stage_ids, ties, device)
    return pm


def check_runnable_precision(precision: Precision | str, device: torch.device | None = None,
                             *, fp8_emulate: bool = False,
                             emulate_hint: str = "pass parallelize(..., fp8_emulate=True)"
                             ) -> None:
    """Raise :class:`ConfigError` for a recipe the runtime cannot run, which the cost model
    still prices: fp16 (no loss scaling); an FP8 recipe torchao does not have
    (``fp8-blockwise``, Transformer Engine's), or, on ``device``, one without FP8 matmuls
    unless ``fp8_emulate`` (:func:`autoplan.runtime.fp8.check_fp8_device`, which says how
    to ask for emulation with ``emulate_hint``)."""
    precision = Precision(precision)
    if precision is Precision.FP16:
        raise ConfigError("precision='fp16' needs loss scaling, which the runtime does not do; "
                          "use 'bf16' or 'fp32'")
    if precision.is_fp8 and device is None:        # where the plan will run is not known
        problem = fp8_problem(precision, FP8_LIBRARY)
        if problem:
            raise ConfigError(problem)
    elif precision.is_fp8:
        check_fp8_device(precision, device, emulate=fp8_emulate, emulate_hint=emulate_hint)
        import_torchao()     # here, before any collective: installed, or one line saying how


def _check_program(model: nn.Module, graph: ModelGraph, plan: Plan, seq_len: int | None,
                   token_model: bool, loss_fn: Callable | None, *, device: torch.device,
                   fp8_emulate: bool = False) -> list[ExpertBank]:
    """What the plan needs from this model beyond its layer names (no collective); returns
    the expert banks expert parallelism splits (none without it)."""
    check_runnable_precision(plan.precision, device, fp8_emulate=fp8_emulate)
    if plan.cp > 1:
        if not token_model or loss_fn is not None:
            raise ConfigError(f"cp={plan.cp}: context parallelism trains token models with the "
                              "built-in next-token loss (the loss of a sequence split over ranks "
                              "needs its targets shifted before the split); use cp=1 with a "
                              "custom loss_fn")
        check_cp(model, seq_len=seq_len, cp=plan.cp)
    if plan.pp > 1:
        adapter = adapter_for(model)
        if adapter is None:
            raise ConfigError(f"pipeline parallelism needs to know how to split a "
                              f"{type(model).__name__}; the runtime knows the package GPT and "
                              "Hugging Face Llama-style decoders (use pp=1 for other models)")
        stack = {l.stack for l in graph.layers if l.kind is LayerKind.BLOCK}
        if stack != {adapter.blocks}:
            raise PlanMismatchError(f"the captured block stacks {sorted(stack)} are not the "
                                    f"{adapter.family} adapter's {adapter.blocks!r}")
        if not seq_len:
            raise ConfigError("pipeline parallelism needs seq_len")
    records = {r.name: r for r in graph.layers}
    coreless = [l.name for l in plan.layers if l.recompute is Recompute.SELECTIVE
                and l.name in records and records[l.name].kind is LayerKind.BLOCK
                and records[l.name].attention_core is None]
    if coreless:
        raise ConfigError(f"selective recompute re-runs the attention core the capture records "
                          f"for each block; the graph has none for {coreless[:3]} (captured by "
                          "an older autoplan?): re-capture it with autoplan.trace, or use "
                          "recompute='full'")
    if loss_fn is None and not token_model:
        raise ConfigError("pass loss_fn(output, targets) for a model that is not a token model")
    moe = [l.name for l in graph.layers if l.num_experts > 1]
    if moe and uniform_degrees(plan)[2]:
        # tp.py leaves a block with expert linears replicated over tp; sequence parallelism
        # would hand it a sequence shard as if it were tensor-parallel
        raise ConfigError(f"sequence parallelism with expert (MoE) layers {moe[:3]}: the runtime "
                          "keeps MoE blocks replicated over tp and cannot hand them sequence "
                          "shards; use sequence_parallel=False")
    if plan.ep == 1:
        return []
    blocks = [(l, l.name) for l in graph.layers if l.kind is LayerKind.BLOCK]
    banks = check_ep(model, blocks, plan.ep)
    if not banks:
        raise PlanMismatchError(f"ep={plan.ep}, but the graph records no expert layers present "
                                "in the model; use ep=1")
    return banks


def _build_stages(model: nn.Module, graph: ModelGraph, plan: Plan,
                  stage_ids: Sequence[int], seq_len: int) -> tuple[list[nn.Module], list]:
    """This rank's pipeline stage modules, and the tied parameters the split separates
    (an embedding tied to the head: each stage gets its own copy)."""
    adapter = adapter_for(model)
    kinds = {l.name: l.kind for l in graph.layers}
    stages = [st.layers for st in plan.stages]
    ties = cross_stage_ties(model, adapter, stages, kinds)
    copied = [name for tie in ties for name in tie.names]
    n = len(stages)
    parts = [build_stage_module(model, adapter,
                                [x for x in stages[s] if kinds[x] is LayerKind.BLOCK],
                                is_first=s == 0, is_last=s == n - 1, seq_len=seq_len,
                                copy_params=copied)
             for s in stage_ids]
    return parts, ties


def _apply_parallelisms(part: nn.Module, names: Sequence[str], model: nn.Module,
                        graph: ModelGraph, plan: Plan, mesh: DeviceMesh,
                        seq_len: int | None, banks: Sequence[ExpertBank] = (),
                        expert_mesh: tuple[DeviceMesh, DeviceMesh] | None = None,
                        vocab_parallel: bool = False, fp8_emulate: bool = False) -> nn.Module:
    """FP8 linears, tensor/sequence parallelism, expert parallelism, then activation
    checkpointing, then data parallelism on one part (the model or a stage) holding the
    layers ``names``."""
    kinds = {l.name: l.kind for l in graph.layers}
    blocks = [x for x in names if kinds[x] is LayerKind.BLOCK]
    placement = {x: plan.placement(x) for x in names}
    tp, dp, sp = uniform_degrees(plan)
    if plan.precision.is_fp8:
        # torchao's Float8Linear first, as torchtitan converts before it parallelizes
        apply_fp8(part, [(graph.layer(x), placement[x].zero) for x in names], plan.precision,
                  shards=dp * plan.cp, emulate=fp8_emulate)
    if tp > 1:
        adapter = adapter_for(model)
        first_block = next((l.name for l in graph.layers if l.kind is LayerKind.BLOCK), None)
        apply_tp(part, [(graph.layer(x), x) for x in names], mesh["tp"],
                 sequence_parallel=sp, first_block=first_block,
                 region_kwargs=adapter.region_kwargs if adapter is not None else {},
                 vocab_parallel_loss=vocab_parallel,
                 float8=float8_tp_styles(plan.precision) if plan.precision.is_fp8 else None)
    if plan.cp > 1:
        apply_cp(part, mesh["cp"], seq_len=seq_len)
    # (MoE layers are not tensor-parallel: an ep group holds ranks of one tp index)
    experts: list[tuple[nn.Module, str]] = []
    if expert_mesh is not None:
        mine = [b for b in banks if any(b.path.startswith(x + ".") for x in blocks)]
        modules = apply_ep(part, mine, expert_mesh[1])
        experts = [(m, next(x for x in blocks if b.path.startswith(x + ".")))
                   for m, b in zip(modules, mine)]
    for x in blocks:
        rc = placement[x].recompute
        if rc is not Recompute.NONE:
            _replace(part, x, apply_ac(part.get_submodule(x), rc, layer=graph.layer(x)))
    # the precision policy, installed by the data-parallel wrapper (see .precision)
    mp = mixed_precision_policy(plan.precision)
    if dp * plan.cp == 1:
        # no data parallelism: replicate over this rank alone reduces nothing, it only
        # installs the policy (fp32 plans need none)
        return part if mp is None else apply_replicate(part, mesh["dp"], mp_policy=mp)
    # parameters are replicated over the context-parallel ranks too: their gradients
    # are averaged, and ZeRO shards, over dp x cp (as the cost model prices it)
    dp_mesh = mesh["dp", "cp"]._flatten("dp_cp") if plan.cp > 1 else mesh["dp"]
    zeros = [placement[x].zero for x in names]
    mp = mp or _FP32_POLICY
    if experts:
        # expert shards are data-parallel over their edp replicas only (see .ep)
        apply_expert_dp([(m, placement[x].zero) for m, x in experts], expert_mesh[0],
                        mp_policy=mp)
    if uses_ddp(pp=plan.pp, tp=tp, ep=plan.ep, max_zero=max(zeros), precision=plan.precision):
        return apply_ddp(part, dp_mesh)
    if max(zeros) == 0:
        # torch's FSDP-based replicate: DTensor parameters and every pipeline schedule
        return apply_replicate(part, dp_mesh, mp_policy=mp)
    others = [placement[x].zero for x in names if kinds[x] is not LayerKind.BLOCK]
    # (plans never combine ZeRO-3 with zero-bubble schedules: strategy.ZBV_ZERO3)
    apply_fsdp(part, [(part.get_submodule(x), placement[x].zero) for x in blocks], dp_mesh,
               root_zero=max(others or zeros), mp_policy=mp)
    return part


def _attach_pipeline(pm: ParallelModel, stage_ids: Sequence[int], ties: list,
                     device: torch.device) -> None:
    """torch pipeline stages and schedule over this rank's parts, and the gradient sum of
    tied parameters split over stages.  The schedule's loss is divided by the replica's
    micro-batches and weighted by its share of the global batch
    (:attr:`ParallelModel.replica_weight`)."""
    plan, mesh = pm.plan, pm.mesh
    group = mesh["pp"].get_group()
    n = len(plan.stages)
    pm.stages = [make_stage(p, s, n, device, group) for p, s in zip(pm.parts, stage_ids)]
    m, runs = plan.micro_batches_of(pm.replica), plan.micro_batches_run(pm.replica)
    scale = pm.replica_weight / m

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if runs > m and int(y.max()) < -_PAD_OFFSET // 2:   # padding: runs, weighs nothing
            return pm.loss_fn(out, y + _PAD_OFFSET) * 0.0
        return pm.loss_fn(out, y) * scale

    pm.schedule = build_schedule(plan.schedule, pm.stages, runs, loss_fn)
    if ties:
        coords = mesh_coordinates(plan)
        others = [d for d in plan.mesh.dims if d != "pp"]
        sizes = dict(zip(plan.mesh.dims, plan.mesh.degrees))

        def peers(pps, at):
            return tuple(sorted(rank_at(plan, pp=r, **at) for r in pps))

        pm.tied = TiedGrads(
            ties, dict(zip(stage_ids, pm.parts)), plan.stage_ranks,
            rank_of=lambda r: rank_at(plan, pp=r, **{d: coords[d] for d in others}),
            all_pairs=lambda pps: [peers(pps, dict(zip(others, idx)))
                                   for idx in itertools.product(*(range(sizes[d])
                                                                  for d in others))])
        pm.aliases = {n: tie.canonical for tie in ties for n in tie.names[1:]}


#: Subtracted from the targets of zero-weight padding micro-batches under pipelining
#: (Plan.pads_micro_batches), which the loss recognises; far below any token id or
#: ignore index.
_PAD_OFFSET = 2**40


@contextlib.contextmanager
def _root_view_warning_silenced(root: nn.Module):
    """FSDP2 warns when a module it wraps returns a view (an in-place op on the view would
    skip that module's pre-backward hook), and under tensor parallelism the logits are one
    (the local tensor of the head's output DTensor).  The built-in losses read the whole
    model's output out of place, so for the root module the warning is noise on every run;
    a block's, or the root's under a loss of the user's, is left to be seen."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, message=(
            rf"FSDP2-wrapped module \({re.escape(type(root).__name__)}\) returned a view"))
        yield


def _local_value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (``loss_parallel`` returns a replicated DTensor)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def split_rows(value: Any, lo: int, n: int, device: torch.device | None = None) -> Any:
    """Rows ``[lo, lo + n)`` of every tensor in ``value`` (a tensor, tuple, list or dict)."""
    if isinstance(value, torch.Tensor):
        out = value[lo:lo + n]
        return out.to(device) if device is not None else out
    if isinstance(value, (tuple, list)):
        return type(value)(split_rows(v, lo, n, device) for v in value)
    if isinstance(value, dict):
        return {k: split_rows(v, lo, n, device) for k, v in value.items()}
    raise ConfigError(f"a batch holds tensors (in a tuple, list or dict), got {type(value).__name__}")


def _rows_of(value: Any) -> set[int]:
    """The first dimensions of every tensor in ``value`` (-1 for a scalar)."""
    if isinstance(value, torch.Tensor):
        return {int(value.shape[0])} if value.dim() else {-1}
    if isinstance(value, (tuple, list, dict)):
        parts = value.values() if isinstance(value, dict) else value
        return set().union(*(_rows_of(v) for v in parts))
    raise ConfigError(f"a batch holds tensors (in a tuple, list or dict), got {type(value).__name__}")


def _micro_batches(value: Any, size: int) -> list[Any]:
    """``value`` (a tensor, or a tuple or dict of tensors) split into micro-batches of
    ``size`` rows."""
    rows = next(iter(_rows_of(value)))
    return [split_rows(value, lo, min(size, rows - lo)) for lo in range(0, rows, size)]


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return token_cross_entropy(logits, ids, shift=True)


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    holder = root.get_submodule(parent) if parent else root
    if isinstance(holder, (nn.ModuleList, nn.ModuleDict)):
        holder[name if isinstance(holder, nn.ModuleDict) else int(name)] = module
    else:
        setattr(holder, name, module)
