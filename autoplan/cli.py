"""The ``autoplan`` command line.

Every command that produces a result takes ``--json``; bad usage exits with
code 2 and a message naming the closest valid choices; tracebacks only with
``--debug``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Any, Callable, Sequence

from .errors import AutoplanError
from .strategy import Precision

__all__ = ["main"]

EXIT_USAGE = 2
#: Exit status after Ctrl-C (SIGINT), as shells report a process a signal ended: 128 + 2.
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse that suggests the closest subcommand / flag and exits with code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = ""
        if "invalid choice" in message and "'" in message:
            bad = message.split("'")[1]
            choices = [a for act in self._actions if isinstance(act, argparse._SubParsersAction)
                       for a in act.choices]
            near = difflib.get_close_matches(bad, choices, n=3)
            if near:
                hint = f" (did you mean: {', '.join(near)}?)"
        elif "unrecognized arguments" in message:
            flags = [o for act in self._actions for o in act.option_strings]
            for act in self._actions:   # the subcommands' flags too
                if isinstance(act, argparse._SubParsersAction):
                    flags += [o for p in act.choices.values() for a in p._actions for o in a.option_strings]
            bad = message.split(":", 1)[1].split()
            near = sorted({n for b in bad for n in difflib.get_close_matches(b.split("=")[0], flags, n=2)})
            if near:
                hint = f" (did you mean: {', '.join(near)}?)"
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{hint}\n")


def _add_model_args(p: argparse.ArgumentParser, *, seq: bool = True) -> None:
    p.add_argument("model", help="zoo:<name>, hf:<model_type>, gpt, or path/to/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field of the model (repeatable)")
    if seq:
        p.add_argument("--seq-len", type=int, default=None,
                       help="tokens per sequence (default: the zoo entry's)")


def _load_model(args: argparse.Namespace):
    from .zoo import build_model, parse_model_args
    model, default_seq = build_model(args.model, parse_model_args(args.model_arg))
    seq = getattr(args, "seq_len", None) or default_seq
    return model, seq


def _emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(payload, indent=1) + "\n")
    else:
        sys.stdout.write(text.rstrip("\n") + "\n")


# ------------------------------------------------------------------ commands
def _cmd_trace(args: argparse.Namespace) -> int:
    from .capture import trace
    from .records import atomic_write_text
    if args.micro_batch < 1:
        raise _UsageError(f"--micro-batch must be at least 1, got {args.micro_batch}")
    model, seq = _load_model(args)
    if seq is None:
        raise _UsageError(f"{args.model} needs --seq-len")
    from .zoo import model_title, parse_model_args
    graph = trace(model, seq_len=seq, micro_batch=args.micro_batch,
                  title=model_title(args.model, parse_model_args(args.model_arg)))
    if args.out:
        atomic_write_text(args.out, graph.to_json())
    table = graph.layer_table()
    text = (f"{graph.title or graph.model}: {graph.num_params / 1e9:.2f}B parameters, "
            f"{len(graph.blocks)} blocks, "
            f"captured with {graph.capture}, objective {graph.objective}\n"
            f"per micro-batch of {graph.micro_batch} x {graph.seq_len} tokens: "
            f"forward {graph.fwd_flops / 1e12:.2f} TFLOP, backward {graph.bwd_flops / 1e12:.2f} TFLOP, "
            f"saved activations {graph.saved_bytes / 2**30:.2f} GiB\n\n"
            + table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    _emit(args, graph.to_dict(), text)
    return 0


class _Step:
    """A progress line on stderr for a step that may take more than a second."""

    def __init__(self, what: str, quiet: bool = False) -> None:
        self.what, self.quiet = what, quiet

    def __enter__(self) -> "_Step":
        import time
        self.t0 = time.perf_counter()
        if not self.quiet:
            sys.stderr.write(f"  {self.what} ...")
            sys.stderr.flush()
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        import time
        if not self.quiet:
            status = ("interrupted" if exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
                      else "failed" if exc_type else f"{time.perf_counter() - self.t0:.1f} s")
            sys.stderr.write(f" {status}\n")
            sys.stderr.flush()


def _add_stack_arg(p: argparse.ArgumentParser) -> None:
    from .cost.constants import STACKS
    p.add_argument("--stack", default="autoplan", metavar="NAME",
                   help="the training software the layout runs on, which sets what overlaps "
                        f"and fuses: {', '.join(STACKS)} (default autoplan: what "
                        "autoplan.parallelize runs)")
    p.add_argument("--kernels", default="", metavar="NAME",
                   help="price the GPUs with measured kernel tables "
                        "(profiles/cost/kernels-NAME.yaml; torch-eager: torch's kernels "
                        "measured on one H100) instead of the published-run fit alone")


def _stack_options(args: argparse.Namespace, cluster=None):
    """The :class:`CostOptions` of ``--stack`` and ``--kernels`` (an unknown name: a
    one-line usage error; tables that no GPU of ``cluster`` takes: a one-line note)."""
    from .cost import CostOptions
    from .cost.kernels import load_kernel_tables
    from .errors import ConfigError
    kernels = getattr(args, "kernels", "")
    try:
        options = CostOptions(stack=getattr(args, "stack", "autoplan"))
    except ConfigError as exc:
        raise _UsageError(f"--stack: {exc}") from None
    if not kernels:
        return options
    try:
        tables = load_kernel_tables(kernels)
    except ConfigError as exc:
        raise _UsageError(f"--kernels: {exc}") from None
    if cluster is not None and not any(p.device.architecture in tables.architectures
                                       and not p.device.measured
                                       for p in cluster.profiles.values()):
        print(f"note: --kernels {kernels} measures {', '.join(sorted(tables.architectures))} "
              f"GPUs; {cluster.name} has none (or a measured profile), so it is priced as "
              "without it", file=sys.stderr)
    return CostOptions(stack=options.stack, kernel_tables=kernels)


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True,
                   help="a shipped profile name (autoplan.available_profiles()) or a YAML path")
    p.add_argument("--nodes", type=int, default=None, help="nodes of a single-node-kind profile")


def _load_cluster(args: argparse.Namespace):
    from .hardware import load_cluster
    return load_cluster(args.cluster, nodes=args.nodes)


def _trace_cached(args: argparse.Namespace, quiet: bool):
    from .capture import trace
    from .zoo import model_title, parse_model_args
    model, seq = _load_model(args)
    if seq is None:
        raise _UsageError(f"{args.model} needs --seq-len")
    title = model_title(args.model, parse_model_args(getattr(args, "model_arg", None)))
    with _Step(f"capturing {args.model} at seq_len {seq}", quiet):
        return trace(model, seq_len=seq, title=title)


class _UsageError(AutoplanError, ValueError):
    """Bad command-line usage found after parsing (exit code 2)."""


def _check_fraction(value: float) -> None:
    if not 0 < value <= 1:
        raise _UsageError(f"--memory-fraction must be in (0, 1], got {value} (default 0.9)")


def _work_limit() -> int:
    from .search.search import WORK_LIMIT
    return WORK_LIMIT


def _check_search_args(args: argparse.Namespace) -> None:
    """The search's numbers, checked before the (slow) capture."""
    if args.global_batch < 1:
        raise _UsageError(f"--global-batch must be a positive number of sequences per step, "
                          f"got {args.global_batch}")
    if args.top_k < 1:
        raise _UsageError(f"--top-k must be at least 1, got {args.top_k} (default 3)")
    _check_limit_args(args)
    _check_fraction(getattr(args, "memory_fraction", 0.9))


