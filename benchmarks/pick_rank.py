"""Does the search pick the fastest layout?  The pick's rank among measured layouts.

A small GPT (``CONFIG``) and a small Llama (Hugging Face ``LlamaForCausalLM``, same sizes,
4 query and 2 key/value heads, random init) on ``WORLD`` CPU processes (gloo), global batch
``BATCH``, fp32:

1. profile this machine (``autoplan profile --quick --nproc 4 --device cpu``), or load the
   4-rank profile given with ``--profile``;
2. ``autoplan.plan(..., top_k=100000, precision="fp32", options=GLOO_ON_CPU)`` ranks the
   layouts; :func:`select_layouts` takes the pick, the next ``RUNNERS_UP`` of its ranked
   list, the best-ranked layout of every other degree combination (dp, tp, pp, cp), and the
   pick with ZeRO-3 and with full recompute (``LADDER``: options the search reaches only
   when memory is short, which it never is here), each priced by the same engine;
3. each layout runs in its own launch of ``WORLD`` fresh processes (as a user's job runs;
   ``WARMUP`` warm-up then ``TIMED`` timed steps), over ``ROUNDS`` rounds in alternating
   order; its measured step is its fastest (other jobs on a shared machine only add time);
   a layout :func:`autoplan.parallelize` rejects, or that fails or passes
   ``LAYOUT_TIMEOUT_S``, is reported with its reason;
4. per model: the pick's rank among the measured layouts, its step over the fastest
   measured one's (target <= ``TARGET``) and Spearman's rank correlation of predicted vs
   measured step time.

It judges the ranking, not the seconds: on a shared 2-core VM one layout's step moves
5-15% between passes, so absolute CPU step times measure the machine more than the
planner (``benchmarks/HISTORY.md``, 2026-11-29).  GPU step time: ``benchmarks/gpu_truth.py``.

    python benchmarks/pick_rank.py                               # profile, plan, run (~15 min)
    python benchmarks/pick_rank.py --profile p4.yaml --no-run    # selection and prices only
    python benchmarks/pick_rank.py --profile p4.yaml --models gpt --layouts 5 --rounds 1

``p4.yaml``: ``autoplan profile --quick --nproc 4 --device cpu --out p4.yaml``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import GLOO_ON_CPU, _run_ranks, end_rank, error_chain, init_rank  # noqa: E402

from autoplan.models import GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=1024, seq_len=128, hidden=256, heads=4, layers=4)
MODELS = ("gpt", "llama")
WORLD = 4
BATCH = 8
#: The picked plan should measure within this factor of the fastest measured layout.
TARGET = 1.05
#: Layouts of the search's ranked list taken right after the pick.
RUNNERS_UP = 3
#: ``(ZeRO stage, recompute)`` at the pick's degrees, added beside the search's list
#: (``None``: the pick's own): the memory ladder's options above its first rung.
LADDER = ((3, None), (None, "full"))
WARMUP, TIMED, ROUNDS = 2, 3, 2
#: A layout's launch (fork, lay out, warm-up and timed steps) is killed after this long.
LAYOUT_TIMEOUT_S = 180.0
#: Modules the launcher's fork server imports once, so that a launch of 4 ranks costs
#: forks (~1 s) rather than 4 interpreters importing torch on 2 cores.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "autoplan.runtime", "transformers",
           "transformers.models.llama.modeling_llama"]


def build_model(name: str):
    """One of ``MODELS``, freshly initialised with seed 0 (the same on every rank)."""
    import torch
    torch.manual_seed(0)
    if name == "gpt":
        from autoplan.models import GPT
        return GPT(CONFIG)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.hidden,
                          intermediate_size=688, num_hidden_layers=CONFIG.layers,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=CONFIG.seq_len)
        cfg._attn_implementation = "eager"
        return LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def profile_machine(out: Path) -> Path:
    """``autoplan profile --quick`` of ``WORLD`` CPU ranks, written to ``out``."""
    from autoplan.cli import main as autoplan_main
    status = autoplan_main(["profile", "--quick", "--nproc", str(WORLD), "--device", "cpu",
                            "--out", str(out), "--name", f"pick-rank-{WORLD}"])
    if status != 0:
        raise SystemExit(f"profiling failed (exit {status})")
    return out


# ----------------------------------------------------------------------------- selection


def layout_key(plan) -> tuple[int, int, int, int]:
    """A plan's degrees: (dp, tp, pp, cp)."""
    return (plan.dp, plan.mesh.degree("tp"), plan.pp, plan.mesh.degree("cp"))


