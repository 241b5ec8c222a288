"""Worker bodies of the context-parallel tests (run by tests/dist_harness.py).

Each job trains one tiny model for 3 AdamW steps under context parallelism
(``apply_cp``) with its gradients averaged by DDP or FSDP2 over the ``dp x cp``
group, and compares the loss after every step and every parameter after steps
1 and 3 with the single-process reference of tests/runtime_cases.py (same seed,
same global batch) with ``assert_close(atol=rtol=ATOL)``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import runtime_cases as rc

#: What a job may name as its model (runtime_cases' models, SDPA-attention variants too).
MODELS = rc.MODELS


def cp_errors(rank: int, world: int) -> dict[str, str]:
    """What apply_cp and a CP model refuse, with their messages (every rank alike, no
    collective is issued before the error)."""
    from autoplan.errors import AutoplanError
    from autoplan.runtime.cp import apply_cp

    group = dist.group.WORLD
    out = {}

    def expect(what: str, fn) -> None:
        try:
            fn()
        except AutoplanError as e:
            out[what] = f"{type(e).__name__}: {e}"
        else:
            raise AssertionError(f"{what}: no error")

    expect("seq_len", lambda: apply_cp(rc.make_gpt(0), group, seq_len=4 * world + 2))
    gpt = rc.make_gpt(0)
    apply_cp(gpt, group, seq_len=rc.SEQ)
    expect("twice", lambda: apply_cp(gpt, group, seq_len=rc.SEQ))
    expect("whole sequences", lambda: gpt(rc.make_batch()))
    flash = rc.make_llama(0)
    flash.config._attn_implementation = "flash_attention_2"
    expect("flash attention", lambda: apply_cp(flash, group, seq_len=rc.SEQ))
    expect("family", lambda: apply_cp(torch.nn.Linear(2, 2), group, seq_len=rc.SEQ))
    return out


def _mesh(cp: int):
    """A ("dp", "cp") mesh of the world (cp fastest) and its flattened dp x cp mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return mesh, mesh["dp", "cp"]._flatten(f"dp_cp{cp}")


class _TwoStages(torch.nn.Module):
    """Two pipeline stage modules chained in one process: what a pipeline of two stages
    computes, without the schedule (state dict keys ``first.<name>`` / ``last.<name>``)."""

    def __init__(self, first, last) -> None:
        super().__init__()
        self.first, self.last = first, last

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(ids))


def _stages(model, cut: int) -> _TwoStages:
    """``model`` as two stage modules: the blocks before ``cut`` and the rest."""
    from autoplan.runtime.adapters import adapter_for
    from autoplan.runtime.pipeline import build_stage_module

    adapter = adapter_for(model)
    n = len(model.get_submodule(adapter.blocks))
    names = [f"{adapter.blocks}.{i}" for i in range(n)]
    return _TwoStages(
        build_stage_module(model, adapter, names[:cut], is_first=True, is_last=False,
                           seq_len=rc.SEQ),
        build_stage_module(model, adapter, names[cut:], is_first=False, is_last=True,
                           seq_len=rc.SEQ))


