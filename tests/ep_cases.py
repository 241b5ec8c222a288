"""Worker bodies of the expert-parallel tests (run by tests/dist_harness.py).

``module_parity`` checks :class:`autoplan.runtime.ep.ExpertParallel` alone against
the family's experts module on one process, under routings chosen to hit the
edge cases (a rank receiving no rows, experts receiving none, no traffic
between ranks, a rank without tokens).  Model-level parity is
``runtime_cases.parity`` on the MoE models of ``runtime_cases.MODELS``.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch

#: Experts, routing slots per token and token feature size of the module-level cases.
EXPERTS, TOP_K, HIDDEN = 8, 2, 32


def experts_module(family: str, implementation: str | None = None) -> torch.nn.Module:
    """The first MoE layer's experts module of a tiny ``family`` model (random init, seed 0;
    gpt-oss's biases, zero at init, randomised too).  ``implementation``: the Hugging Face
    experts implementation (``eager``, ``grouped_mm``, ``batched_mm``; default the model's)."""
    import transformers

    import runtime_cases as rc

    torch.manual_seed(0)
    if family in ("mixtral", "qwen3moe", "qwen2moe"):
        model = rc.make_moe(family, layers=1)
        module = model.model.layers[0].mlp.experts
    elif family == "gpt_oss":   # interleaved gate/up, transposed banks, biases, clamped SwiGLU
        cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8,
                                        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                        swiglu_limit=0.5)
        module = transformers.GptOssForCausalLM(cfg).model.layers[0].mlp.experts
        with torch.no_grad():
            module.gate_up_proj.normal_(0, 0.3)
            module.down_proj.normal_(0, 0.3)
            module.gate_up_proj_bias.normal_(0, 0.3)
            module.down_proj_bias.normal_(0, 0.3)
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
            n_group=2, topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        module = transformers.DeepseekV3ForCausalLM(cfg).model.layers[1].mlp.experts
    else:
        raise ValueError(f"unknown family {family!r}")
    if implementation is not None:
        module.config._experts_implementation = implementation
    return module


# ---------------------------------------------------------------------- routings
def _topk(g: torch.Generator, n: int, lo: int, hi: int) -> torch.Tensor:
    """``n`` tokens, each routed to ``TOP_K`` distinct experts drawn from ``lo..hi-1``."""
    scores = torch.rand(n, hi - lo, generator=g)
    return scores.topk(TOP_K, dim=1).indices + lo


def route(kind: str, rank: int, world: int, g: torch.Generator) -> torch.Tensor:
    """Top-k expert indices of rank ``rank``'s tokens under routing ``kind``."""
    local = EXPERTS // world
    if kind == "random":
        return _topk(g, 12, 0, EXPERTS)
    if kind == "all to rank 0":      # the other ranks receive no rows at all
        return _topk(g, 9, 0, local)
    if kind == "own experts only":   # no traffic between ranks
        return _topk(g, 7, rank * local, (rank + 1) * local)
    if kind == "skewed":             # experts 0 and the last one only: most get no rows
        return torch.tensor([[0, EXPERTS - 1]] * (3 + rank))
    if kind == "no tokens on rank 1":
        return _topk(g, 0 if rank == 1 else 10, 0, EXPERTS)
    raise ValueError(kind)


ROUTINGS = ("random", "all to rank 0", "own experts only", "skewed", "no tokens on rank 1")