def with_options(plan, zero: int | None, recompute: str | None):
    """``plan`` with every layer at ZeRO stage ``zero`` and every block at ``recompute``
    (``None``: as in ``plan``; embeddings and head never recompute), unpriced."""
    from autoplan.graph import LayerKind
    from autoplan.strategy import Recompute
    kinds = {layer.name: layer.kind for layer in plan.graph.layers}
    layers = tuple(replace(lp, zero=lp.zero if zero is None else zero,
                           recompute=(lp.recompute if recompute is None
                                      else Recompute(recompute) if kinds[lp.name] is LayerKind.BLOCK
                                      else Recompute.NONE))
                   for lp in plan.layers)
    return replace(plan, layers=layers, estimate=None, runners_up=())


def select_layouts(graph, cluster, *, runners_up: int = RUNNERS_UP) -> list[dict]:
    """The layouts to run, the pick first: rows ``source`` (``pick``, ``runner-up``,
    ``degrees``: another degree combination's best, ``ladder``), ``plan`` (priced),
    ``search_rank`` (``None`` for the ladder), ``label`` (unique), ``predicted_s`` and
    ``predicted_rank`` (1 = predicted fastest among the rows)."""
    from autoplan import plan as search_plan
    from autoplan.cost import estimate_plan
    from autoplan.errors import AutoplanError
    # every layout runs on the WORLD ranks launched: none may leave a rank idle
    picked = search_plan(graph, cluster, global_batch=BATCH, top_k=100_000, precision="fp32",
                         options=GLOO_ON_CPU, use_all_devices=True)
    if picked.search_stats.time_limit_hit:
        print("warning: the search hit its time limit; its ranked list may be incomplete")
    ranked = [picked, *picked.runners_up]
    rows = [{"source": "pick", "plan": picked, "search_rank": 1}]
    rows += [{"source": "runner-up", "plan": p, "search_rank": i + 2}
             for i, p in enumerate(ranked[1:1 + runners_up])]
    seen = {layout_key(p) for p in ranked[:1 + runners_up]}
    for i, p in enumerate(ranked):
        if layout_key(p) not in seen:
            seen.add(layout_key(p))
            rows.append({"source": "degrees", "plan": p, "search_rank": i + 1})
    for zero, recompute in LADDER:
        try:
            p = with_options(picked, zero, recompute)
            p = p.with_estimate(estimate_plan(graph, cluster, p, options=GLOO_ON_CPU))
        except AutoplanError as exc:   # e.g. what a zero-bubble schedule cannot run
            print(f"ladder: {picked.label()} with ZeRO {zero}, recompute {recompute}: not "
                  f"priced ({type(exc).__name__}: {exc})")
            continue
        rows.append({"source": "ladder", "plan": p, "search_rank": None})
    out, have = [], set()
    for r in rows:
        p = r["plan"]
        if (p.label(), p.describe()) in have:
            continue
        have.add((p.label(), p.describe()))
        label = p.label()
        if any(o["label"] == label for o in out):  # the same options, other blocks per stage
            label += " [" + "/".join(str(len(st.layers)) for st in p.stages) + " layers]"
        out.append({**r, "label": label, "predicted_s": p.estimate.step_time_s})
    for i, r in enumerate(sorted(out, key=lambda r: r["predicted_s"])):
        r["predicted_rank"] = i + 1
    return out