def _check_limit_args(args: argparse.Namespace) -> None:
    """``--time-limit`` and ``--work-limit``, where the command takes them."""
    time_limit = getattr(args, "time_limit", None)
    if time_limit is not None and not time_limit > 0:
        raise _UsageError(f"--time-limit must be positive seconds, got {time_limit} "
                          "(default: no wall-clock cap)")
    work_limit = getattr(args, "work_limit", 1)
    if work_limit is not None and work_limit < 1:
        raise _UsageError(f"--work-limit must be a positive number of search steps, got "
                          f"{work_limit} (default {_work_limit()})")


def _estimate_text(est) -> str:
    return est.report() if hasattr(est, "report") else str(est)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from .cost import estimate
    from .strategy import Strategy
    # names and batch arithmetic first: the capture takes seconds
    cluster = _load_cluster(args)
    strategy = Strategy(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, micro_batch=args.micro_batch,
                        global_batch=args.global_batch, zero=args.zero, recompute=args.recompute,
                        sequence_parallel=args.sequence_parallel, schedule=args.schedule,
                        virtual_stages=args.virtual_stages, precision=args.precision)
    strategy.check_world(cluster.num_devices)
    _check_fraction(args.memory_fraction)
    options = _stack_options(args, cluster)
    graph = _trace_cached(args, args.json)
    est = estimate(graph, cluster, strategy, memory_fraction=args.memory_fraction, options=options)
    text = f"{strategy.describe()} on {cluster.num_devices} devices of {cluster.name}\n" + \
        _estimate_text(est)
    _emit(args, {"strategy": strategy.to_dict(), "estimate": est.to_dict()}, text)
    return 0


