"""Worker bodies of the runtime's multi-process tests (run by tests/dist_harness.py).

Each worker builds a tiny model from a fixed seed, computes the single-process
reference (the whole global batch, plain AdamW) once, then runs several layouts
one after another in the same process group, comparing the loss after every
step and every parameter after steps 1 and 3 with the reference.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from autoplan.runtime.loss import token_cross_entropy

#: fp32 parity tolerance (absolute) for losses and parameters, from the issue;
#: measured errors are ~1e-7 (see the notes), so this leaves two orders of margin.
ATOL = 1e-5
VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 8


def make_optimizer(params):
    """AdamW with eps=1e-5 (torch's default is 1e-8), as ``parallelize`` builds it by
    default (:func:`autoplan.runtime.optim.default_optimizer`: fused, one parameter
    group per kind of tensor); the reference's single group is plain tensors.

    Adam's update is ``lr * m / (sqrt(v) + eps)``; its first one is about
    ``lr * g / (|g| + eps)``.  For a gradient entry near ``eps`` that turns fp32
    rounding noise in ``g`` (summation orders differ between layouts) into a
    parameter difference up to ``lr * noise / (4 eps)``: measured 8.7e-6 (one
    entry, tiny Llama, TP) at eps=1e-8 and up to 2.8e-6 (tied GPT, PP x TP) at
    eps=1e-6, against a tolerance of 1e-5.  At eps=1e-5 that amplification is
    10x smaller again, still far below the typical gradient entry (1e-4-1e-2),
    and any real gradient error (a missing reduction, a wrong scale) still moves
    parameters by ~lr = 1e-3, 100x the tolerance.
    """
    from autoplan.runtime.optim import default_optimizer
    return default_optimizer(params, lr=1e-3, eps=1e-5)


# ---------------------------------------------------------------------- models and data
def make_gpt(seed: int = 0, layers: int = 4, attention: str = "eager", tie: bool = False):
    from autoplan.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=layers,
                         attention=attention, tie_embeddings=tie))


def make_llama(seed: int = 0, layers: int = 4, tie: bool = False):
    """A tiny Llama with grouped-query attention (4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=tie)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def _llama_sdpa(seed: int = 0):
    model = make_llama(seed)
    model.config._attn_implementation = "sdpa"
    return model


#: Tiny mixture-of-experts decoders: 8 experts, top-2 routing, 2 blocks, every block MoE.
#: ``qwen2moe`` adds a shared expert (dense, gated) beside the routed ones.
MOE_EXPERTS, MOE_TOP_K = 8, 2


def make_moe(family: str, seed: int = 0, layers: int = 2):
    """A tiny Hugging Face MoE model of ``family`` (mixtral, qwen3moe, qwen2moe), random init."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  num_experts_per_tok=MOE_TOP_K)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=64, num_local_experts=MOE_EXPERTS,
                                         **common)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen3moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                          num_experts=MOE_EXPERTS, head_dim=8, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48,
                                          num_experts=MOE_EXPERTS, **common)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        raise ValueError(f"unknown MoE family {family!r}")
    cfg._attn_implementation = "eager"
    return cls(cfg)


MODELS: dict[str, Callable] = {
    "gpt": make_gpt,
    "llama": make_llama,
    # input embedding and output head share one weight
    "gpt-tied": lambda seed=0: make_gpt(seed, tie=True),
    "llama-tied": lambda seed=0: make_llama(seed, tie=True),
    # 8 blocks: pp=2 with 4 chunks per rank (interleaved v=4) needs a block per chunk
    "gpt-8": lambda seed=0: make_gpt(seed, layers=8),
    "llama-8": lambda seed=0: make_llama(seed, layers=8),
    # fused (SDPA) attention instead of eager
    "gpt-sdpa": lambda seed=0: make_gpt(seed, attention="sdpa"),
    "llama-sdpa": _llama_sdpa,
    "mixtral": lambda seed=0: make_moe("mixtral", seed),
    "qwen3moe": lambda seed=0: make_moe("qwen3moe", seed),
    "qwen2moe": lambda seed=0: make_moe("qwen2moe", seed),
    # 4 blocks: pp=2 under ZBV needs a block per virtual stage
    "mixtral-4": lambda seed=0: make_moe("mixtral", seed, layers=4),
}


def make_batch(seed: int = 1234, global_batch: int | None = None, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (global_batch or GLOBAL_BATCH, seq), generator=g)


def _logits(model, ids):
    out = model(input_ids=ids, use_cache=False) if hasattr(model, "can_generate") else model(ids)
    return out.logits if hasattr(out, "logits") else out


def reference(model_name: str, steps: int = 3, seed: int = 0, *, bf16: bool = False,
              rows: slice | None = None) -> dict[str, Any]:
    """Single-process training on the whole global batch: losses and parameters per step.

    ``bf16``: the program the runtime runs at ``precision="bf16"`` (autoplan.precision),
    written out by hand: each step copies the fp32 master weights into a bf16 copy of the
    model (parameters only; buffers keep their dtype, as FSDP2's policy leaves them), runs
    forward and backward on it, and steps the fp32 weights with the gradients cast to
    fp32.  ``rows``: train on these rows of the batch only (what a replica that skipped
    the gradient reduction would learn).
    """
    model = MODELS[model_name](seed)
    opt = make_optimizer(model.parameters())
    ids = make_batch() if rows is None else make_batch()[rows]
    compute = None
    if bf16:
        import copy

        compute = copy.deepcopy(model)
        for p in compute.parameters():
            p.data = p.data.to(torch.bfloat16)
    losses, params = [], {}
    for step in range(1, steps + 1):
        if compute is None:
            loss = token_cross_entropy(_logits(model, ids), ids, shift=True)
            loss.backward()
        else:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), model.parameters()):
                    c.copy_(m)
            loss = token_cross_entropy(_logits(compute, ids), ids, shift=True)
            loss.backward()
            for c, m in zip(compute.parameters(), model.parameters()):
                m.grad, c.grad = c.grad.float(), None
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        params[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params}


# ---------------------------------------------------------------------- parity
def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def graph_json(model_name: str) -> str:
    """The capture of a test model as JSON (what workers get instead of tracing again)."""
    from autoplan import trace

    return trace(MODELS[model_name](0), seq_len=SEQ).to_json()


def _graph(graph: str | None):
    from autoplan.graph import ModelGraph

    return ModelGraph.from_json(graph) if graph else None


def parity(rank: int, world: int, model_name: str, targets: list[tuple],
           steps: int = 3, check_steps: tuple[int, ...] = (1, 3),
           graph: str | dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """Run every ``(label, target)`` for ``steps`` steps against the reference.

    A target may name another model as a third item, ``(label, target, model)``;
    ``graph`` is one capture (JSON) or a dict of them by model name (a model
    without one is traced by the workers).  Returns, per label, the max abs
    loss and parameter error and the seconds taken.  Raises AssertionError
    naming the layout and the worst tensor when anything is off by more than ATOL.
    """
    from autoplan.runtime import parallelize

    refs: dict[str, dict] = {}
    ids = make_batch()
    graphs = graph if isinstance(graph, dict) else {model_name: graph}
    out: dict[str, dict[str, float]] = {}
    for label, target, *which in targets:
        name = which[0] if which else model_name
        if name not in refs:
            refs[name] = reference(name, steps)
        ref = refs[name]
        g = _graph(graphs.get(name))
        t0 = time.perf_counter()
        model = MODELS[name](0)
        pm = parallelize(model, target, seq_len=SEQ, optimizer=make_optimizer, graph=g)
        if pm.plan.ep > 1 and not expert_split(pm):
            raise AssertionError(f"{label}: ep={pm.plan.ep} but no expert-parallel module")
        if pm.plan.pp > 1 and pm.plan.schedule.value == "zero_bubble":
            unsafe = zero_bubble_safety(pm)
            if unsafe:
                raise AssertionError(f"{label}: unsafe under a zero-bubble schedule: {unsafe}")
        # a plan that leaves processes idle: the first active one holds the full state dict
        # (every process gets each step's loss), and finish() below rejoins the world
        idle = getattr(target, "idle_devices", ())
        checker = min(target.mesh.devices) if idle else 0
        loss_err, param_err, worst = 0.0, 0.0, ""
        for step in range(1, steps + 1):
            loss = pm.step(ids)
            loss_err = max(loss_err, abs(loss - ref["losses"][step - 1]))
            if step in check_steps:
                sd = pm.full_state_dict()
                if rank == checker:
                    expected = ref["params"][step]
                    if set(sd) != set(expected):
                        raise AssertionError(f"{label}: state dict keys differ: missing "
                                             f"{sorted(set(expected) - set(sd))[:5]}, extra "
                                             f"{sorted(set(sd) - set(expected))[:5]}")
                    for k, v in expected.items():
                        e = _max_err(sd[k], v)
                        if e > param_err:
                            param_err, worst = e, f"{k} after step {step}"
        if loss_err > ATOL:
            raise AssertionError(f"{label} ({pm.plan.label()}): loss differs from the "
                                 f"single-process reference by {loss_err:.3g} > {ATOL}")
        if param_err > ATOL:
            raise AssertionError(f"{label} ({pm.plan.label()}): parameter {worst} differs "
                                 f"by {param_err:.3g} > {ATOL}")
        out[label] = {"loss_err": loss_err, "param_err": param_err,
                      "seconds": time.perf_counter() - t0}
        pm.finish()      # the next target runs over every process again
        del pm, model
    return out


def repeated_parallelize(rank: int, world: int, targets: list[tuple]) -> list[tuple]:
    """:func:`parity` of ``targets`` three times in this process, then once more after every
    process group but the world's is destroyed (the first call after builds them again).
    Returns ``(live process groups, OS threads)`` after each of the four rounds."""
    import gc

    from torch.distributed import distributed_c10d as c10d

    def counts() -> tuple[int, int]:
        gc.collect()
        return len(c10d._world.pg_map), len(os.listdir("/proc/self/task"))

    out = []
    for _ in range(3):
        parity(rank, world, "gpt", targets, steps=2, check_steps=(2,))
        out.append(counts())
    for pg in list(c10d._world.pg_map):
        if pg is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(pg)
    parity(rank, world, "gpt", targets, steps=2, check_steps=(2,))
    out.append(counts())
    return out


def view_warnings(rank: int, world: int, strategy, custom_loss: bool) -> tuple[int, str, bool]:
    """One step of ``strategy`` on the GPT: FSDP2's "returned a view tensor" warnings, the
    class of the wrapped model, and whether ``parallelize`` kept the CPU heap
    (:mod:`autoplan.runtime.cpu_heap`).  Under tensor parallelism the logits are a view (the head's
    output DTensor's local tensor).  ``custom_loss``: a ``loss_fn`` of the user's (the
    built-in loss, wrapped)."""
    import importlib
    import warnings

    module = importlib.import_module("autoplan.runtime.parallelize")
    kw = {"loss_fn": lambda out, y: module._next_token_loss(out, y)} if custom_loss else {}
    pm = module.parallelize(MODELS["gpt"](0), strategy, seq_len=SEQ, optimizer=make_optimizer,
                            **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.step(make_batch())
    heap = importlib.import_module("autoplan.runtime.cpu_heap")
    return (sum("returned a view" in str(w.message) for w in caught), type(pm.parts[0]).__name__,
            heap._applied is True or heap._glibc() is None)


def sp_grad_reductions(rank: int, world: int, model_name: str, strategy) -> dict[str, int]:
    """One step of ``strategy`` (sequence parallel, no FSDP2) on ``model_name``: how many
    one-dimensional gradients ``reduce_partial_grads`` reduced together, and how many
    all-reduces DTensor itself issued on one-dimensional tensors during the step (the
    per-tensor reductions an optimizer would otherwise make)."""
    import importlib

    import torch.distributed._functional_collectives as funcol

    module = importlib.import_module("autoplan.runtime.parallelize")
    pm = module.parallelize(MODELS[model_name](0), strategy, seq_len=SEQ, optimizer=make_optimizer)
    ids = make_batch()
    counts = {"reduced": 0, "dtensor_1d_all_reduces": 0}
    orig_ar, orig_reduce = funcol.all_reduce, module.reduce_partial_grads

    def all_reduce(t, *a, **k):
        counts["dtensor_1d_all_reduces"] += t.dim() == 1
        return orig_ar(t, *a, **k)

    def reduce(parts):
        n = orig_reduce(parts)
        counts["reduced"] += n
        return n
    funcol.all_reduce, module.reduce_partial_grads = all_reduce, reduce
    try:
        pm.step(ids)
    finally:
        funcol.all_reduce, module.reduce_partial_grads = orig_ar, orig_reduce
    return counts


def layer_names(model_name: str, layers: int = 4) -> list[str]:
    stack = {"gpt": "blocks", "llama": "model.layers"}[model_name.split("-")[0]]
    return ["pre"] + [f"{stack}.{i}" for i in range(layers)] + ["post"]


def uneven_plan(graph: str, *, dp: int = 1, tp: int = 1, zero: int = 0,
                schedule: str = "1f1b", micro_batch: int = 2):
    """pp=2 with one block on the first stage and three on the second (``graph``: JSON)."""
    from autoplan.runtime import plan_of
    from autoplan.strategy import Strategy

    s = Strategy(dp=dp, tp=tp, pp=2, zero=zero, micro_batch=micro_batch,
                 global_batch=GLOBAL_BATCH, schedule=schedule, precision="fp32")
    return plan_of(s, _graph(graph), world_size=s.world_size, blocks_per_stage=(1, 3))


def mixed_recompute(plan, options: tuple[str, ...] = ("full", "selective", "none")):
    """``plan`` with per-block recompute as the search emits it: CP-SAT picks how many of
    each pipeline rank's blocks take each option and lays them out most-saving first,
    since the earliest blocks keep their activations longest
    (``autoplan.search.search._refine``).  Here each rank's blocks, in execution order,
    are split as evenly as possible over ``options`` in that order; embeddings and
    head keep theirs.

    The search only refines one-chunk schedules; on interleaved and zero-bubble plans
    this is a hand-made plan of the same shape.
    """
    import dataclasses

    from autoplan.plan import even_block_counts

    blocks = {lp.name for lp in plan.layers if lp.name.rsplit(".", 1)[-1].isdigit()}
    choice: dict[str, str] = {}
    for rank in range(plan.pp):
        mine = [n for k in plan.local_stages(rank) for n in plan.stages[k].layers if n in blocks]
        counts = even_block_counts(len(mine), len(options)) if len(mine) >= len(options) \
            else [1] * len(mine)
        it = iter(mine)
        for option, count in zip(options, counts):
            for _ in range(count):
                choice[next(it)] = option
    layers = tuple(dataclasses.replace(lp, recompute=choice.get(lp.name, lp.recompute))
                   for lp in plan.layers)
    return dataclasses.replace(plan, layers=layers)


def uneven_batches(plan, replica_batch: tuple[int, ...]):
    """``plan`` with replica ``r`` taking ``replica_batch[r]`` sequences per step (as the
    search splits the batch over replicas of different speeds); Plan validates it."""
    import dataclasses

    return dataclasses.replace(plan, replica_batch=tuple(replica_batch),
                               num_micro_batches=max(replica_batch) // plan.micro_batch)


def plan_for(strategy, graph: str, **kw):
    """:func:`autoplan.runtime.plan_of` of ``strategy`` on its world (``graph``: JSON)."""
    from autoplan.runtime import plan_of

    return plan_of(strategy, _graph(graph), world_size=strategy.world_size, **kw)


# ---------------------------------------------------------------------- bf16
#: How far a bf16 run may be from the fp32 reference, as a multiple of how far the
#: single-process bf16 run is from it (see :func:`bf16_bounds`).
BF16_FACTOR = 3.0


def _deviation(got: dict, want: dict, start: dict) -> tuple[float, float]:
    """Max abs difference of two state dicts, and their L2 distance relative to the
    distance training moved ``want`` from ``start`` (the update's size)."""
    worst = max(_max_err(got[k], v) for k, v in want.items())
    num = sum(float((got[k].double() - v.double()).pow(2).sum()) for k, v in want.items())
    den = sum(float((v.double() - start[k].double()).pow(2).sum()) for k, v in want.items())
    return worst, (num / den) ** 0.5


def bf16_bounds(model_name: str, steps: int = 10, factor: float = BF16_FACTOR) -> dict[str, Any]:
    """The fp32 single-process reference and the bf16 tolerances derived from it.

    bf16 rounds every weight, activation and matmul input to 8 mantissa bits; where and in what order
    a parallel layout sums (tensor-parallel partial sums, gradient reductions,
    micro-batch accumulation, pipeline splits) changes which roundings happen, not
    their size.  So the single-process bf16 run's distance from fp32 after ``steps``
    steps, ``d``, measures the precision itself, and a correct parallel bf16 run is
    another draw of that error: it must stay within ``factor * d`` of fp32, for the
    loss at every step, for the largest parameter entry, and for the L2 distance of
    all parameters relative to the size of the update (the entry-wise maximum is
    dominated by a few entries whose tiny gradients Adam's normalisation amplifies).

    ``factor`` = 3: on one process, bf16 runs that differ only in rounding (2 and 4
    micro-batches of gradient accumulation) landed within 1.6x ``d`` on the tiny GPT
    and Llama under autocast (loss 1.75e-4 / 2.8e-4, max entry 1.8e-3 / 1.8e-3, relative
    1.26e-2 / 1.35e-2), so 3x leaves about 2x margin.  With bf16 weights and activations
    (the program since autocast was dropped) ``d`` is loss 5.8e-4 / 4.0e-4, max entry
    2.5e-3 / 2.5e-3, relative 1.6e-2 / 1.2e-2 (GPT / Llama, 10 steps).  The bound must
    still catch a real bug: training on half of the batch (a replica whose gradients
    were never reduced) is ``bug`` away from fp32, returned too; it is checked here to be
    several times every bound (measured: loss 0.1, max entry 2e-2, relative 0.9).
    """
    fp32 = reference(model_name, steps)
    bf16 = reference(model_name, steps, bf16=True)
    half = reference(model_name, steps, rows=slice(0, GLOBAL_BATCH // 2))
    start = MODELS[model_name](0).state_dict()
    final = fp32["params"][steps]

    def distance(run: dict) -> dict[str, float]:
        worst, rel = _deviation(run["params"][steps], final, start)
        loss = max(abs(a - b) for a, b in zip(run["losses"], fp32["losses"]))
        return {"loss": loss, "param": worst, "rel": rel}

    d, bug = distance(bf16), distance(half)
    tol = {k: factor * v for k, v in d.items()}
    for k in ("loss", "rel"):
        # the loss tolerance is ~60x below the bug, the relative one ~18x (dense) and ~4.5x
        # (MoE, whose routing bf16 may flip)
        if not 0 < tol[k] < bug[k] / 3:
            raise AssertionError(f"bf16 {k} tolerance {tol[k]:.3g} (= {factor} x {d[k]:.3g}) is "
                                 f"not well below the error of a missing reduction {bug[k]:.3g}")
    # the entry-wise maximum only catches a single broken tensor, where it can: ~2.7x below
    # the bug on the dense models (bf16 puts the single process 2.5e-3 from fp32, the half
    # batch 2e-2); on MoE models a routing decision bf16 flips moves single entries by
    # nearly as much as the bug (Mixtral 8.5e-3 against 2e-2), so there it is not checked
    if not tol["param"] < bug["param"] / 2:
        tol["param"] = float("inf")
    return {"losses": fp32["losses"], "params": final, "start": start, "steps": steps,
            "single_bf16": d, "tol": tol, "bug": bug}


def bf16_parity(rank: int, world: int, targets: list[tuple], bounds: dict[str, dict],
                graph: dict[str, str]) -> dict[str, dict[str, float]]:
    """Train each ``(label, target, model)`` in bf16 for ``bounds[model]["steps"]`` steps
    and compare with the fp32 single-process reference within the bounds of
    :func:`bf16_bounds`.  Returns per label the errors and the seconds taken."""
    from autoplan.runtime import parallelize

    ids = make_batch()
    out: dict[str, dict[str, float]] = {}
    for label, target, name in targets:
        t0 = time.perf_counter()
        b = bounds[name]
        pm = parallelize(MODELS[name](0), target, seq_len=SEQ, optimizer=make_optimizer,
                         graph=_graph(graph.get(name)))
        if pm.plan.precision.value != "bf16":
            raise AssertionError(f"{label}: runs {pm.plan.precision.value}, not bf16")
        loss_err = max(abs(pm.step(ids) - want) for want in b["losses"])
        sd = pm.full_state_dict()
        err = {"loss": loss_err, "param": 0.0, "rel": 0.0}
        if rank == 0:
            err["param"], err["rel"] = _deviation(sd, b["params"], b["start"])
        for k, e in err.items():
            if not e <= b["tol"][k]:
                raise AssertionError(f"{label} ({pm.plan.label()}): bf16 {k} error {e:.3g} > "
                                     f"{b['tol'][k]:.3g} ({BF16_FACTOR} x the single-process "
                                     f"bf16 error {b['single_bf16'][k]:.3g})")
        out[label] = {"loss_err": err["loss"], "param_err": err["param"], "rel_err": err["rel"],
                      "seconds": time.perf_counter() - t0}
        del pm
    return out


# ---------------------------------------------------------------------- checkpoints
#: Adam's per-parameter state; every trainable parameter must have all of it.
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (``assert_close``
    with ``atol=rtol=0`` still equates ``0.0`` and ``-0.0``)."""
    return torch.equal(a.detach().reshape(-1).view(torch.uint8),
                       b.detach().reshape(-1).view(torch.uint8))


def _assert_same(label: str, got: dict, want: dict, *, subset: bool = False) -> None:
    """``got`` holds exactly the keys of ``want`` (``subset``: some of them, at least one),
    every tensor a plain (unsharded) one, equal with ``atol=rtol=0`` and bit for bit."""
    if subset:
        if not got or set(got) - set(want):
            raise AssertionError(f"{label}: holds {len(got)} keys, unexpected "
                                 f"{sorted(set(got) - set(want))[:5]}")
    elif set(got) != set(want):
        raise AssertionError(f"{label}: keys differ: missing {sorted(set(want) - set(got))[:5]}, "
                             f"extra {sorted(set(got) - set(want))[:5]}")
    for k in got:
        g, v = got[k], want[k]
        if isinstance(v, torch.Tensor):
            if type(g) is not torch.Tensor:
                raise AssertionError(f"{label} {k}: a {type(g).__name__}, not a full tensor")
            torch.testing.assert_close(g, v, atol=0, rtol=0, msg=lambda m: f"{label} {k}: {m}")
            if not _same_bits(g, v):
                raise AssertionError(f"{label} {k}: equal values, different bits")
        elif g != v:
            raise AssertionError(f"{label} {k}: {g!r} != {v!r}")


def _assert_complete(label: str, model_name: str, model_sd: dict, optim_sd: dict,
                     steps: int) -> None:
    """The full state of a ``model_name`` trained ``steps`` steps: every entry of the
    model's own state dict as a plain tensor of its full shape, and Adam's state of every
    parameter, with ``step == steps`` (so that comparing it cannot pass vacuously)."""
    model = MODELS[model_name](0)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if set(model_sd) != set(shapes):
        raise AssertionError(f"{label} model: keys differ from the model's: missing "
                             f"{sorted(set(shapes) - set(model_sd))[:5]}, extra "
                             f"{sorted(set(model_sd) - set(shapes))[:5]}")
    for k, v in model_sd.items():
        if type(v) is not torch.Tensor or v.shape != shapes[k]:
            raise AssertionError(f"{label} model {k}: {type(v).__name__} "
                                 f"{tuple(getattr(v, 'shape', ()))}, "
                                 f"not a full tensor of shape {tuple(shapes[k])}")
    params = dict(model.named_parameters())      # tied weights once
    want = {f"state.{p}.{s}" for p in params for s in ADAM_STATE}
    have = {k for k in optim_sd if k.startswith("state.")}
    if have != want:
        raise AssertionError(f"{label} optimizer: state keys differ from Adam's on every "
                             f"parameter: missing {sorted(want - have)[:5]}, extra "
                             f"{sorted(have - want)[:5]}")
    for p, param in params.items():
        for s in ADAM_STATE:
            v = optim_sd[f"state.{p}.{s}"]
            shape = torch.Size([]) if s == "step" else param.shape
            if type(v) is not torch.Tensor or v.shape != shape:
                raise AssertionError(f"{label} optimizer {p}.{s}: {type(v).__name__} "
                                     f"{tuple(getattr(v, 'shape', ()))}, not a full tensor "
                                     f"of shape {tuple(shape)}")
        if float(optim_sd[f"state.{p}.step"]) != steps:
            raise AssertionError(f"{label} optimizer {p}.step: "
                                 f"{float(optim_sd[f'state.{p}.step'])} != {steps}")


def _held_full_state(pm) -> tuple[dict, dict]:
    """The full (unsharded) model and flattened optimizer state of the parts this rank
    holds, on every rank (:meth:`ParallelModel.full_state_dict` keeps only rank 0's
    pipeline group, so a data-parallel replica that loaded wrongly would go unseen)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    model_opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    optim_opts = StateDictOptions(full_state_dict=True, cpu_offload=False,
                                  flatten_optimizer_state_dict=True)
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    for part, opt in zip(pm.parts, pm.optimizers):
        model_sd.update(get_model_state_dict(part, options=model_opts))
        # a tied weight's stage copy under the canonical name, as the full state has it
        optim_sd.update(pm._canonical(get_optimizer_state_dict(part, opt, options=optim_opts)))
    return model_sd, optim_sd


def _wrapping(pm) -> str:
    """How this rank's parts are data-parallel: DDP, FSDP (fully_shard), replicate or none."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    kinds = set()
    for part in pm.parts:
        if isinstance(part, DistributedDataParallel):
            kinds.add("DDP")
        for m in part.modules():
            if isinstance(m, FSDPModule):
                kinds.add("replicate" if type(m).__name__.startswith("Replicate") else "FSDP")
    return "+".join(sorted(kinds)) or "none"


def _facts(pm) -> dict:
    """What a plan is, for a test to check that a label names the pair it runs."""
    plan = pm.plan
    return {"world": dist.get_world_size(), "dp": plan.dp, "tp": plan.stages[0].tp,
            "pp": plan.pp, "zero": sorted({l.zero for l in plan.layers}), "wrap": _wrapping(pm),
            "layout": plan.label(), "ep": plan.ep, "expert_modules": len(expert_split(pm))}


def expert_split(pm) -> list[str]:
    """The expert-parallel modules of this rank's parts, checked against the plan: every
    MoE layer of the parts is split (none is without ep), each rank holds ``E / ep``
    experts of each bank as the ``Shard(0)`` slice of its ep coordinate, and its ep group
    is the ``ep`` ranks of consecutive flattened ``dp x cp`` index with its pp and tp
    coordinates (``autoplan.plan.MeshPlan.ep``).  Returns their paths."""
    from autoplan.runtime.ep import ExpertParallel
    from autoplan.runtime.mesh import mesh_coordinates

    plan = pm.plan
    c = mesh_coordinates(plan)
    f = c["dp"] * plan.cp + c["cp"]
    group = []
    for r in range(dist.get_world_size()):
        o = mesh_coordinates(plan, r)
        if (o["pp"], o["tp"]) == (c["pp"], c["tp"]) and (o["dp"] * plan.cp + o["cp"]) // plan.ep == f // plan.ep:
            group.append(r)
    found = []
    for part in pm.parts:
        for name, m in part.named_modules():
            if isinstance(m, ExpertParallel):
                if plan.ep == 1:
                    raise AssertionError(f"{name}: expert parallel under ep=1")
                if sorted(dist.get_process_group_ranks(m.group)) != group:
                    raise AssertionError(f"{name}: ep group {dist.get_process_group_ranks(m.group)}"
                                         f", the plan's is {group}")
                for p in m.bank.params:
                    t = getattr(m, p)
                    spec = t.placements if hasattr(t, "placements") else None
                    if t.shape[0] != m.bank.num_experts or m.num_local * plan.ep != m.bank.num_experts:
                        raise AssertionError(f"{name}.{p}: global shape {tuple(t.shape)}, "
                                             f"{m.num_local} local experts, {spec}")
                found.append(name)
            elif plan.ep > 1 and any(q.dim() == 3 for q in m.parameters(recurse=False)):
                raise AssertionError(f"{name}: an expert bank left whole under ep={plan.ep}")
    return found


def checkpoint_save(rank: int, world: int, model_name: str, path: str, target: Any,
                    graph: str | None = None) -> dict:
    """Train 2 steps under ``target``, save to ``path``, record the full state then and the
    loss and parameters of a 3rd step (in ``path + '.expected.pt'``, by rank 0).  Returns
    the layout's :func:`_facts`."""
    from autoplan.runtime import parallelize

    ids = make_batch()
    pm = parallelize(MODELS[model_name](0), target, seq_len=SEQ, optimizer=make_optimizer,
                     graph=_graph(graph))
    for _ in range(2):
        pm.step(ids)
    pm.save(path)
    model_sd, optim_sd = pm.full_state_dict(), pm.full_optimizer_state_dict()
    loss3 = pm.step(ids)
    params3 = pm.full_state_dict()
    if rank == 0:
        _assert_complete(f"saved {model_name} ({pm.plan.label()})", model_name,
                         model_sd, optim_sd, steps=2)
        leftovers = [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n or ".old-" in n]
        if leftovers:
            raise AssertionError(f"temporary checkpoint directories left behind: {leftovers}")
        torch.save({"model": model_sd, "optim": optim_sd, "loss3": loss3, "params3": params3},
                   path + ".expected.pt")
    dist.barrier()   # a load right after this save reads the file on every rank
    return _facts(pm)


def checkpoint_load(rank: int, world: int, model_name: str, path: str,
                    targets: list[tuple[str, Any]], graph: str | None = None) -> dict:
    """Load ``path`` under each target into a differently initialised model (seed 7, fresh
    optimizer): the full state (rank 0) and the part every rank holds must be bit-identical
    to what was saved, and a 3rd step must match the saving run's (``ATOL``).  Returns per
    label the errors of that step, the step count and the layout's :func:`_facts`."""
    from autoplan.runtime import parallelize

    expected = torch.load(path + ".expected.pt", weights_only=False)
    ids = make_batch()
    out = {}
    for label, target in targets:
        pm = parallelize(MODELS[model_name](seed=7), target, seq_len=SEQ,
                         optimizer=make_optimizer, graph=_graph(graph))
        pm.load(path)
        model_sd, optim_sd = pm.full_state_dict(), pm.full_optimizer_state_dict()
        held_model, held_optim = _held_full_state(pm)
        _assert_same(f"{label}: rank {rank} model", held_model, expected["model"], subset=True)
        _assert_same(f"{label}: rank {rank} optimizer", held_optim, expected["optim"], subset=True)
        if rank == 0:
            _assert_same(f"{label}: model", model_sd, expected["model"])
            _assert_same(f"{label}: optimizer", optim_sd, expected["optim"])
        loss3 = pm.step(ids)
        params3 = pm.full_state_dict()
        loss_err = abs(loss3 - expected["loss3"])
        if loss_err > ATOL:
            raise AssertionError(f"{label}: step after loading: loss off by {loss_err:.3g}")
        param_err = 0.0
        if rank == 0:
            param_err = max(_max_err(params3[k], v) for k, v in expected["params3"].items())
            if param_err > ATOL:
                raise AssertionError(f"{label}: step after loading: parameters off by {param_err:.3g}")
        out[label] = {"loss_err": loss_err, "param_err": param_err, "steps": pm.steps,
                      **_facts(pm)}
    return out


# ---------------------------------------------------------------------- structural checks
def gpt_qkv_splits_by_head(tp: int = 2) -> bool:
    """Whether column-sharding the GPT's fused ``qkv`` gives every rank whole heads.

    Megatron tensor parallelism (Shoeybi et al. 2019) needs the rows of a fused
    q/k/v projection ordered so that a contiguous 1/tp slice holds the q, k and
    v of the same heads.  Simulated on one process: the sum over ranks of the
    attention computed from each rank's slices must equal the full attention.
    """
    import copy

    from torch import nn

    attn = make_gpt(0, layers=1).blocks[0].attn
    x = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(0))
    full = attn(x)
    w, b = attn.qkv.weight, attn.qkv.bias
    pw, pb = attn.proj.weight, attn.proj.bias
    rows, cols = w.shape[0] // tp, pw.shape[1] // tp
    total = torch.zeros_like(full)
    with torch.no_grad():
        for r in range(tp):
            local = copy.deepcopy(attn)
            local.qkv = nn.Linear(32, rows)
            local.qkv.weight.copy_(w[r * rows:(r + 1) * rows])
            local.qkv.bias.copy_(b[r * rows:(r + 1) * rows])
            local.proj = nn.Linear(cols, 32)
            local.proj.weight.copy_(pw[:, r * cols:(r + 1) * cols])
            local.proj.bias.copy_(pb / tp)
            total += local(x)
    return bool(torch.allclose(total, full, atol=1e-5))


def zero_bubble_safety(pm) -> list[str]:
    """Under a zero-bubble schedule: no DDP and no FSDP group that reshards after forward
    (the combinations the notes measured to give silently wrong gradients)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    problems = []
    for part in pm.parts:
        if isinstance(part, DistributedDataParallel):
            problems.append("a stage is wrapped in DDP")
        for name, m in part.named_modules():
            if isinstance(m, FSDPModule) and not type(m).__name__.startswith("Replicate"):
                for group in fully_shard.state(m)._fsdp_param_groups:
                    if group.post_forward_mesh_info is not None:
                        problems.append(f"{name or 'root'} reshards after forward")
    return problems


# ---------------------------------------------------------------------- searched plans
def synthetic_measurements(world: int = 2, bf16: bool = False,
                           memory_bytes: int | None = None,
                           overhead: list[dict] | None = None) -> dict:
    """What ``autoplan profile --device cpu`` measures, made up to known values: matmul n^3
    at 1e10 FLOP/s for n >= 128, half that below (``bf16``: also a bf16 table at half the
    fp32 speed); every collective exactly on the ring model with bus bandwidth B_op and
    100 us per step.  ``memory_bytes``: the RAM the ranks share (the profile gives each
    rank ``memory_bytes / world``), by default 8 GiB, or 2 GiB per rank beyond 4 ranks (the
    cost model reserves 1 GiB per rank for the runtime, so 8 ranks in 8 GiB fit nothing).
    ``overhead``: each rank's measured operator overhead (``OpOverhead`` fields in seconds;
    by default none was measured, as in profiles written before it was)."""
    if memory_bytes is None:
        memory_bytes = max(8, 2 * world) * 2**30
    fp32 = [[64, 2 * 64**3 / 5e9], [128, 2 * 128**3 / 1e10], [256, 2 * 256**3 / 1e10]]
    matmul = {"fp32": fp32}
    if bf16:
        matmul["bf16"] = [[n, t * 2] for n, t in fp32]
    ranks = [{"rank": r, "matmul": matmul, "copy_s": 2 * 2**20 / 4e9,
              "info": {"name": "Test CPU", "memory_bytes": memory_bytes},
              **({"overhead": overhead[r]} if overhead else {})} for r in range(world)]
    bus = {"all_reduce": 1e9, "all_gather": 0.5e9, "reduce_scatter": 0.5e9, "all_to_all": 0.8e9,
           "broadcast": 2e9, "p2p": 2e9}
    n = world
    coef = {"all_reduce": (2 * (n - 1) / n, 2 * (n - 1)), "all_gather": ((n - 1) / n, n - 1),
            "reduce_scatter": ((n - 1) / n, n - 1), "all_to_all": ((n - 1) / n, n - 1),
            "broadcast": (1.0, n - 1), "p2p": (1.0, 1)}
    sizes = [2**10, 2**16, 2**22]
    comm = {op: [[s, coef[op][1] * 100e-6 + coef[op][0] * s / bus[op]] for s in sizes]
            for op in bus}
    return {"ranks": ranks, "comm": comm, "world": world}


def cpu_cluster(world: int = 4, memory_bytes: int | None = None, overhead: dict | None = None):
    """A one-node cluster of ``world`` CPU processes from :func:`synthetic_measurements`
    (with bf16 at half the fp32 speed; ``memory_bytes`` as there; ``overhead``: every
    rank's operator overhead): the shape of what ``autoplan profile --device cpu --nproc 4``
    writes."""
    from autoplan.hardware import NodeGroup, compose_cluster
    from autoplan.profiling.build import build_profile

    measured = synthetic_measurements(world, bf16=True, memory_bytes=memory_bytes,
                                      overhead=[overhead] * world if overhead else None)
    profile, _ = build_profile(f"cpu-{world}", measured, cuda=False, nproc=world, threads=1,
                               devices_per_node=world, quick=True, copy_bytes=2**20)
    return compose_cluster([NodeGroup(profile, 1)], name=f"cpu-{world}")


def searched_plans(graph: str, world: int = 4, top_k: int = 3,
                   use_all_devices: bool = False) -> list[str]:
    """The ``top_k`` plans autoplan.plan finds for the graph on :func:`cpu_cluster` (JSON),
    as the search returns them: on 8 ranks its best two leave 4 idle, so one parity launch
    runs plans of 4 and of 8 active processes in turn (:func:`parity` finishes each);
    ``use_all_devices``: only plans on all ``world``."""
    import autoplan

    g = _graph(graph)
    best = autoplan.plan(g, cpu_cluster(world), global_batch=GLOBAL_BATCH, seq_len=SEQ,
                         precision="fp32", top_k=top_k,
                         use_all_devices=use_all_devices)
    return [p.to_json() for p in (best, *getattr(best, "runners_up", ()))][:top_k]


def searched_plans_parity(rank: int, world: int, graphs: dict[str, str],
                          plans: dict[str, list[str]]) -> dict:
    from autoplan.plan import Plan

    out = {}
    for name, texts in plans.items():
        targets = []
        for text in texts:
            p = Plan.from_json(text)
            targets.append((f"{name}: {p.summary().split(' on ')[0]}", p))
        out.update(parity(rank, world, name, targets, graph=graphs[name]))
    return out


def checkpoint_suite(rank: int, world: int, jobs: list[tuple], graphs: dict[str, str]) -> list:
    """Run checkpoint jobs in order: ``("save", model, path, target)`` or
    ``("load", model, path, [(label, target), ...])``."""
    out = []
    for kind, model_name, path, what in jobs:
        if kind == "save":
            out.append(checkpoint_save(rank, world, model_name, path, what, graphs.get(model_name)))
        else:
            out.append(checkpoint_load(rank, world, model_name, path, what, graphs.get(model_name)))
    return out


# ---------------------------------------------------------------------- faults
def crashed_peer(rank: int, world: int, how: str) -> dict:
    """Rank 1 crashes (``how="crash"``: exits) or hangs (``"hang"``) after one step; the
    other ranks' next step must raise, not hang.  Returns how long that took."""
    from autoplan.runtime import parallelize
    from autoplan.strategy import Strategy

    pm = parallelize(make_gpt(0), Strategy(dp=world, global_batch=GLOBAL_BATCH, precision="fp32"),
                     seq_len=SEQ)
    ids = make_batch()
    pm.step(ids)
    dist.barrier()
    if rank == 1:
        if how == "crash":
            os._exit(17)
        time.sleep(600)
    t0 = time.monotonic()
    try:
        pm.step(ids)
    except Exception as e:  # noqa: BLE001 - what we are testing for
        return {"raised": type(e).__name__, "seconds": time.monotonic() - t0, "message": str(e)}
    return {"raised": None, "seconds": time.monotonic() - t0}


def bad_plans_issue_no_collective(rank: int, world: int) -> dict:
    """Each rank, alone, asks for a layout that cannot work: it must raise before any
    collective (the other rank is not participating, so a collective would hang or
    mismatch).  Then the group is still healthy: a real layout trains."""
    from autoplan.errors import PlanMismatchError, StrategyError
    from autoplan.runtime import parallelize
    from autoplan.strategy import Strategy

    errors = {}
    for turn in range(world):
        if rank == turn:
            bad = {
                "unknown layer": renamed_layer(
                    Strategy(dp=world, global_batch=8, precision="fp32"), "blocks.3", "blocks.7"),
                "degrees vs world": Strategy(dp=2, tp=2, global_batch=8),
                "tp vs heads": Strategy(dp=1, tp=world, global_batch=8, precision="fp32"),
            }
            for what, target in bad.items():
                model = make_gpt(0, layers=4) if what != "tp vs heads" else _odd_heads_gpt()
                t0 = time.monotonic()
                try:
                    parallelize(model, target, seq_len=SEQ)
                except (PlanMismatchError, StrategyError) as e:
                    errors[what] = (type(e).__name__, str(e), time.monotonic() - t0)
                else:
                    raise AssertionError(f"{what}: parallelize accepted {target}")
        dist.barrier()
    pm = parallelize(make_gpt(0), Strategy(dp=world, global_batch=8, precision="fp32"), seq_len=SEQ)
    loss = pm.step(make_batch())
    return {"errors": errors, "loss_after": loss}


def renamed_layer(strategy, old: str, new: str):
    """The plan of ``strategy`` for the tiny GPT with layer ``old`` renamed ``new`` (a plan
    made for another model)."""
    import dataclasses

    from autoplan.runtime import plan_of

    plan = plan_of(strategy, _graph(graph_json("gpt")), world_size=strategy.world_size)
    stages = tuple(dataclasses.replace(st, layers=tuple(new if n == old else n for n in st.layers))
                   for st in plan.stages)
    layers = tuple(dataclasses.replace(lp, name=new) if lp.name == old else lp
                   for lp in plan.layers)
    return dataclasses.replace(plan, stages=stages, layers=layers)


def _odd_heads_gpt():
    """A GPT with 3 heads: no even tensor-parallel degree divides it."""
    from autoplan.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=48, heads=3, layers=2))


def cluster_target(rank: int, world: int) -> dict:
    """``parallelize(model, cluster)`` plans on rank 0 and applies the plan on every rank."""
    from autoplan.runtime import parallelize

    pm = parallelize(make_gpt(0), cpu_cluster(world), global_batch=GLOBAL_BATCH, seq_len=SEQ)
    loss = pm.step(make_batch())
    return {"plan": pm.plan.to_json(), "loss": loss}


# ---------------------------------------------------------------------- a model without tokens
def mlp_parity(rank: int, world: int, targets: list[tuple[str, Any]], steps: int = 3) -> dict:
    """SmallMLP regression (inputs, targets) with an MSE loss_fn, against the reference."""
    from torch.nn import functional as F

    from autoplan.models import SmallMLP
    from autoplan.runtime import parallelize

    def make():
        torch.manual_seed(0)
        return SmallMLP(inputs=16, hidden=32, outputs=4, depth=3)

    g = torch.Generator().manual_seed(5)
    batch = (torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
    ref_model = make()
    opt = make_optimizer(ref_model.parameters())
    ref_losses = []
    for _ in range(steps):
        loss = F.mse_loss(ref_model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    out = {}
    for label, target in targets:
        t0 = time.perf_counter()
        pm = parallelize(make(), target, example_inputs=batch[0][:1], loss_fn=F.mse_loss,
                         optimizer=make_optimizer)
        loss_err = max(abs(pm.step(batch) - r) for r in ref_losses)   # steps in order
        sd = pm.full_state_dict()
        param_err = 0.0
        if rank == 0:
            param_err = max(_max_err(sd[k], v) for k, v in ref_model.state_dict().items())
        if loss_err > ATOL or param_err > ATOL:
            raise AssertionError(f"{label}: loss off by {loss_err:.3g}, params by {param_err:.3g}")
        out[label] = {"loss_err": loss_err, "param_err": param_err,
                      "seconds": time.perf_counter() - t0}
    return out


# ---------------------------------------------------------------------- heterogeneous plans
def stage_placement(pm) -> dict:
    """Where the runtime put this rank's work, against the plan's record of it.

    Returns this rank's virtual stages, the layers each local part holds (a
    layer is held when the part has any parameter under one of its modules),
    the ranks of its pipeline group and its data-parallel replica; raises
    AssertionError naming the first disagreement with ``plan.stages[k].devices``
    (the devices, i.e. processes, of stage ``k``), ``plan.stage_ranks`` and
    ``plan.stages[k].layers``.
    """
    plan, rank = pm.plan, dist.get_rank()
    label = plan.label()
    mine = tuple(st.index for st in plan.stages if rank in st.devices)
    held = tuple(s.stage_index for s in pm.stages) if plan.pp > 1 else (0,)
    if held != mine:
        raise AssertionError(f"{label}: rank {rank} runs stages {held}; the plan puts it in "
                             f"the devices of stages {mine}")
    if len({plan.stage_ranks[k] for k in mine}) != 1:
        raise AssertionError(f"{label}: rank {rank} holds stages {mine} of pipeline ranks "
                             f"{[plan.stage_ranks[k] for k in mine]}")
    layers = {l.name: l.modules for l in pm.graph.layers if l.param_count > 0}
    parts = []
    for k, part in zip(mine, pm.parts):
        names = [n.removeprefix("module.") for n, _ in part.named_parameters()]
        have = tuple(l for l, mods in layers.items()
                     if any(n.startswith(m + ".") for m in mods for n in names))
        want = tuple(x for x in plan.stages[k].layers if x in layers)
        if sorted(have) != sorted(want):
            raise AssertionError(f"{label}: rank {rank}'s stage {k} holds layers {have}; the "
                                 f"plan lists {want}")
        parts.append(have)
    pos = plan.stages[mine[0]].devices.index(rank)   # same position in every stage's devices
    per_replica = plan.cp * plan.stages[mine[0]].tp
    if pm.replica != pos // per_replica:
        raise AssertionError(f"{label}: rank {rank} computes as replica {pm.replica}, but is "
                             f"device {pos} of its stage (replica {pos // per_replica})")
    peers = None
    if plan.pp > 1:
        peers = dist.get_process_group_ranks(pm.mesh["pp"].get_group())
        by_rank = {st.rank: st.devices[pos] for st in plan.stages}
        want_peers = [by_rank[r] for r in range(plan.pp)]
        if peers != want_peers:
            raise AssertionError(f"{label}: rank {rank}'s pipeline group is {peers}; the plan's "
                                 f"stages put its replica on {want_peers}")
    return {"stages": mine, "layers": parts, "replica": pm.replica,
            "replica_batch": plan.replica_batch[pm.replica], "pipeline": peers}


def hetero_parity(rank: int, world: int, model_name: str, plans: list[tuple[str, str]],
                  graph: str | None = None) -> dict:
    """Per plan (JSON, e.g. searched on a heterogeneous cluster): the stage placement
    check of :func:`stage_placement`, then :func:`parity`.  Returns per label the parity
    errors and this rank's placement."""
    from autoplan.plan import Plan
    from autoplan.runtime import parallelize

    targets = [(label, Plan.from_json(text)) for label, text in plans]
    placement = {}
    for label, plan in targets:
        pm = parallelize(MODELS[model_name](0), plan, seq_len=SEQ, optimizer=make_optimizer,
                         graph=_graph(graph))
        placement[label] = stage_placement(pm)
        del pm
    out = parity(rank, world, model_name, targets, graph=graph)
    return {label: {**r, "placement": placement[label]} for label, r in out.items()}
