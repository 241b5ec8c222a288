"""Step time of programs built by ``autoplan.parallelize`` vs hand-written torch programs.

For each layout the same processes build two programs from the same seed: one
with :func:`autoplan.runtime.parallelize`, one written by hand with the torch
APIs a user would call for that layout (DDP; ``fully_shard`` per block;
``parallelize_module`` with an explicit plan; ``PipelineStage`` +
``Schedule1F1B``).  They then take training steps alternately (A B, B A, ...,
so drift in machine load hits both alike) and the figure is the median over
the pairs of adjacent steps of their time ratio (the ratio of the median step
times is reported too, in ``--json``).  Target: <= 1.05 on CPU.

Both use the optimizer ``parallelize`` builds by default
(:func:`autoplan.runtime.optim.default_optimizer`, a fused AdamW), so the ratio is the
runtime's own overhead, not a choice of optimizer.  The hand-written programs do not
all-reduce the loss; the runtime does (one
2-element all-reduce per step so that every rank returns the global loss), so
that cost is inside the measured overhead.

    python benchmarks/runtime_overhead.py            # ~2-3 minutes on 2 cores
    python benchmarks/runtime_overhead.py --steps 40 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

TARGET_RATIO = 1.05
SEQ, VOCAB, GLOBAL_BATCH = 128, 1024, 8


def _gpt(seed: int = 0):
    import torch
    from autoplan.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=256, heads=8, layers=4))


def _llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _loss(logits, ids):
    from autoplan.runtime.loss import token_cross_entropy

    return token_cross_entropy(logits, ids, shift=True)


# ---------------------------------------------------------------------- hand-written programs
class _HandStep:
    """One hand-written training program: ``step(ids)`` on the global batch, stepping
    ``module``'s parameters with the optimizer ``parallelize`` builds by default."""

    def __init__(self, module, forward, dp_rank: int, dp: int, schedule=None,
                 first: bool = True, last: bool = True):
        from autoplan.runtime.optim import default_optimizer

        self.module, self.forward = module, forward
        self.opt = default_optimizer(module.parameters())
        self.dp_rank, self.dp, self.schedule = dp_rank, dp, schedule
        self.first, self.last = first, last

    def step(self, ids):
        n = ids.shape[0] // self.dp
        local = ids[self.dp_rank * n:(self.dp_rank + 1) * n]
        if self.schedule is None:
            loss = _loss(self.forward(self.module, local), local)
            loss.backward()
        else:
            kwargs = {"target": local, "losses": []} if self.last else {}
            self.schedule.step(*((local,) if self.first else ()), **kwargs)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _hand_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_gpt())
    return _HandStep(model, lambda m, x: m(x), rank, world)


def _hand_fsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return _HandStep(model, lambda m, x: m(x), rank, world)


def _hand_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = _llama()
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    fwd = lambda m, x: m(input_ids=x, use_cache=False).logits  # noqa: E731
    return _HandStep(model, fwd, 0, 1)


def _hand_pp(rank, world):
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = _gpt()
    per = len(model.blocks) // world
    first, last = rank == 0, rank == world - 1

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = model.tok_emb if first else None
            self.pos_emb = model.pos_emb if first else None
            self.blocks = nn.ModuleList(model.blocks[rank * per:(rank + 1) * per])
            self.ln_f = model.ln_f if last else None
            self.head = model.head if last else None

        def forward(self, x):
            if self.tok_emb is not None:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln_f(x)) if self.head is not None else x

    stage_mod = Stage()
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(stage, GLOBAL_BATCH // 2, loss_fn=_loss)
    return _HandStep(stage_mod, None, 0, 1, schedule=sched, first=first, last=last)


LAYOUTS = {
    # name: (model factory, strategy kwargs, hand-written builder)
    # one micro-batch per replica, as the hand-written programs run
    "dp2 (DDP), GPT": ("gpt", dict(dp=2, micro_batch=GLOBAL_BATCH // 2), _hand_ddp),
    "zero3 dp2 (FSDP2), GPT": ("gpt", dict(dp=2, zero=3, micro_batch=GLOBAL_BATCH // 2), _hand_fsdp),
    "tp2, Llama": ("llama", dict(tp=2, micro_batch=GLOBAL_BATCH), _hand_tp),
    "pp2 1F1B x4 micro, GPT": ("gpt", dict(pp=2, micro_batch=2, schedule="1f1b"), _hand_pp),
}


def _worker(rank: int, world: int, names: list[str], steps: int, warmup: int) -> dict:
    import torch

    from autoplan.runtime import parallelize
    from autoplan.strategy import Strategy

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    out = {}
    for name in names:
        model_name, kw, hand_builder = LAYOUTS[name]
        model = (_gpt if model_name == "gpt" else _llama)()
        ours = parallelize(model, Strategy(global_batch=GLOBAL_BATCH, precision="fp32", **kw),
                           seq_len=SEQ)
        hand = hand_builder(rank, world)
        times = {"autoplan": [], "hand": []}
        progs = {"autoplan": ours.step, "hand": hand.step}
        for _ in range(warmup):
            for fn in progs.values():
                fn(ids)
        for i in range(steps):
            order = ("autoplan", "hand") if i % 2 == 0 else ("hand", "autoplan")
            for key in order:
                torch.distributed.barrier()
                t0 = time.perf_counter()
                progs[key](ids)
                times[key].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        # each step of one program is paired with the adjacent step of the other, so a
        # change in machine load between pairs cancels; the figure is the median pair ratio
        pairs = [a / h for a, h in zip(times["autoplan"], times["hand"])]
        out[name] = {"autoplan_s": med["autoplan"], "hand_s": med["hand"],
                     "ratio": statistics.median(pairs),
                     "ratio_of_medians": med["autoplan"] / med["hand"],
                     "layout": ours.plan.describe()}
        del ours, hand, model
    return out


def main(argv: list[str] | None = None) -> int:
    from dist_harness import run

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="measured steps per program and layout")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default="", help="run the layouts whose name contains this")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    names = [n for n in LAYOUTS if args.only.lower() in n.lower()]
    results = run(_worker, 2, names, args.steps, args.warmup, timeout=1800)[0]
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"{'layout':<26} {'autoplan ms':>12} {'hand ms':>9} {'ratio':>7}   "
              f"target <= {TARGET_RATIO}  (medians of {args.steps} paired steps)")
        for name, r in results.items():
            print(f"{name:<26} {r['autoplan_s'] * 1e3:12.1f} {r['hand_s'] * 1e3:9.1f} "
                  f"{r['ratio']:7.3f}")
        print(f"total {time.perf_counter() - t0:.0f} s")
    return 0 if all(r["ratio"] <= TARGET_RATIO for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
