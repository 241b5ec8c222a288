"""Fault tolerance: verified checkpoints and an elastic training entry point.

Two pieces, usable apart:

**Checkpoint integrity** lives beside the DCP code, in
:mod:`autoplan.runtime.checkpoint_integrity` (:func:`save_verified`,
:func:`verify`, :func:`latest_good`, :data:`MANIFEST_FILE`; re-exported here and
from :mod:`autoplan.runtime.checkpoint`): every checkpoint carries a manifest of
the sha256 digests of its files, written last; the newest one that verifies is
the one a restart loads.

**Elastic training.**  :func:`run_elastic` is called by a training script in
every process of a job (the script ``autoplan emit`` writes, launched by
``torchrun --nnodes=MIN:MAX --max-restarts=R``).  When a process dies, its
peers' next collective fails, torchrun's agents re-rendezvous with the nodes
that are left and start the script again; it then finds a world of another
size, chooses a plan for it (:func:`choose_plan`), loads the last good
checkpoint, resharding it to the new layout (DCP reshards on load), and goes on
from the step after it.  The batch of step ``n`` depends on ``n`` only
(:func:`batch_for_step`, or the caller's ``data(step)``), so no step is
applied twice and none is lost beyond the checkpoint interval: a run killed
at any point and resumed on any world size trains the same sequence of steps
as an uninterrupted one.

Layout policy (elastic re-planning)
-----------------------------------
On the world size the plan was made for (the devices it leaves idle counted), the
plan runs as it is.  On another, rank 0 calls :func:`autoplan.replan` for the devices
of that world (:func:`cluster_for_world`: the first devices of the plan's cluster, or
more nodes like its last one) and broadcasts the plan: the search of
:func:`autoplan.plan`, which may leave devices idle where that is faster (losing one
node of 128 leaves 1016 = 8 x 127 GPUs, every layout of which runs 127 replicas; 126
nodes run a pipeline), keeping among plans within 1% of the fastest the one that
reshards least.  The processes of the plan's devices train; the others wait idle
(:mod:`autoplan.runtime.idle`: the process group is re-formed among the active ranks on
a store rank 0 hosts; all rejoin one group at the end, and a failure of an active rank
ends the idle ones' wait with an error).  When nothing fits (the model does not fit the
memory of the devices left, or no device count splits the batch) every rank raises
:class:`NoLayoutFits`, whose message gives the memory needed and available, before the
model is laid out and without touching the checkpoint directory;
:func:`main_exit_code` turns that into exit code :data:`EXIT_NO_LAYOUT`.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import CheckpointError, ConfigError, InfeasiblePlan, MissingDependencyError
from .graph import ModelGraph
from .hardware.cluster import Cluster, ClusterNode
from .plan import Plan
from .runtime.checkpoint_integrity import MANIFEST_FILE, latest_good, save_verified, verify

__all__ = [
    "MANIFEST_FILE",
    "EXIT_NO_LAYOUT",
    "EXIT_CANNOT_RUN",
    "check_device",
    "CannotRunHere",
    "save_verified",
    "verify",
    "latest_good",
    "cluster_for_world",
    "choose_plan",
    "batch_for_step",
    "run_elastic",
    "ElasticResult",
    "main_exit_code",
    "NoLayoutFits",
]

log = logging.getLogger(__name__)

#: Exit code of a training script whose world size no layout fits (see module docstring).
EXIT_NO_LAYOUT = 3
#: Exit code of a training script whose device cannot run the plan's precision
#: (:func:`check_device`).
EXIT_CANNOT_RUN = 4

# ---------------------------------------------------------------------- policy
class NoLayoutFits(InfeasiblePlan):
    """No layout fits the processes there are (the message says why and what
    would; ``required_bytes``/``available_bytes`` when memory binds)."""


def cluster_for_world(cluster: Cluster, world_size: int) -> Cluster:
    """The devices of a job of ``world_size`` processes, from the cluster it was planned for.

    torchrun tells a restarted worker how many processes there are, not which
    nodes left or joined, so the policy is positional: a smaller world keeps the
    first ``world_size`` devices (whole nodes first, as torchrun's node ranks
    are), a larger one adds nodes like the last node.  On a cluster of one
    device type (every shipped single-node profile) that is exact; on a mixed
    cluster it assumes the nodes lost or added are of the last group's kind.
    """
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    n = cluster.num_devices
    if world_size <= n:
        return cluster.subset(range(world_size))
    last = cluster.nodes[-1]
    extra, nodes = world_size - n, list(cluster.nodes)
    i = 0
    while extra > 0:
        ranks = last.local_ranks[:extra]
        nodes.append(ClusterNode(f"{last.name}+{i}", last.group, last.profile, last.site, ranks))
        extra -= len(ranks)
        i += 1
    return Cluster(cluster.name, cluster.profiles, tuple(nodes), cluster.site_links)


def choose_plan(plan: Plan, world_size: int, *, graph: ModelGraph,
                cluster: Cluster | None = None, time_limit_s: float | None = None,
                allow_idle: bool = True) -> Plan:
    """The plan an elastic job runs on ``world_size`` processes (policy in the module docstring).

    ``plan`` itself when it was made for ``world_size`` devices (those it leaves idle
    counted); otherwise :func:`autoplan.replan` of it for :func:`cluster_for_world` of
    ``cluster`` (the cluster ``plan`` was made for): the same search as
    :func:`autoplan.plan`, which may leave devices idle (``allow_idle=False``: none)
    where that is faster, e.g. 1016 = 8 x 127 GPUs and a batch of 1536, whose layouts
    of every device all run 127 replicas; among plans within 1% of the fastest, the one
    that reshards least.

    Raises
    ------
    NoLayoutFits
        When no layout fits: the model does not fit the devices' memory (the
        message gives the memory needed and there), or the global batch splits
        over no data-parallel degree of any device count tried.
    ConfigError
        When the world differs from the plan's and there is no ``cluster`` to replan for.
    """
    from .runtime.layout import uniform_degrees
    from .search import replan

    if world_size in (plan.num_devices, plan.cluster.num_devices):
        uniform_degrees(plan)           # PlanMismatchError when the runtime cannot run it
        return plan
    if cluster is None:
        raise ConfigError(
            f"the plan is for {plan.cluster.num_devices} processes but the job has "
            f"{world_size}; replanning needs the cluster the plan was made for (emit the "
            "script with --cluster/--nodes, or pass cluster= to run_elastic)")
    try:
        return replan(plan, cluster_for_world(cluster, world_size), graph=graph,
                      time_limit_s=time_limit_s, use_all_devices=not allow_idle)
    except InfeasiblePlan as e:     # memory binds: fewer devices will not fit either
        raise NoLayoutFits(f"no layout fits {world_size} processes: {e} Checkpoints were "
                           "left untouched; restart with more devices.",
                           required_bytes=e.required_bytes,
                           available_bytes=e.available_bytes, binding=e.binding) from None
    except ConfigError as e:        # the batch splits over no layout of these devices
        raise NoLayoutFits(f"no layout fits {world_size} processes: {e}. Checkpoints were "
                           "left untouched; restart with another number of processes or "
                           "change the global batch.") from None


def batch_for_step(seed: int, step: int, *, global_batch: int, seq_len: int,
                   vocab_size: int) -> torch.Tensor:
    """The token batch of training step ``step`` (1-based): a function of ``(seed, step)``
    only, identical on every rank and for every world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab_size, (global_batch, seq_len), generator=g)


