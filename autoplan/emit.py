"""``autoplan emit``: a plan becomes a standalone, readable training script.

The script embeds the plan (JSON), the cluster it was made for and the model
spec, and trains through :func:`autoplan.elastic.run_elastic` (which lays the
model out with :func:`autoplan.parallelize`, checkpoints, resumes, and replans
when the job restarts on another number of processes).  It picks NCCL when
CUDA is present and gloo otherwise, so the same file runs on a CPU test box and
on a GPU cluster.  :func:`launch_commands` gives the torchrun line for every
node, elastic (``--nnodes=MIN:MAX --max-restarts``) on request.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ConfigError
from .hardware.cluster import Cluster
from .plan import ClusterSummary, Plan

__all__ = ["emit_script", "launch_commands"]

_TEMPLATE = '''#!/usr/bin/env python
"""Training script emitted by autoplan for:

    {summary}

Launch it on every node with torchrun (one process per device):

{launch}

It runs with gloo on CPU and NCCL on GPU unchanged.  With --checkpoint-dir it
saves a verified checkpoint every --checkpoint-every steps and, when started
again (by hand, or by torchrun after a failure), resumes from the last good one.
{elastic_note}
The data here are random token ids that depend on (seed, step) only: replace
``data()`` with your loader, keeping it a function of the step, so that a
resumed run sees the batches the lost steps saw.
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from autoplan import trace
from autoplan.elastic import batch_for_step, check_device, main_exit_code, run_elastic
from autoplan.hardware.cluster import Cluster
from autoplan.plan import Plan
from autoplan.zoo import build_model

MODEL_SPEC = {model_spec!r}
MODEL_ARGS = {model_args!r}
VOCAB_SIZE = {vocab_size!r}
PLAN_JSON = r"""{plan_json}"""
CLUSTER_JSON = {cluster_json}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="total training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="verified checkpoints here; resume from the last good one")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--keep", type=int, default=3, help="good checkpoints to keep")
    parser.add_argument("--timeout-min", type=float, default=10.0, help="collective timeout")
    parser.add_argument("--log-every", type=int, default=1,
                        help="print loss, step time, tokens/s and the prediction every N steps")
    parser.add_argument("--fp8-emulate", action="store_true",
                        help="an FP8 plan on devices without FP8 matmuls (CPU, pre-Hopper GPUs): "
                             "run its numerics emulated, slowly (torchao emulate=True)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = "cuda" if cuda else "cpu"
    plan = Plan.from_json(PLAN_JSON)
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(minutes=args.timeout_min))
    try:
        # a device that cannot run the plan's precision (FP8 without FP8 matmuls and
        # without --fp8-emulate) stops every rank, with one line saying why
        check_device(plan, torch.device(device, torch.cuda.current_device()) if cuda
                     else torch.device("cpu"), fp8_emulate=args.fp8_emulate)
        cluster = Cluster.from_json(CLUSTER_JSON) if CLUSTER_JSON else None

        def model():
            return build_model(MODEL_SPEC, MODEL_ARGS, dtype=torch.float32, device=device)[0]

        def data(step):
            """The global batch of step ``step`` (1-based), the same on every rank."""
            return batch_for_step(args.seed, step, global_batch=plan.global_batch,
                                  seq_len=plan.seq_len, vocab_size=VOCAB_SIZE)

        # the model's layer graph, traced on the meta device (no memory): the model itself
        # is built only once a plan fits the processes there are
        graph = trace(build_model(MODEL_SPEC, MODEL_ARGS, dtype=torch.float32)[0],
                      seq_len=plan.seq_len)
        run_elastic(model, plan, cluster=cluster, graph=graph, steps=args.steps, seed=args.seed,
                    checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    keep=args.keep, data=data, log_every=args.log_every,
                    fp8_emulate=args.fp8_emulate)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main_exit_code(main)
    sys.stdout.flush()
    sys.stderr.flush()
    # end here, not in the interpreter's teardown: under gloo that can abort after the work
    # is done, and torchrun would take the abort for a failure and restart the job
    os._exit(code)
