"""``autoplan emit``: a plan becomes a standalone, readable training script.

The script embeds the plan (JSON) and the model spec, and trains through the
public API (:func:`autoplan.parallelize` then ``ParallelModel.step``).  It
picks NCCL when CUDA is present and gloo otherwise, so the same file runs on a
CPU test box and on a GPU cluster.  :func:`launch_commands` gives the torchrun
line for every node.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ConfigError
from .plan import Plan

__all__ = ["emit_script", "launch_commands"]

_TEMPLATE = '''#!/usr/bin/env python
"""Training script emitted by autoplan for:

    {summary}

Launch it on every node with torchrun (one process per device):

{launch}

It runs with gloo on CPU and NCCL on GPU unchanged.  The data here are random
token ids from a fixed seed (replace ``batches()`` with your data loader); every
rank receives the same global batch and parallelize() gives each rank its slice.
"""

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import autoplan
from autoplan.plan import Plan
from autoplan.zoo import build_model

MODEL_SPEC = {model_spec!r}
MODEL_ARGS = {model_args!r}
PLAN_JSON = r"""{plan_json}"""


def batches(plan, vocab_size, seed):
    """Global batches of token ids, shape (global_batch, seq_len), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab_size, (plan.global_batch, plan.seq_len), generator=generator)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--timeout-min", type=float, default=10.0, help="collective timeout")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(minutes=args.timeout_min))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = Plan.from_json(PLAN_JSON)
    if world != plan.num_devices:
        raise SystemExit(f"this plan is for {{plan.num_devices}} processes, but torchrun started "
                         f"{{world}}; launch one process per device as the docstring shows")

    torch.manual_seed(args.seed)            # the same initial weights on every rank
    device = "cuda" if cuda else "cpu"
    model, _ = build_model(MODEL_SPEC, MODEL_ARGS, dtype=torch.float32, device=device)
    program = autoplan.parallelize(model, plan, global_batch=plan.global_batch, seq_len=plan.seq_len)

    vocab_size = model.config.vocab_size
    data = batches(plan, vocab_size, args.seed)
    for step in range(args.steps):
        loss = program.step(next(data))
        if rank == 0:
            print(f"step {{step}} loss {{loss:.6f}}", flush=True)
    if args.checkpoint_dir:
        program.save(args.checkpoint_dir)
        if rank == 0:
            print(f"checkpoint written to {{args.checkpoint_dir}}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def launch_commands(plan: Plan, script: str = "train.py", *, endpoint: str = "$MASTER_ADDR:29500",
                    args: str = "") -> list[str]:
    """One torchrun command per node of the plan's cluster.

    Every node runs ``devices / nodes`` processes and meets the others at ``endpoint``
    (the c10d rendezvous on node 0's address).
    """
    nodes = max(1, plan.cluster.num_nodes)
    if plan.num_devices % nodes:
        raise ConfigError(f"the plan's {plan.num_devices} devices do not divide over "
                          f"{nodes} nodes evenly")
    per_node = plan.num_devices // nodes
    tail = f" {args}" if args else ""
    if nodes == 1:
        return [f"torchrun --standalone --nnodes=1 --nproc-per-node={per_node} {script}{tail}"]
    return [f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --node-rank={i} "
            f"--rdzv-backend=c10d --rdzv-endpoint={endpoint} --rdzv-id=autoplan {script}{tail}"
            for i in range(nodes)]


def emit_script(plan: Plan, model_spec: str, model_args: dict[str, Any] | None = None,
                script_name: str = "train.py") -> str:
    """The text of a training script that runs ``plan`` for the model ``model_spec``.

    Raises
    ------
    ConfigError
        When the plan has no sequence length (the script trains token models).
    """
    if plan.seq_len is None:
        raise ConfigError("emit writes training scripts for token models; this plan has no "
                          "sequence length")
    launch = "\n".join(f"    {c}" for c in launch_commands(plan, script_name))
    plan_json = json.dumps(plan.to_dict(), indent=1)
    if '"""' in plan_json:
        raise ConfigError("the plan JSON cannot be embedded (contains triple quotes)")
    return _TEMPLATE.format(summary=plan.summary(), launch=launch, model_spec=model_spec,
                            model_args=dict(model_args or {}), plan_json=plan_json)