# ---------------------------------------------------------------------- entry point
@dataclass
class ElasticResult:
    """What one :func:`run_elastic` call did.

    Attributes
    ----------
    world_size : int
    plan : Plan
        The plan this call ran (the given one, or its replan for this world).
    replanned : bool
        Whether ``plan`` was replanned for a world size other than the given plan's.
    resumed_from : int
        The step of the checkpoint loaded (0: started fresh).
    losses : dict of int to float
        Loss of every step this call ran, by step number.
    checkpoints : list of str
        Checkpoints this call wrote.
    active : bool
        False on a process the plan left idle (it trained nothing).
    """

    world_size: int
    plan: Plan
    replanned: bool
    resumed_from: int
    losses: dict[int, float]
    checkpoints: list[str]
    active: bool = True


def _agree(fn: Callable[[], Any], what: str, error: type[Exception] = ConfigError) -> Any:
    """``fn()`` on rank 0, its result on every rank; an error other than
    :class:`NoLayoutFits` is raised everywhere as ``error`` saying that ``what`` failed."""
    from .runtime.agree import on_rank0_named

    return on_rank0_named(fn, what, error, passing=(NoLayoutFits,))


def run_elastic(model_factory: Callable[[], torch.nn.Module], plan: Plan, *, steps: int,
                checkpoint_dir: str | None, checkpoint_every: int = 100,
                cluster: Cluster | None = None, seed: int = 0, keep: int = 3,
                data: Callable[[int], Any] | None = None, vocab_size: int | None = None,
                optimizer: Callable | None = None, graph: ModelGraph | None = None,
                time_limit_s: float | None = None, timeout: datetime.timedelta | None = None,
                on_step: Callable[[int, float], None] | None = None,
                log_every: int = 1, fp8_emulate: bool = False) -> ElasticResult:
    """Train steps ``1..steps`` across restarts; call it in every process of the job.

    Parameters
    ----------
    model_factory : callable
        ``model_factory() -> nn.Module``, called after ``torch.manual_seed(seed)``
        on every rank: the same materialised model everywhere (its initial
        weights matter only for a fresh start).
    plan : Plan
        The plan the job was made with (:func:`autoplan.plan`).  Run as is
        when the world has its device count; replanned otherwise.
    steps : int
        Total training steps (1-based step numbers ``1..steps``).
    checkpoint_dir : str or None
        Root of the ``step-<N>`` checkpoints, on a file system every rank sees;
        None: no checkpoints, always a fresh start.
    checkpoint_every : int
        Save a verified checkpoint after every step divisible by it (and after the last).
    cluster : Cluster, optional
        The cluster ``plan`` was made for; needed to replan for another world size.
    seed : int
        Seeds the model initialisation and the default per-step data.
    keep : int
        Good checkpoints to keep.
    log_every : int
        Rank 0 prints every ``log_every``-th step: loss, measured step time and
        tokens/s, and the plan's predicted step time beside them (0: never).
    data : callable, optional
        ``data(step) -> batch`` (the global batch of step ``step``, the same on
        every rank); default :func:`batch_for_step` random tokens.  It must
        depend on the step only, so that a resumed run sees the same batches.
    vocab_size : int, optional
        For the default data (default ``model.config.vocab_size``).
    optimizer : callable, optional
        Passed to :func:`autoplan.parallelize` (default
        :func:`~autoplan.runtime.optim.default_optimizer`, a fused AdamW).
    graph : ModelGraph, optional
        ``autoplan.trace`` of the model (e.g. built on the meta device); then the
        model is built only after a plan fits this world.  Default: every rank
        builds the model and traces it.
    time_limit_s : float, optional
        A wall-clock cap on the replanning search (default None: none; the search's
        deterministic work limit bounds it, so every process replans alike).
    timeout : datetime.timedelta, optional
        Collective timeout of the process groups this call forms when it leaves
        processes idle (default 10 minutes).
    on_step : callable, optional
        ``on_step(step, loss)`` after each step, before its checkpoint.
    fp8_emulate : bool
        An FP8 plan on devices without FP8 matmuls runs its numerics emulated
        (:func:`autoplan.parallelize`'s ``fp8_emulate``).

    Returns
    -------
    ElasticResult

    Raises
    ------
    NoLayoutFits
        On every rank when no layout fits this world (see :func:`choose_plan`),
        before the model is laid out (or built, given ``graph``) and without
        touching ``checkpoint_dir``.
    """
    import torch.distributed as dist

    from .capture import trace
    from .search import plan_diff

    if steps < 0 or checkpoint_every < 1:
        raise ConfigError(f"steps must be >= 0 and checkpoint_every >= 1, got steps={steps}, "
                          f"checkpoint_every={checkpoint_every}")
    if plan.seq_len is None and data is None:
        raise ConfigError("the plan has no sequence length: pass data=step -> batch")
    if not dist.is_initialized():
        dist.init_process_group("gloo")       # torchrun's env:// rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        msg = ("torchrun restarts this job but shares its rendezvous store with the workers: "
               "after a restart the process group can read the previous attempt's addresses "
               "and fail to connect (pytorch/pytorch#135712); launch torchrun with "
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (autoplan.emit.RESTART_ENV)")
        log.warning(msg)
        warnings.warn(msg, stacklevel=2)

    model = None
    if graph is None:       # trace the model itself (it is built anyway)
        torch.manual_seed(seed)
        model = model_factory()
        graph = trace(model, seq_len=plan.seq_len)
    chosen = Plan.from_json(_agree(lambda: choose_plan(
        plan, world, graph=graph, cluster=cluster, time_limit_s=time_limit_s).to_json(),
        f"planning for {world} processes"))
    replanned = chosen != plan
    if rank == 0 and replanned:
        print(f"elastic: the plan is for {plan.num_devices} processes, the job has {world}: "
              f"replanned\n  {chosen.summary()}\n  "
              + plan_diff(plan, chosen).replace("\n", "\n  "), flush=True)
    timeout = timeout or datetime.timedelta(minutes=10)
    split = None
    if chosen.num_devices < world:      # the plan's processes train, the others wait
        from .runtime.idle import IdleSplit

        split = IdleSplit.open(chosen, timeout)
        if not split.active:
            if rank == min(set(range(world)) - set(chosen.mesh.devices)):
                print(f"elastic: {len(chosen.idle_devices)} of {world} processes stay idle: "
                      f"{chosen.idle_reason or 'the plan uses the others'}", flush=True)
            split.rejoin()
            return ElasticResult(world_size=world, plan=chosen, replanned=replanned,
                                 resumed_from=0, losses={}, checkpoints=[], active=False)
    try:
        resumed_from, losses, written = _train(
            model_factory, model, split.plan if split is not None else chosen, graph,
            steps=steps, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            seed=seed, keep=keep, data=data, vocab_size=vocab_size, optimizer=optimizer,
            on_step=on_step, log_every=log_every, fp8_emulate=fp8_emulate)
    except BaseException as e:
        if split is not None:
            split.fail(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    if split is not None:
        split.rejoin()
    return ElasticResult(world_size=world, plan=chosen, replanned=replanned,
                         resumed_from=resumed_from, losses=losses, checkpoints=written)


def _train(model_factory: Callable[[], torch.nn.Module], model: torch.nn.Module | None,
           plan: Plan, graph: ModelGraph, *, steps: int, checkpoint_dir: str | None,
           checkpoint_every: int, seed: int, keep: int, data: Callable[[int], Any] | None,
           vocab_size: int | None, optimizer: Callable | None,
           on_step: Callable[[int, float], None] | None, log_every: int = 1,
           fp8_emulate: bool = False) -> tuple[int, dict[int, float], list[str]]:
    """Lay the model out under ``plan`` over the current process group, resume, train;
    returns the step resumed from, the loss of every step run and the checkpoints written."""
    import torch.distributed as dist

    from .runtime import parallelize

    rank, world = dist.get_rank(), dist.get_world_size()
    if model is None:       # built only once a plan fits
        torch.manual_seed(seed)
        model = model_factory()
    program = parallelize(model, plan, graph=graph, optimizer=optimizer, fp8_emulate=fp8_emulate)

    if data is None:
        vocab = vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is None:
            raise ConfigError("the model has no config.vocab_size: pass vocab_size= or data=")

        def data(step: int) -> torch.Tensor:
            return batch_for_step(seed, step, global_batch=plan.global_batch,
                                  seq_len=plan.seq_len, vocab_size=vocab)

    resumed_from = 0
    if checkpoint_dir is not None:
        # every rank must agree on the checkpoint: rank 0 picks, the others follow
        found = _agree(lambda: latest_good(checkpoint_dir),
                       f"looking for a checkpoint in {checkpoint_dir}", CheckpointError)
        if found is not None:
            path, resumed_from = found
            program.load(path)
            log.info("resumed from %s (step %d) on %d processes", path, resumed_from, world)
            if rank == 0:
                print(f"elastic: resumed from step {resumed_from} on {world} processes",
                      flush=True)

    losses: dict[int, float] = {}
    written: list[str] = []
    tokens = plan.global_batch * (plan.seq_len or 1)
    predicted = plan.estimate.step_time_s if plan.estimate is not None else None
    for step in range(resumed_from + 1, steps + 1):
        batch = data(step)
        start = time.perf_counter()
        loss = program.step(batch)       # returns the loss as a float: the step has finished
        seconds = time.perf_counter() - start
        losses[step] = loss
        if rank == 0 and log_every and (step % log_every == 0 or step == steps):
            print(f"step {step} loss {loss:.6f} world {world} | {_step_rate(seconds, tokens, predicted)}",
                  flush=True)
        if on_step is not None:
            on_step(step, loss)
        if checkpoint_dir is not None and (step % checkpoint_every == 0 or step == steps):
            written.append(save_verified(program, checkpoint_dir, step, keep=keep))
            if rank == 0:
                print(f"elastic: checkpoint step-{step} saved (world {world})", flush=True)
    return resumed_from, losses, written


def _step_rate(seconds: float, tokens: int, predicted: float | None) -> str:
    """``0.4121 s/step, 19,883 tokens/s (predicted 0.3804 s: measured 1.08x)``."""
    text = f"{seconds:.4g} s/step, {tokens / seconds:,.0f} tokens/s"
    if predicted:
        text += f" (predicted {predicted:.4g} s: measured {seconds / predicted:.2f}x)"
    return text


class CannotRunHere(ConfigError):
    """Some process's device cannot run the plan's precision (:func:`check_device`, which
    has printed the reason)."""


def check_device(plan: Plan, device: torch.device, *, fp8_emulate: bool = False) -> None:
    """Stop every process of a training script when a device cannot run ``plan``'s
    precision: an FP8 plan on a device without FP8 matmuls unless ``fp8_emulate``, or
    without torchao; a recipe the runtime does not run.

    Called by every process once the default process group exists (otherwise alone): the
    processes exchange their verdicts, rank 0 prints the first refusal as one line on
    stderr (before a barrier, so that no process ends first and has torchrun stop rank 0
    before it says why), and every process raises :class:`CannotRunHere`, which
    :func:`main_exit_code` turns into :data:`EXIT_CANNOT_RUN`.
    """
    import torch.distributed as dist

    from .runtime.parallelize import check_runnable_precision

    try:
        check_runnable_precision(plan.precision, device, fp8_emulate=fp8_emulate,
                                 emulate_hint="add --fp8-emulate to the script's arguments")
        problem = None
    except (ConfigError, MissingDependencyError) as e:
        problem = str(e)
    grouped = dist.is_available() and dist.is_initialized()
    if grouped:
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem is None:
        return
    if not grouped or dist.get_rank() == 0:
        print(f"autoplan: {problem}", file=sys.stderr, flush=True)
    if grouped:
        dist.barrier()
    raise CannotRunHere(problem)


def main_exit_code(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` (a training script's body calling :func:`run_elastic`); return the
    process exit code: 0, :data:`EXIT_NO_LAYOUT` with the reason on stderr when no
    layout fits the world size, or :data:`EXIT_CANNOT_RUN` when :func:`check_device`
    refused a device (and printed why).  Other errors propagate."""
    try:
        fn()
    except NoLayoutFits as e:
        print(f"autoplan.elastic: {e}", file=sys.stderr, flush=True)
        return EXIT_NO_LAYOUT
    except CannotRunHere:
        return EXIT_CANNOT_RUN
    return 0
