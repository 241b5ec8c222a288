"""What a data-parallel gradient reduction costs on this CPU, wrapper by wrapper.

The cost model prices a step's data-parallel reduction as its collective (the profile's
all-reduce or reduce-scatter) and, for FSDP2's ZeRO-2/3, copies through its flat buffers at
the memory bandwidth.  On a CPU host the wrappers ``autoplan.parallelize`` uses cost more than
that: this measures, on ``--nproc`` processes (gloo, one thread each) over data-parallel
groups of ``--dp``, a small GPT's forward + backward with the gradient reduction on and off,
for DDP, FSDP2's ``replicate`` and ``fully_shard`` at ZeRO-1/2/3, next to the bare all-reduce
of the same gradient bytes (the model's parameters, fp32).  Each figure is the median step
over ``--steps`` steps, every rank timed from the first start to the last end.

    python benchmarks/dp_reduce_cpu.py                 # 4 processes, dp 4 (~1-2 min on 2 cores)
    python benchmarks/dp_reduce_cpu.py --nproc 2 --dp 2

What it found on the 2-core machine this was written on (2026-11-24, several runs on 2 and 4
processes, one with 3): replicate's reduction took 1.4-3.7x the bare all-reduce, DDP's 1.3-2.0x,
ZeRO-1/2/3's 0.9-4.3x (the widest with ``--steps 3``).  FSDP2 copies each reduction's gradients into a flat buffer allocated for the call,
and the same 64 MiB copy into a new tensor took 0.5-1.7 ms per MiB more than into a reused one
(the pages fault on first write).  The figures moved by up to 2x between runs and with the
order the wrappers ran in; read the ratios of one run.
There is no target: it says what the cost model does not yet price.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_truth import _run_ranks  # noqa: E402  (spawn, join by a deadline, error reports)

WRAPPERS = ("ddp", "replicate", "zero1", "zero2", "zero3")
TIMEOUT_S = 900.0   # for the whole launch


def _worker(rank: int, world: int, port: int, _label: str, outdir: str, *, dp: int,
            steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from autoplan.models import GPT, GPTConfig
        from autoplan.runtime.fsdp import apply_ddp, apply_fsdp, apply_replicate

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("other", "dp"))["dp"]
        cfg = GPTConfig(vocab_size=1024, seq_len=128, hidden=256, heads=4, layers=4)
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len),
                            generator=torch.Generator().manual_seed(rank))

        def median_step(fn) -> float:
            for _ in range(2):
                fn()
            spans = []
            for _ in range(steps):
                dist.barrier()
                t = torch.tensor([-time.perf_counter(), 0.0], dtype=torch.float64)
                fn()
                t[1] = time.perf_counter()
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                spans.append(float(t[0] + t[1]))
            return statistics.median(spans)

        def wrapped(name: str):
            torch.manual_seed(0)
            model = GPT(cfg)
            if name == "ddp":
                return apply_ddp(model, mesh)
            if name == "replicate":
                return apply_replicate(model, mesh)
            zero = int(name[-1])
            apply_fsdp(model, [(b, zero) for b in model.blocks], mesh, root_zero=zero)
            return model

        result = {}
        for name in WRAPPERS:
            model = wrapped(name)

            def step(sync: bool) -> None:
                loss = lambda: model(ids).float().logsumexp(-1).mean()  # noqa: E731
                if name == "ddp" and not sync:
                    with model.no_sync():
                        loss().backward()
                else:
                    if name != "ddp":
                        model.set_requires_gradient_sync(sync)
                    loss().backward()
                model.zero_grad(set_to_none=True)

            off, on = median_step(lambda: step(False)), median_step(lambda: step(True))
            result[name] = {"without_s": off, "with_s": on}
            del model
        grads = torch.randn(sum(p.numel() for p in GPT(cfg).parameters()))
        result["all_reduce_s"] = median_step(lambda: dist.all_reduce(grads, group=mesh.get_group()))
        result["grad_bytes"] = grads.numel() * 4
        if rank == 0:
            Path(outdir, "result.json").write_text(json.dumps(result))
    except BaseException as exc:   # reported by the parent, which names the rank
        Path(outdir, f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)   # gloo can abort in its static destructors at interpreter exit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel group size, dividing --nproc (default: --nproc)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per figure (default 5)")
    args = parser.parse_args(argv)
    dp = args.dp or args.nproc
    if args.nproc < 2 or dp < 2 or args.nproc % dp or args.steps < 1:
        parser.error(f"need --nproc >= 2, --dp >= 2 dividing it and --steps >= 1; got "
                     f"--nproc {args.nproc} --dp {dp} --steps {args.steps}")
    label = f"{args.nproc} processes, dp {dp}"
    try:
        r = _run_ranks(partial(_worker, dp=dp, steps=args.steps), args.nproc, label, TIMEOUT_S,
                       lambda out: json.loads((out / "result.json").read_text())
                       if (out / "result.json").exists() else None)
    except RuntimeError as exc:   # a rank's error report
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    if r is None:
        print(f"failed: no result (a process died or passed {TIMEOUT_S:.0f} s)", file=sys.stderr)
        return 1
    bare = r["all_reduce_s"]
    print(f"{args.nproc} processes, data-parallel groups of {dp}; gradients "
          f"{r['grad_bytes'] / 2**20:.1f} MiB fp32; bare all-reduce {bare * 1e3:.1f} ms (median)")
    print(f"{'wrapper':10s} {'step, no sync':>14s} {'with sync':>10s} {'reduction':>10s} "
          f"{'x all-reduce':>13s}")
    for name in WRAPPERS:
        off, on = r[name]["without_s"], r[name]["with_s"]
        print(f"{name:10s} {off * 1e3:11.1f} ms {on * 1e3:7.1f} ms {(on - off) * 1e3:7.1f} ms "
              f"{(on - off) / bare:12.2f}x")
    print("(ZeRO-1/2/3 without sync still gather; their 'reduction' is the reduce-scatter's "
          "share only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