'''

_ELASTIC_NOTE = """
Elastic launch: torchrun restarts the job on the nodes that are left (at least
{min_nodes}); the script then replans for the new number of processes (the
cluster it was planned for is embedded below) and reshards the checkpoint.
"""


#: Set for torchrun when workers restart.  By default (torch >= 2.5) the workers'
#: process group shares the agents' rendezvous TCPStore across restarts, and the
#: restart count that should separate attempts is counted per agent, so it differs
#: between agents whose worker failed and those restarted for a membership change:
#: a restarted gloo/NCCL group then reads the previous attempt's addresses and
#: fails to connect (pytorch/pytorch#135712, #167288; reproduced here with gloo on
#: the first restart).  With the variable set, every attempt gets a fresh store.
RESTART_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def launch_commands(plan: Plan, script: str = "train.py", *, endpoint: str = "$MASTER_ADDR:29500",
                    args: str = "", min_nodes: int | None = None, max_nodes: int | None = None,
                    max_restarts: int = 0, last_call_timeout_s: int = 5,
                    keep_alive_s: int = 2) -> list[str]:
    """The torchrun command of every role of the plan's cluster: one line for all nodes.

    Every node runs ``devices / nodes`` processes and meets the others at ``endpoint``
    (the c10d rendezvous on node 0's address), with its node rank from ``$NODE_RANK``
    (``0 .. nodes - 1``, set in each node's environment).  With ``min_nodes`` (elastic) every
    node runs the same line, ``--nnodes=min_nodes:max_nodes`` (default: the plan's
    nodes), node ranks come from the rendezvous, torchrun restarts the workers up to
    ``max_restarts`` times, a rendezvous that has its minimum waits
    ``last_call_timeout_s`` for late nodes, and a node whose agent missed three
    ``keep_alive_s`` heartbeats is taken for dead (torch's default, 5 s, makes the
    survivors wait ~15 s for a lost node; 1 s halved recovery in the kill test).
    """
    nodes = max(1, plan.cluster.num_nodes)
    if plan.num_devices % nodes:
        raise ConfigError(f"the plan's {plan.num_devices} devices do not divide over "
                          f"{nodes} nodes evenly")
    per_node = plan.num_devices // nodes
    tail = f" {args}" if args else ""
    if max_restarts < 0:
        raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
    restarts = f" --max-restarts={max_restarts}" if max_restarts else ""
    torchrun = f"{RESTART_ENV} torchrun" if max_restarts or min_nodes is not None else "torchrun"
    if min_nodes is not None:
        top = nodes if max_nodes is None else max_nodes
        if not 1 <= min_nodes <= top:
            raise ConfigError(f"need 1 <= min_nodes <= max_nodes, got min_nodes={min_nodes}, "
                              f"max_nodes={top}")
        line = (f"{torchrun} --nnodes={min_nodes}:{top} --nproc-per-node={per_node}{restarts} "
                f"--rdzv-backend=c10d --rdzv-endpoint={endpoint} --rdzv-id=autoplan "
                f"--rdzv-conf=last_call_timeout={int(last_call_timeout_s)},"
                f"keep_alive_interval={int(keep_alive_s)} {script}{tail}")
        return [line]
    if nodes == 1:
        return [f"{torchrun} --standalone --nnodes=1 --nproc-per-node={per_node}{restarts} "
                f"{script}{tail}"]
    # one line for every node: each sets NODE_RANK (0 .. nodes-1) in its environment
    return [f"{torchrun} --nnodes={nodes} --nproc-per-node={per_node}{restarts} "
            f"--node-rank=$NODE_RANK --rdzv-backend=c10d --rdzv-endpoint={endpoint} "
            f"--rdzv-id=autoplan {script}{tail}"]


def _cluster_of(plan: Plan) -> Cluster | None:
    """The cluster a plan was made for, rebuilt from its profile name when that gives it back."""
    from .errors import ProfileError
    from .hardware import load_cluster

    try:
        cluster = load_cluster(plan.cluster.name, nodes=plan.cluster.num_nodes)
    except (ProfileError, ConfigError):
        try:
            cluster = load_cluster(plan.cluster.name)
        except (ProfileError, ConfigError):
            return None
    return cluster if ClusterSummary.from_cluster(cluster) == plan.cluster else None


def emit_script(plan: Plan, model_spec: str, model_args: dict[str, Any] | None = None,
                script_name: str = "train.py", *, cluster: Cluster | None = None,
                min_nodes: int | None = None, max_restarts: int = 0) -> str:
    """The text of a training script that runs ``plan`` for the model ``model_spec``.

    Parameters
    ----------
    cluster : Cluster, optional
        The cluster the plan was made for, embedded so that the script can replan
        when it is started on another number of processes (elastic restarts).
        Default: rebuilt from the plan's profile name when that gives the same
        devices; without it the script runs on the plan's device count only.
    min_nodes, max_restarts : int
        Elastic launch (see :func:`launch_commands`); needs the cluster.

    Raises
    ------
    PlanMismatchError
        When the plan was made for another model (its fingerprint, or in an older plan
        its layer names, differ from ``model_spec``'s).
    ConfigError
        When the plan's precision is one the runtime cannot run (fp16; fp8-blockwise,
        Transformer Engine's: an FP8 plan needs torchao, the ``fp8`` extra, and FP8 matmuls
        or ``--fp8-emulate`` where the script runs), when the
        plan has no sequence length (the script trains token models),
        the model has no ``config.vocab_size``, the cluster disagrees with the
        plan, or an elastic launch has no cluster to replan for.
    """
    from .runtime.parallelize import check_runnable_precision
    from .zoo import build_model

    check_runnable_precision(plan.precision)     # here, not in every rank after launch
    if plan.seq_len is None:
        raise ConfigError("emit writes training scripts for token models; this plan has no "
                          "sequence length")
    model = build_model(model_spec, model_args)[0]
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab_size, int):
        raise ConfigError(f"the model {model_spec!r} has no config.vocab_size: the emitted "
                          "script trains token models")
    from .capture import trace
    plan.check_model(trace(model, seq_len=plan.seq_len))    # a plan for another model: refused
    if cluster is not None and ClusterSummary.from_cluster(cluster) != plan.cluster:
        raise ConfigError(f"the plan was made for {plan.cluster.num_devices} devices of "
                          f"{plan.cluster.name!r}, not for the cluster given "
                          f"({cluster.num_devices} devices of {cluster.name!r})")
    cluster = cluster or _cluster_of(plan)
    if min_nodes is not None and cluster is None:
        raise ConfigError(f"an elastic script must replan for the nodes that remain, but the "
                          f"plan's cluster {plan.cluster.name!r} ({plan.cluster.num_devices} "
                          "devices) is not a shipped profile: pass the cluster (autoplan emit "
                          "--cluster ... --nodes ...)")
    launch = "\n".join(f"    {c}" for c in launch_commands(
        plan, script_name, min_nodes=min_nodes, max_restarts=max_restarts))
    plan_json = json.dumps(plan.to_dict(), indent=1)
    cluster_json = None if cluster is None else cluster.to_json()
    if '"""' in plan_json or (cluster_json and '"""' in cluster_json):
        raise ConfigError("the plan JSON cannot be embedded (contains triple quotes)")
    note = _ELASTIC_NOTE.format(min_nodes=min_nodes) if min_nodes is not None else ""
    return _TEMPLATE.format(summary=plan.summary(), launch=launch, model_spec=model_spec,
                            model_args=dict(model_args or {}), plan_json=plan_json,
                            vocab_size=vocab_size, elastic_note=note,
                            cluster_json="None" if cluster_json is None
                            else f'r"""{cluster_json}"""')