def cp_parity(rank: int, world: int, jobs: list[tuple], steps: int = 3,
              graphs: dict[str, str] | None = None, errors: bool = False) -> dict[str, dict]:
    """Run every ``(label, model, cp, wrap)`` job; ``wrap`` is ``"ddp"``, ``"fsdp"``,
    ``"stages-ddp"`` (the model as two pipeline stage modules, each under CP, in DDP),
    ``dp = world / cp``; or ``"tp"`` / ``"tp-sp"``: tensor parallelism (with sequence
    parallelism) of degree ``world / cp``, then CP, then FSDP2 over the cp group (dp = 1);
    ``graphs``: captures (JSON) by model name for tensor parallelism (else traced here);
    ``errors``: first run :func:`cp_errors` (its messages under the key ``"errors"``).  Returns per label the worst loss and parameter errors."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoplan.runtime.cp import apply_cp
    from autoplan.runtime.adapters import model_output

    refs: dict[str, dict] = {}
    meshes: dict[Any, Any] = {}
    out: dict[str, Any] = {"errors": cp_errors(rank, world)} if errors else {}
    for label, model_name, cp, wrap in jobs:
        t0 = time.perf_counter()
        if model_name not in refs:
            refs[model_name] = rc.reference(model_name, steps)
        ref = refs[model_name]
        if cp not in meshes:
            meshes[cp] = _mesh(cp)
        mesh, flat = meshes[cp]
        dp = world // cp
        model = MODELS[model_name](0)
        hf = hasattr(model, "can_generate")
        if wrap == "stages-ddp":
            stages = _stages(model, cut=1)
            ctx = apply_cp(stages.first, mesh["cp"], seq_len=rc.SEQ)
            apply_cp(stages.last, mesh["cp"], seq_len=rc.SEQ)
            net = DDP(stages, process_group=flat.get_group())
        elif wrap.startswith("tp"):
            # tensor (and sequence) parallelism over "tp", then CP over "cp" (keys and
            # values of the local heads), then FSDP2 over the cp group (dp = 1)
            mesh2 = meshes.setdefault(("cp", "tp", cp), _cp_tp_mesh(cp))
            _tensor_parallel(model, model_name, mesh2["tp"], sequence_parallel=wrap == "tp-sp",
                             graph=(graphs or {}).get(model_name))
            ctx = apply_cp(model, mesh2["cp"], seq_len=rc.SEQ)
            for block in (model.model.layers if hf else model.blocks):
                fully_shard(block, mesh=mesh2["cp"])
            net = fully_shard(model, mesh=mesh2["cp"])
            dp = 1
        else:
            ctx = apply_cp(model, mesh["cp"], seq_len=rc.SEQ)
            if wrap == "ddp":
                net = DDP(model, process_group=flat.get_group())
            elif wrap == "fsdp":
                for block in (model.model.layers if hf else model.blocks):
                    fully_shard(block, mesh=flat)
                net = fully_shard(model, mesh=flat)
            else:
                raise ValueError(f"unknown wrap {wrap!r}")
        opt = rc.make_optimizer(net.parameters())
        loss_fn = ctx.loss()
        rows = rc.GLOBAL_BATCH // dp
        d = mesh.get_local_rank("dp") if dp > 1 else 0
        batch = ctx.shard(rc.make_batch()[d * rows:(d + 1) * rows])
        loss_err = param_err = 0.0
        for step in range(1, steps + 1):
            out_ = net(input_ids=batch.ids, use_cache=False) if hf and wrap != "stages-ddp" \
                else net(batch.ids)
            loss = loss_fn(model_output(out_), batch.targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # the step's loss: mean over the dp x cp ranks
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            want = torch.tensor(ref["losses"][step - 1])
            torch.testing.assert_close(mean, want, atol=rc.ATOL, rtol=rc.ATOL,
                                       msg=lambda m: f"{label}: loss of step {step}: {m}")
            loss_err = max(loss_err, rc._max_err(mean, want))
            if step in (1, steps):
                sd = _full_state(net.module if isinstance(net, DDP) else net)
                if wrap == "stages-ddp":
                    sd = {k.split(".", 1)[1]: v for k, v in sd.items()}
                expected = ref["params"][step]
                if set(sd) != set(expected):
                    raise AssertionError(f"{label}: state dict keys differ: "
                                         f"{sorted(set(sd) ^ set(expected))[:5]}")
                for k, v in expected.items():
                    torch.testing.assert_close(sd[k], v, atol=rc.ATOL, rtol=rc.ATOL,
                                               msg=lambda m: f"{label}: {k} after step {step}: {m}")
                    param_err = max(param_err, rc._max_err(sd[k], v))
        out[label] = {"loss_err": loss_err, "param_err": param_err,
                      "seconds": time.perf_counter() - t0}
    return out


def _cp_tp_mesh(cp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (cp, dist.get_world_size() // cp), mesh_dim_names=("cp", "tp"))


def _tensor_parallel(model, model_name: str, tp_mesh, *, sequence_parallel: bool,
                     graph: str | None = None) -> None:
    """The runtime's tensor parallelism (autoplan.runtime.tp) from the model's capture."""
    from autoplan import trace
    from autoplan.graph import LayerKind, ModelGraph
    from autoplan.runtime.adapters import adapter_for
    from autoplan.runtime.tp import apply_tp

    graph = (ModelGraph.from_json(graph) if graph is not None
             else trace(MODELS[model_name](0), seq_len=rc.SEQ))
    first = next(l.name for l in graph.layers if l.kind is LayerKind.BLOCK)
    apply_tp(model, [(l, l.name) for l in graph.layers], tp_mesh,
             sequence_parallel=sequence_parallel, first_block=first,
             region_kwargs=adapter_for(model).region_kwargs)


def _full_state(module) -> dict[str, torch.Tensor]:
    """Every entry of the state dict as a plain full tensor (FSDP2's DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}