def _build_estimate(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    _add_cluster_args(p)
    for name in ("dp", "tp", "pp", "cp", "ep", "micro-batch", "virtual-stages"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved", "zero_bubble"))
    p.add_argument("--precision", default="bf16", choices=PRECISIONS,
                   help="the mixed-precision recipe (default bf16; fp8, fp8-rowwise: linear "
                        "GEMMs in FP8 as torchao runs them, fp8-blockwise: Transformer "
                        "Engine's, with --stack megatron-core)")
    p.add_argument("--memory-fraction", type=float, default=0.9)
    _add_stack_arg(p)
    p.add_argument("--json", action="store_true")


def _plan_text(plan, cluster) -> str:
    lines = [plan.describe(), ""]
    if plan.estimate is not None:
        lines.append(plan.estimate.report())
    alts = getattr(plan, "runners_up", ())
    if alts:
        from .report import plan_differences
        lines += ["", "why it won: what the next best plans change, and what it costs"]
        for rank, p in enumerate(alts, start=2):
            diffs = plan_differences(plan, p) or ["the same layout (another device order)"]
            lines.append(f"  #{rank} {p.label()}")
            lines += [f"      {d}" for d in diffs]
    stats = getattr(plan, "search_stats", None)
    if stats is not None:
        limit = {"work": " - work limit reached (--work-limit gives more steps)",
                 "time": " - time limit reached (--time-limit: the plan depends on the "
                         "machine's load)"}
        lines += ["", f"searched {stats.evaluated} layouts ({stats.pruned} degree combinations pruned "
                      f"as dominated, {stats.refined} refined per stage) in {stats.steps} steps, "
                      f"{stats.seconds:.1f} s"
                      + (limit[stats.limit.value] if stats.limit is not None else "")]
    return "\n".join(lines)


def _is_sparse(args: argparse.Namespace) -> bool:
    """An embedding model for the sparse planner: a sparse zoo entry, or ``--sparse``."""
    from .zoo import SPARSE_ZOO
    return getattr(args, "sparse", False) or (
        args.model.startswith("zoo:") and args.model[4:] in SPARSE_ZOO)


def _sparse_graph(args: argparse.Namespace, quiet: bool):
    """The sparse capture of ``args.model`` (a file model defines ``example_inputs()``)."""
    from .sparse import trace_sparse
    from .zoo import build_model, parse_model_args
    if args.model.startswith("zoo:"):
        spec, inputs = args.model, None
    else:
        import importlib.util
        spec, _ = build_model(args.model, parse_model_args(args.model_arg))
        path = args.model.rpartition(":")[0]
        mod_spec = importlib.util.spec_from_file_location("_autoplan_user_inputs", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        if not callable(getattr(module, "example_inputs", None)):
            raise _UsageError(f"--sparse needs {path} to define example_inputs() returning one "
                              "batch of the model's inputs")
        inputs = module.example_inputs()
    with _Step(f"capturing {args.model}'s tables and dense part", quiet):
        return trace_sparse(spec, inputs)


def _servers(args: argparse.Namespace):
    from .errors import ConfigError
    from .sparse import ServerSpec
    try:
        return [ServerSpec.parse(s) for s in (getattr(args, "servers", None) or [])]
    except ConfigError as exc:
        raise _UsageError(f"--servers: {exc}") from None


def _cmd_plan_sparse(args: argparse.Namespace) -> int:
    """``autoplan plan`` of an embedding model: every table's placement (autoplan.sparse)."""
    from .cost import CostOptions
    from .records import atomic_write_text
    from .sparse import plan_sparse, plan_text
    cluster = _load_cluster(args)
    for srv in _servers(args):
        cluster = cluster.with_servers(srv.profile, srv.count) if srv.count else cluster
    _check_search_args(args)
    graph = _sparse_graph(args, args.json)
    with _Step(f"placing {len(graph.tables)} tables on {cluster.num_devices} devices"
               + (f" and {len(cluster.servers)} servers" if cluster.servers else ""), args.json):
        if len(args.precision) > 1:
            raise _UsageError("--precision: an embedding model's tables are placed for one "
                              "recipe; give one")
        best = plan_sparse(graph, cluster, global_batch=args.global_batch,
                           precision=args.precision[0],
                           options=CostOptions(memory_fraction=args.memory_fraction))
    if args.out:
        atomic_write_text(args.out, best.to_json())
    _emit(args, {"plan": best.to_dict()},
          plan_text(best, graph) + (f"\n\nplan written to {args.out}" if args.out else ""))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .records import atomic_write_text
    from .search import plan as make_plan
    if _is_sparse(args):
        return _cmd_plan_sparse(args)
    if getattr(args, "servers", None):
        raise _UsageError("--servers places embedding tables: use it with an embedding model "
                          "(a sparse zoo entry, or --sparse)")
    cluster = _load_cluster(args)           # names and numbers first: capture takes seconds
    _check_search_args(args)
    options = _stack_options(args, cluster)
    graph = _trace_cached(args, args.json)
    with _Step(f"searching layouts for {cluster.num_devices} devices of {cluster.name}", args.json):
        best = make_plan(graph, cluster, global_batch=args.global_batch, top_k=args.top_k,
                         memory_fraction=args.memory_fraction, time_limit_s=args.time_limit,
                         work_limit=args.work_limit,
                         precision=args.precision, options=options)
    if args.out:
        atomic_write_text(args.out, best.to_json())
    payload = {"plan": best.to_dict(),
               "runners_up": [p.to_dict() for p in getattr(best, "runners_up", ())]}
    text = _plan_text(best, cluster) + (f"\n\nplan written to {args.out}" if args.out else "")
    if args.explain:
        from .report import legend_text
        text += "\n\n" + legend_text()
    _emit(args, payload, text)
    return 0


def _build_plan(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    _add_cluster_args(p)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--top-k", type=int, default=3, help="plans to rank (default 3)")
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--work-limit", type=int, default=_work_limit(),
                   help="the search's budget in steps (bounds computed, layouts priced): "
                        "when it binds, the best plan so far, the same on any machine "
                        f"(default {_work_limit()})")
    p.add_argument("--time-limit", type=float, default=None,
                   help="a wall-clock cap on the search, seconds (default none: a plan it cuts "
                        "short depends on the machine's load)")
    p.add_argument("--precision", default=["bf16"], choices=PRECISIONS, nargs="+",
                   help="the mixed-precision recipe (default bf16), or several to search, e.g. "
                        "'bf16 fp8' (FP8 only when named: fp8, fp8-rowwise run by torchao, "
                        "fp8-blockwise Transformer Engine's with --stack megatron-core)")
    _add_stack_arg(p)
    p.add_argument("--out", help="write the best plan's JSON here")
    p.add_argument("--explain", action="store_true",
                   help="add a legend of the layout terms (dp, tp, mb, zero, rc-, ...)")
    _add_sparse_args(p)
    p.add_argument("--json", action="store_true")


def _add_sparse_args(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    p.add_argument("--sparse", action="store_true",
                   help="plan an embedding model's tables (autoplan.sparse; implied for the "
                        "zoo's dlrm-dcnv2, dlrm-criteo and two-tower); a file model then "
                        "defines example_inputs()")
    p.add_argument("--servers", nargs="+" if many else 1, metavar="PROFILE:COUNT",
                   help="CPU parameter servers beside the devices, e.g. cpu-server-2s-epyc:2"
                        + (" (several: one scenario each; COUNT 0 for none)" if many else ""))


#: ``--precision`` of estimate and plan: :class:`autoplan.strategy.Precision`'s recipes
PRECISIONS = tuple(p.value for p in Precision)

#: The demo's job: GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, hidden 12288, 96 heads,
#: tied embeddings; vocabulary 51200 as Narayanan et al. 2021) built as the package's own GPT,
#: so a plain install (no transformers) runs it, on the cluster of Narayanan et al. 2021.
DEMO = dict(model="gpt", title="GPT-3 175B", seq_len=2048, cluster="a100-sxm4-80gb", nodes=128,
            global_batch=1536,
            config=dict(vocab_size=51200, seq_len=2048, hidden=12288, heads=96, layers=96,
                        tie_embeddings=True))


def _cmd_demo(args: argparse.Namespace) -> int:
    from .capture import trace
    from .cost import estimate
    from .search import plan as make_plan
    from .strategy import Strategy
    from .zoo import build_model
    ns = argparse.Namespace(cluster=DEMO["cluster"], nodes=DEMO["nodes"])
    if not args.json:
        sys.stdout.write(
            f"autoplan demo: {DEMO['title']} (autoplan's own GPT at GPT-3's shape, built on the "
            f"meta device: nothing downloaded)\n"
            f"on {DEMO['nodes']} DGX A100 nodes (1024 GPUs, shipped profile {DEMO['cluster']}), "
            f"global batch {DEMO['global_batch']} x {DEMO['seq_len']} tokens\n\n")
        sys.stdout.flush()
    options = _stack_options(args)
    cluster = _load_cluster(ns)
    model, _ = build_model(DEMO["model"], DEMO["config"])
    with _Step(f"capturing {DEMO['title']} at seq_len {DEMO['seq_len']}", args.json):
        graph = trace(model, seq_len=DEMO["seq_len"], title=DEMO["title"])
    with _Step("searching layouts", args.json):
        best = make_plan(graph, cluster, global_batch=DEMO["global_batch"], top_k=5,
                         options=options)
    # the layout Megatron-LM's authors ran (Narayanan et al. 2021, Sec. 5.1 / Table 1 style)
    published = Strategy(dp=16, tp=8, pp=8, micro_batch=1, global_batch=DEMO["global_batch"],
                         recompute="full", schedule="interleaved", virtual_stages=2)
    ref = estimate(graph, cluster, published, memory_fraction=0.9, options=options)
    text = _plan_text(best, cluster) + (
        f"\n\nthe published Megatron-LM layout for this run ({published.describe()}), priced by the "
        f"same cost model:\n  {ref.summary()}\n  the plan is "
        f"{ref.step_time_s / best.estimate.step_time_s:.2f}x its speed")
    _emit(args, {"plan": best.to_dict(), "runners_up": [p.to_dict() for p in best.runners_up],
                 "published": {"strategy": published.to_dict(), "estimate": ref.to_dict()}}, text)
    return 0


def _build_demo(p: argparse.ArgumentParser) -> None:
    _add_stack_arg(p)
    p.add_argument("--json", action="store_true")


_MAKE_PLAN = "write one with: autoplan plan MODEL --cluster ... --global-batch N --out plan.json"


def _read_plan(path: str):
    from .errors import RecordError
    from .plan import Plan
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise _UsageError(f"cannot read plan file {path!r}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _UsageError(f"plan file {path!r} is not a plan JSON file (byte {exc.start} is not "
                          f"UTF-8 text); {_MAKE_PLAN}") from None
    try:
        return Plan.from_json(text)
    except RecordError as exc:
        raise _UsageError(f"plan file {path!r}: {exc}; {_MAKE_PLAN}") from None


def _check_plan_cluster(plan, cluster, args: argparse.Namespace) -> None:
    """Refuse a cluster other than the one ``plan`` was made for, naming the plan's."""
    from .errors import PlanMismatchError
    from .plan import ClusterSummary
    mine, given = plan.cluster, ClusterSummary.from_cluster(cluster)
    if (mine.name, mine.num_devices, tuple(mine.device_types)) == \
            (given.name, given.num_devices, tuple(given.device_types)):
        return
    nodes = f" --nodes {mine.num_nodes}" if _is_node_profile(mine.name) else ""
    raise PlanMismatchError(
        f"the plan {args.plan} was made for {mine.name} ({mine.num_devices} devices on "
        f"{mine.num_nodes} nodes), not {given.name} ({given.num_devices} devices on "
        f"{given.num_nodes} nodes); pass --cluster {mine.name}{nodes}, or plan again for "
        f"{given.name}")


def _is_node_profile(name: str) -> bool:
    """Whether ``name`` is a one-node-kind profile (it takes --nodes), not a composite one."""
    from .hardware import Profile, load_profile
    try:
        return isinstance(load_profile(name), Profile)
    except AutoplanError:
        return True


def _cmd_emit(args: argparse.Namespace) -> int:
    import os
    from .emit import emit_script, launch_commands
    from .records import atomic_write_text
    from .zoo import build_model, parse_model_args
    plan = _read_plan(args.plan)
    overrides = parse_model_args(args.model_arg)
    build_model(args.model, overrides)          # fail now, not on the cluster, for a bad spec
    name = os.path.basename(args.out)
    cluster = _load_cluster(args) if args.cluster else None   # emit_script checks it is the plan's
    elastic = dict(min_nodes=args.min_nodes, max_restarts=args.max_restarts)
    if plan.fingerprint is None:
        sys.stderr.write(f"note: {args.plan} comes from an older autoplan and records no model "
                         "fingerprint: only the model's class and layer names are checked against "
                         "it; plan again to record one\n")
    stack = plan.cost_options.get("stack", "autoplan")
    if stack != "autoplan":
        sys.stderr.write(f"note: {args.plan} was priced for the {stack} stack; the script runs "
                         "autoplan's own program (the autoplan stack), whose step time and memory "
                         "differ: plan without --stack to price what it runs\n")
    with _Step(f"checking {args.model} against the plan", args.json):
        text = emit_script(plan, args.model, overrides, name, cluster=cluster, **elastic)
    atomic_write_text(args.out, text)
    os.chmod(args.out, 0o755)
    cmds = launch_commands(plan, name, **elastic)
    _emit(args, {"script": args.out, "commands": cmds},
          f"wrote {args.out} for {plan.summary()}\n"
          + ("launch it on every node with this line"
             + ("" if args.min_nodes is not None or plan.cluster.num_nodes <= 1
                else f" (NODE_RANK=0..{plan.cluster.num_nodes - 1} on each node)") + ":\n")
          + "\n".join(f"  {c}" for c in cmds))
    return 0


def _build_emit(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a plan JSON file (autoplan plan ... --out plan.json)")
    p.add_argument("--model", required=True, help="the model spec the plan was made for")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="train.py", help="the script to write (default train.py)")
    p.add_argument("--cluster", default=None,
                   help="the cluster the plan was made for (profile name or YAML path), embedded "
                        "so the script can replan on restarts (default: the plan's profile)")
    p.add_argument("--nodes", type=int, default=None, help="nodes of a single-node-kind profile")
    p.add_argument("--min-nodes", type=int, default=None,
                   help="elastic launch: go on with at least this many nodes after failures")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts after a failure (resume from the last checkpoint)")
    p.add_argument("--json", action="store_true")


def _cmd_replan(args: argparse.Namespace) -> int:
    from .capture import trace
    from .records import atomic_write_text
    from .search.replan import plan_diff, replan
    from .zoo import build_model, model_title, parse_model_args
    old = _read_plan(args.plan)
    cluster = _load_cluster(args)
    _check_limit_args(args)
    if old.seq_len is None:
        raise _UsageError(f"the plan {args.plan} records no sequence length, so its model cannot "
                          f"be captured again; plan again ({_MAKE_PLAN})")
    overrides = parse_model_args(args.model_arg)
    model, _ = build_model(args.model, overrides)
    with _Step(f"capturing {args.model} at the plan's seq_len {old.seq_len}", args.json):
        graph = trace(model, seq_len=old.seq_len, title=model_title(args.model, overrides))
    old.check_model(graph)          # another model than the plan's: say what differs
    with _Step(f"replanning for {cluster.num_devices} devices of {cluster.name}", args.json):
        new = replan(old, cluster, graph=graph, time_limit_s=args.time_limit,
                     work_limit=args.work_limit)
    if args.out:
        atomic_write_text(args.out, new.to_json())
    changes = plan_diff(old, new)
    text = (_plan_text(new, cluster) + "\n\nwhat changed from " + args.plan + ":\n"
            + ("\n".join(f"  {line}" for line in changes.splitlines()) or "  nothing")
            + (f"\n\nplan written to {args.out}" if args.out else ""))
    _emit(args, {"plan": new.to_dict(), "changes": changes.splitlines()}, text)
    return 0


def _build_replan(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="the plan JSON the job ran with (autoplan plan ... --out plan.json)")
    p.add_argument("--model", required=True, help="the model spec the plan was made for")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    _add_cluster_args(p)
    p.add_argument("--work-limit", type=int, default=_work_limit(),
                   help=f"the search's budget in steps (default {_work_limit()})")
    p.add_argument("--time-limit", type=float, default=None,
                   help="a wall-clock cap on the search, seconds (default none)")
    p.add_argument("--out", help="write the new plan's JSON here")
    p.add_argument("--json", action="store_true")


def _price(text: str, item: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise _UsageError(f"--price takes a price per GPU-hour (a number >= 0) or TYPE=PRICE pairs, "
                          f"got {item!r}; e.g. --price 2.5 or --price A100-SXM4-80GB=2.5")
    return value


def _parse_price(items: list[str] | None):
    if not items:
        return None
    if len(items) == 1 and "=" not in items[0]:
        return _price(items[0], items[0])
    prices = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise _UsageError(f"--price takes one number or TYPE=PRICE pairs, got {item!r}")
        prices[key] = _price(value, item)
    return prices


def _whatif_clusters(args: argparse.Namespace) -> list:
    """Every (cluster, nodes) scenario of ``--cluster`` and ``--nodes``, checked (profile names,
    node counts) before the capture: node profiles take each ``--nodes`` value, composite
    ones (several kinds of node, sites) are whole and take none."""
    from .hardware import Profile, load_cluster, load_profile
    names = [n for item in args.cluster for n in item.split(",") if n]
    if not names:
        raise _UsageError("--cluster needs at least one profile name or YAML path")
    clusters = []
    for name in dict.fromkeys(names):
        if not isinstance(load_profile(name), Profile) and args.nodes:
            raise _UsageError(f"--nodes sets the node count of node profiles, but {name} is a "
                              "whole cluster (several kinds of node or sites): compare it in a "
                              "call without --nodes")
        clusters += [load_cluster(name, nodes=n) for n in dict.fromkeys(args.nodes or [None])]
    return clusters


def _cmd_whatif_sparse(args: argparse.Namespace) -> int:
    """``autoplan whatif`` of an embedding model: one row per cluster, servers and batch."""
    from .cost import CostOptions
    from .records import atomic_write_text
    from .sparse import Prices, sparse_whatif, whatif_text
    clusters = _whatif_clusters(args)
    servers = _servers(args) or [None]
    price = _parse_price(args.price)
    if isinstance(price, dict):
        if len(set(price.values())) != 1:
            raise _UsageError("an embedding model's what-if takes one --price per device-hour "
                              "(every device of its clusters rented at it)")
        price = next(iter(price.values()))
    prices = None
    if price is not None:
        prices = Prices(device_hour=price, server_hour=args.server_price or 0.0,
                        source="--price and --server-price")
    graph = _sparse_graph(args, args.json)
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    df = sparse_whatif(graph, clusters=clusters,
                       global_batch=args.global_batch, servers=servers, prices=prices,
                       progress=progress, options=CostOptions(memory_fraction=args.memory_fraction))
    if args.csv:
        atomic_write_text(args.csv, df.to_csv(index=False))
    sys.stdout.write((df.to_json(orient="records") if args.json else whatif_text(df)) + "\n")
    return 0


def _cmd_whatif(args: argparse.Namespace) -> int:
    from .errors import ConfigError
    from .records import atomic_write_text
    from .report import whatif
    from .zoo import build_model, model_title, parse_model_args
    if _is_sparse(args):
        return _cmd_whatif_sparse(args)
    # names and numbers first: building and capturing the model takes seconds
    clusters = _whatif_clusters(args)
    for flag, values in (("--global-batch", args.global_batch), ("--seq-len", args.seq_len or []),
                         ("--nodes", args.nodes or [])):
        bad = [v for v in values if v < 1]
        if bad:
            raise _UsageError(f"{flag} values must be positive, got {bad[0]}")
    if args.top_k < 1:
        raise _UsageError(f"--top-k must be at least 1, got {args.top_k} (default 1)")
    _check_fraction(args.memory_fraction)
    options = _stack_options(args)
    price = _parse_price(args.price)
    if isinstance(price, dict):          # a GPU type without a price: said now, not per row
        from .report import cluster_price_per_hour
        for cluster in clusters:
            try:
                cluster_price_per_hour(cluster, price)
            except ConfigError as exc:
                raise _UsageError(str(exc).replace("price_per_gpu_hour", "--price")
                                  + " (TYPE=PRICE), or give one price for every GPU") from None
    overrides = parse_model_args(args.model_arg)
    model, default_seq = build_model(args.model, overrides)
    seqs = args.seq_len or ([default_seq] if default_seq else None)
    if not seqs:
        raise _UsageError(f"{args.model} needs --seq-len")
    from .capture import trace
    title = model_title(args.model, overrides)
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    graphs = []
    for seq in seqs:
        with _Step(f"capturing {args.model} at seq_len {seq}", args.json):
            graphs.append(trace(model, seq_len=seq, title=title))
    import pandas as pd
    df = pd.concat([whatif(g, clusters=clusters, global_batch=args.global_batch,
                           price_per_gpu_hour=price, memory_fraction=args.memory_fraction,
                           top_k=args.top_k, progress=progress, options=options)
                    for g in graphs], ignore_index=True)
    if args.csv:
        atomic_write_text(args.csv, df.to_csv(index=False))
    if args.json:
        sys.stdout.write(df.to_json(orient="records") + "\n")
    else:
        from .report.whatif import whatif_text
        sys.stdout.write(whatif_text(df) + "\n")
    return 0


def _build_whatif(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="zoo:<name>, hf:<model_type>, gpt, or path/to/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cluster", required=True, nargs="+", action="extend", metavar="PROFILE",
                   help="profile names or YAML paths to compare, in one table (several values, "
                        "a comma-separated list, or the flag repeated)")
    p.add_argument("--nodes", type=int, nargs="+", help="node counts to compare, for each node "
                                                       "profile of --cluster")
    p.add_argument("--global-batch", type=int, nargs="+", required=True)
    p.add_argument("--seq-len", type=int, nargs="+")
    p.add_argument("--price", nargs="+", metavar="PRICE",
                   help="price per GPU-hour: one number for every GPU, or one per GPU type as "
                        "TYPE=PRICE pairs (device type or profile name: "
                        "a100-sxm4-80gb=1.8 h100-sxm5-80gb=3.0)")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--csv", help="also write the table as CSV")
    _add_stack_arg(p)
    _add_sparse_args(p, many=True)
    p.add_argument("--server-price", type=float, default=None,
                   help="price of one CPU server per hour (with --price, an embedding model)")
    p.add_argument("--json", action="store_true")


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import write_plan_report
    from .search import plan as make_plan
    cluster = _load_cluster(args)
    if args.out and not args.no_figures:       # before planning: the figures need matplotlib
        from ._optional import require
        from .errors import MissingDependencyError
        try:
            require("matplotlib", "the HTML report's figures")
        except MissingDependencyError as exc:
            raise MissingDependencyError(f"{exc}; or pass --no-figures",
                                         package=exc.package) from None
    if args.plan:
        best = _read_plan(args.plan)
        _check_plan_cluster(best, cluster, args)
        graph = None
    else:
        if not args.model:
            raise _UsageError("report needs a MODEL (to plan) or --plan PLAN.json")
        if args.global_batch is None:
            raise _UsageError("report MODEL needs --global-batch")
        _check_search_args(args)
        options = _stack_options(args)
        graph = _trace_cached(args, args.json)
        with _Step("searching layouts", args.json):
            best = make_plan(graph, cluster, global_batch=args.global_batch, top_k=args.top_k,
                             options=options)
    if args.out:
        write_plan_report(best, args.out, cluster=cluster, graph=graph, figures=not args.no_figures)
    _emit(args, {"plan": best.to_dict(), "html": args.out},
          best.report() + (f"\n\nHTML report written to {args.out}" if args.out else ""))
    return 0


def _build_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="model spec to plan (or give --plan)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--plan", help="report on this plan JSON instead of planning")
    _add_cluster_args(p)
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--out", help="write a self-contained HTML report here")
    p.add_argument("--no-figures", action="store_true", help="HTML without figures")
    _add_stack_arg(p)
    p.add_argument("--json", action="store_true")


def _cmd_profile(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from . import profiling
    return int(profiling.main(list(rest)))


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {}


def _register(name: str, help_: str, build: Callable[[argparse.ArgumentParser], None],
              run: Callable) -> None:
    COMMANDS[name] = (help_, build, run)


def _build_trace(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--out", help="write the graph JSON to this file")
    p.add_argument("--json", action="store_true", help="print the graph as JSON")


_register("demo", "plan GPT-3 175B on 1024 A100 GPUs and explain the choice (offline, "
                  "10-20 s on 2 cores)",
          _build_demo, _cmd_demo)
_register("trace", "capture a model as a costed layer graph", _build_trace, _cmd_trace)
_register("estimate", "predict step time and memory of one layout", _build_estimate, _cmd_estimate)
_register("plan", "search the fastest layout that fits", _build_plan, _cmd_plan)
_register("replan", "a new plan for the devices that are left (or added), from the old one",
          _build_replan, _cmd_replan)
_register("emit", "write a torchrun training script for a plan", _build_emit, _cmd_emit)
_register("report", "a plan's report as text and self-contained HTML", _build_report, _cmd_report)
_register("whatif", "compare clusters, GPU types, batches and prices in one table",
          _build_whatif, _cmd_whatif)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autoplan", description="Automatic parallelism planner for PyTorch training")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("profile", help="measure this machine and write a hardware profile "
                                   "(see autoplan profile --help)", add_help=False)
    for name, (help_, build, _) in COMMANDS.items():
        build(sub.add_parser(name, help=help_))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    parser = build_parser()
    if argv and argv[0] == "profile":
        runner: Callable[[], int] = lambda: _cmd_profile(args, argv[1:])  # noqa: E731
        args = argparse.Namespace(command="profile")
    else:
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        runner = lambda: COMMANDS[args.command][2](args)  # noqa: E731
    try:
        return runner()
    except AutoplanError as exc:
        if debug:
            raise
        sys.stderr.write(f"autoplan {args.command}: error: {exc}\n")
        return EXIT_USAGE if isinstance(exc, (ValueError, KeyError)) else 1
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stderr.write(f"autoplan {args.command}: interrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