# ----------------------------------------------------------------------------- verdict


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged);
    NaN where either side is constant."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def verdict(rows: list[dict]) -> dict | None:
    """Over the rows with a ``measured_s``: each one's ``measured_rank`` (set on the rows),
    and ``pick_rank`` (1 + how many measured faster than the pick), ``measured`` (how many),
    ``ratio`` (the pick's step over the fastest's), ``fastest`` (its label), ``rho``
    (Spearman of predicted vs measured; NaN under 3 layouts) and ``ok`` (``ratio <=
    TARGET``).  ``None`` where the pick was not measured."""
    measured = [r for r in rows if r.get("measured_s")]
    for rank, r in enumerate(sorted(measured, key=lambda r: r["measured_s"])):
        r["measured_rank"] = rank + 1
    pick = next(r for r in rows if r["source"] == "pick")
    if not pick.get("measured_s"):
        return None
    fastest = min(measured, key=lambda r: r["measured_s"])
    ratio = pick["measured_s"] / fastest["measured_s"]
    rho = (spearman([r["predicted_s"] for r in measured], [r["measured_s"] for r in measured])
           if len(measured) >= 3 else float("nan"))
    return {"pick_rank": 1 + sum(r["measured_s"] < pick["measured_s"] for r in measured),
            "measured": len(measured), "ratio": ratio, "fastest": fastest["label"],
            "rho": rho, "ok": ratio <= TARGET}


# ----------------------------------------------------------------------------- runs


def _time_steps(pm, ids, warmup: int, timed: int) -> list[float]:
    """Wall time of ``timed`` training steps after ``warmup`` ones, each between barriers
    (the step of the slowest rank)."""
    import torch.distributed as dist
    times = []
    for i in range(warmup + timed):
        dist.barrier()
        t0 = time.perf_counter()
        pm.step(ids)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _layout_worker(rank: int, world: int, port: int, outdir: str, model_name: str, graph,
                   plan_json: str) -> None:
    """One rank of a launch: lay the model out by the plan, warm-up and timed steps; rank 0
    writes ``times.json``, or ``skip.txt`` where parallelize rejects the plan (before any
    collective, on every rank alike).  ``graph``: the parent's capture of the model."""
    torch = init_rank(rank, world, port, timeout_s=LAYOUT_TIMEOUT_S)
    status = 0
    try:
        from autoplan.errors import ConfigError, PlanMismatchError, StrategyError
        from autoplan.plan import Plan
        from autoplan.runtime import parallelize
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=gen)
        try:
            pm = parallelize(build_model(model_name), Plan.from_json(plan_json),
                             global_batch=BATCH, seq_len=CONFIG.seq_len, graph=graph)
        except (ConfigError, StrategyError, PlanMismatchError) as exc:
            if rank == 0:
                Path(outdir, "skip.txt").write_text(f"{type(exc).__name__}: {exc}")
        else:
            times = _time_steps(pm, ids, WARMUP, TIMED)
            if rank == 0:
                Path(outdir, "times.json").write_text(json.dumps(times))
    except BaseException as exc:  # report, then still tear down
        Path(outdir, f"error{rank}.txt").write_text(error_chain(exc))
        status = 1
    end_rank(status)


def _read_launch(out: Path) -> list[float] | str:
    skip = out / "skip.txt"
    if skip.exists():
        return "not runnable: " + skip.read_text()
    return json.loads((out / "times.json").read_text())


def measure(model_name: str, graph, rows: list[dict], rounds: int) -> None:
    """Run every row's plan ``rounds`` times (alternating the order), each in a fresh
    launch; set ``measured_s`` (the fastest step of all) or ``status`` (why not)."""
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    graph = replace(graph, fx_graph=None)   # what parallelize keeps of a capture
    for k in range(rounds):
        for r in rows if k % 2 == 0 else rows[::-1]:
            if r.get("status"):
                continue
            try:
                got = _run_ranks(_layout_worker, WORLD, (model_name, graph, r["plan"].to_json()),
                                 LAYOUT_TIMEOUT_S, _read_launch, ctx=ctx)
            except RuntimeError as exc:
                got = f"failed: {exc}"
            if isinstance(got, str):
                r["status"] = got
                r.pop("measured_s", None)
            else:
                r["measured_s"] = min([*got, r.get("measured_s", math.inf)])
            print(f"  round {k + 1}: {r['label']}: "
                  + (r["status"][:120] if r.get("status") else f"{min(got):.3f} s"), flush=True)