def _inputs(kind: str, rank: int, world: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(100 + rank)
    idx = route(kind, rank, world, g)
    n = idx.shape[0]
    h = torch.randn(n, HIDDEN, generator=g).to(dtype)
    w = torch.rand(n, TOP_K, generator=g)
    c = torch.randn(n, HIDDEN, generator=g).to(dtype)   # the loss is (out * c).sum()
    return h, idx, w, c


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def module_parity(rank: int, world: int, family: str, implementation: str | None = None,
                  routings: tuple[str, ...] = ROUTINGS, atol: float = 1e-5) -> dict:
    """:class:`ExpertParallel` over ``world`` ranks against the family's module on one
    process: outputs, input and routing-weight gradients, and every bank's gradient
    (the sum over ranks' losses; the EP module's is ``1/ep`` of that, see ``ep.py``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.runtime.ep import ExpertParallel, expert_bank

    module = experts_module(family, implementation)
    ref = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    bank = expert_bank(module, world)
    epm = ExpertParallel(module, bank, mesh)
    local = EXPERTS // world
    lo = mesh.get_local_rank() * local
    out: dict[str, dict[str, float]] = {}
    for kind in routings:
        t0 = time.perf_counter()
        ref.zero_grad(set_to_none=True)
        epm.zero_grad(set_to_none=True)
        want = {}
        for r in range(world):
            h, idx, w, c = _inputs(kind, r, world, torch.float32)
            h.requires_grad_(True)
            w.requires_grad_(True)
            y = ref(h, idx, w)
            if y.requires_grad:   # (the eager loop's output on no tokens is a constant)
                (y * c).sum().backward()
            if r == rank:
                want = {"out": y.detach(), "h": h.grad, "w": w.grad}
        h, idx, w, c = _inputs(kind, rank, world, torch.float32)
        h.requires_grad_(True)
        w.requires_grad_(True)
        y = epm(h, idx, w)
        (y * c).sum().backward()
        errs = {"out": _err(y, want["out"]),
                "h": _err(h.grad, want["h"]) if want["h"] is not None else 0.0,
                "w": _err(w.grad, want["w"]) if want["w"] is not None else 0.0}
        for name in bank.params:
            g = getattr(epm, name).grad
            if g is None:
                raise AssertionError(f"{family} {kind}: rank {rank}'s {name} got no gradient")
            full = getattr(ref, name).grad
            full = torch.zeros_like(getattr(ref, name)) if full is None else full
            errs[name] = _err(g.to_local() * world, full[lo:lo + local])
        worst = max(errs, key=errs.get)
        if errs[worst] > atol:
            raise AssertionError(f"{family} ({implementation or 'default'}) routing {kind!r}: "
                                 f"rank {rank}'s {worst} differs by {errs[worst]:.3g} > {atol}")
        out[kind] = {"err": errs[worst], "seconds": time.perf_counter() - t0}
    return out


def probe_errors(cases: dict[str, Callable[[], torch.nn.Module]], ep: int) -> dict[str, str]:
    """The :class:`ConfigError` message :func:`expert_bank` gives for each module (no
    process group needed)."""
    from autoplan.errors import ConfigError
    from autoplan.runtime.ep import expert_bank

    out = {}
    for name, make in cases.items():
        try:
            expert_bank(make(), ep)
        except ConfigError as e:
            out[name] = str(e)
        else:
            out[name] = ""
    return out


def refusals(rank: int, world: int, graph: str) -> dict[str, str]:
    """Each rank alone asks for an expert-parallel layout that cannot work: it must raise
    before any collective (the other ranks are not participating).  Then a real ep layout
    trains, so the group is still healthy.  Returns the errors by case."""
    import torch.distributed as dist

    import runtime_cases as rc
    from autoplan.errors import AutoplanError
    from autoplan.runtime import parallelize
    from autoplan.strategy import Strategy

    def S(**kw):
        return Strategy(global_batch=rc.GLOBAL_BATCH, precision="fp32", **kw)

    def hidden_count():
        model = rc.MODELS["mixtral"](0)
        for layer in model.model.layers:   # the expert count kept where EP cannot see it
            layer.mlp.experts.num_experts = 99
        return model

    cases = {
        "sequence parallel": (lambda: rc.MODELS["mixtral"](0), S(tp=2, sequence_parallel=True)),
        "expert count not understood": (hidden_count, S(dp=2, ep=2)),
    }
    errors: dict[str, str] = {}
    for turn in range(world):
        if rank == turn:
            for what, (make, target) in cases.items():
                try:
                    parallelize(make(), target, seq_len=rc.SEQ, graph=rc._graph(graph))
                except AutoplanError as e:
                    errors[what] = f"{type(e).__name__}: {e}"
                else:
                    raise AssertionError(f"{what}: parallelize accepted {target}")
        dist.barrier()
    pm = parallelize(rc.MODELS["mixtral"](0), S(dp=2, ep=2), seq_len=rc.SEQ, graph=rc._graph(graph))
    pm.step(rc.make_batch())
    return errors