def _print(rows: list[dict], run: bool) -> None:
    def fmt(v, spec):
        width = int(spec.split(".")[0].rstrip("d"))
        return f"{'-':>{width}}" if v is None else format(v, spec)

    v = verdict(rows) if run else None   # sets the rows' measured_rank
    print(f"\n{'layout':<46} {'source':<9} {'search':>6} {'pred s':>7} {'p.rank':>6} "
          f"{'meas s':>7} {'m.rank':>6}  status")
    for r in sorted(rows, key=lambda r: (r.get("measured_rank") or 10**6, r["predicted_rank"])):
        print(f"{r['label']:<46} {r['source']:<9} {fmt(r['search_rank'], '6d')} "
              f"{r['predicted_s']:7.3f} {r['predicted_rank']:6d} "
              f"{fmt(r.get('measured_s'), '7.3f')} "
              f"{fmt(r.get('measured_rank'), '6d')}  {(r.get('status') or '')[:100]}")
    pick = rows[0]
    if not run:
        print(f"picked: {pick['label']}, predicted {pick['predicted_s']:.3f} s "
              "(real runs skipped: --no-run)")
        return
    if v is None:
        print(f"picked: {pick['label']} was not measured ({pick.get('status') or 'no run'})")
        return
    print(f"picked: {pick['label']}, measured rank {v['pick_rank']} of {v['measured']}; "
          f"fastest measured {v['fastest']}; picked/fastest {v['ratio']:.3f} "
          f"(target <= {TARGET}): {'ok' if v['ok'] else 'missed'}")
    print(f"Spearman rank correlation, predicted vs measured, {v['measured']} layouts: "
          f"{v['rho']:+.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=None,
                    help=f"a {WORLD}-rank CPU profile to price with (default: profile this "
                         "machine first, ~2 min)")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--no-run", action="store_true", help="print the selection and prices only")
    ap.add_argument("--layouts", type=int, default=None, metavar="N",
                    help="run at most N layouts a model, the pick first (default: every one "
                         "selected)")
    ap.add_argument("--runners-up", type=int, default=RUNNERS_UP, metavar="N",
                    help=f"layouts taken after the pick from the search's list (default "
                         f"{RUNNERS_UP})")
    ap.add_argument("--rounds", type=int, default=ROUNDS, metavar="N",
                    help=f"launches of each layout; its fastest step counts (default {ROUNDS})")
    args = ap.parse_args(argv)
    for flag, value, least in (("--layouts", args.layouts, 1), ("--runners-up", args.runners_up, 0),
                               ("--rounds", args.rounds, 1)):
        if value is not None and value < least:
            ap.error(f"{flag} must be at least {least}, got {value}")

    from autoplan import trace
    from autoplan.errors import AutoplanError
    from autoplan.hardware import load_cluster
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cluster = load_cluster(str(args.profile or profile_machine(Path(tmp) / "p4.yaml")))
    except AutoplanError as exc:
        ap.error(f"--profile {args.profile}: {exc}" if args.profile else str(exc))
    if cluster.num_devices != WORLD:
        ap.error(f"the profile has {cluster.num_devices} devices; this benchmark runs {WORLD} "
                 f"ranks (autoplan profile --nproc {WORLD} --device cpu)")
    for name in args.models:
        graph = trace(build_model(name), seq_len=CONFIG.seq_len)
        rows = select_layouts(graph, cluster, runners_up=args.runners_up)
        counts = {s: sum(r["source"] == s for r in rows)
                  for s in ("runner-up", "degrees", "ladder")}
        print(f"\n=== {name}: {graph.num_params / 1e6:.2f} M parameters, {CONFIG.layers} blocks, "
              f"seq {CONFIG.seq_len}; global batch {BATCH}, fp32, {WORLD} processes; "
              f"{len(rows)} layouts: the pick, {counts['runner-up']} runners-up, the best of "
              f"{counts['degrees']} other degree combinations, {counts['ladder']} ladder options")
        if args.layouts is not None and len(rows) > args.layouts:
            print(f"running the first {args.layouts} (--layouts)")
            rows = rows[:args.layouts]
            for i, r in enumerate(sorted(rows, key=lambda r: r["predicted_s"])):
                r["predicted_rank"] = i + 1
        if not args.no_run:
            measure(name, graph, rows, args.rounds)
        _print(rows, not args.no_run)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
