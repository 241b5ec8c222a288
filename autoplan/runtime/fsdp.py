"""Data parallelism: DDP, ``replicate`` and FSDP2 ``fully_shard`` with a ZeRO stage per layer.

How the ZeRO stages (Rajbhandari et al. 2020) map onto FSDP2, per layer:

========  ==========================  =====================  ==============================
ZeRO      reshard_after_forward       reshard after backward  gradient reduce-scatter
========  ==========================  =====================  ==============================
3         True (params P/dp)          every micro-batch       every micro-batch
2         False                       last micro-batch only   every micro-batch
1         False                       last micro-batch only   last micro-batch only
========  ==========================  =====================  ==============================

In all three the optimizer states and the gradients the optimizer reads are
sharded (``P/dp``).  ZeRO-2 and ZeRO-1 keep the gathered parameters for the
whole step (gathered once, as DeepSpeed does); ZeRO-1 additionally
accumulates full gradients locally over the micro-batches and reduce-scatters
them once per step, which moves the same bytes as ZeRO-1's all-reduce plus
parameter all-gather.  FSDP2 has no exact ZeRO-1 (parameters are resharded
between steps), so the memory of this ZeRO-1 between steps is that of ZeRO-3;
during the step it is ZeRO-1's.

Every wrapper takes the plan's precision policy (:mod:`.precision`): under bf16 the
parameters stay fp32 master weights and FSDP2 casts them to bf16 when it gathers a unit.

Pure data parallelism of an fp32 plan uses DDP without pipelining and torch's FSDP-based
``replicate`` with it (or with tensor parallelism).  DDP or
``reshard_after_forward=True`` with a zero-bubble schedule gives silently wrong
gradients in torch 2.13, so plans never combine ZeRO-3 with zero-bubble
schedules (:data:`autoplan.strategy.ZBV_ZERO3`) and pipelines use ``replicate``.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

__all__ = ["apply_fsdp", "apply_replicate", "apply_ddp", "apply_expert_dp", "set_micro_batch_sync"]


_FP32 = MixedPrecisionPolicy()


def apply_fsdp(root: nn.Module, layers: Sequence[tuple[nn.Module, int]], dp_mesh: DeviceMesh, *,
               root_zero: int, mp_policy: MixedPrecisionPolicy = _FP32) -> None:
    """``fully_shard`` every layer module (with its ZeRO stage), then the root, which
    takes the parameters no layer owns (embeddings, final norm, head); all under
    ``mp_policy`` (:mod:`.precision`)."""
    for module, zero in layers:
        if not any(True for _ in module.parameters()):
            continue   # nothing to shard (an activation layer of an nn.Sequential)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp_policy)
        module._autoplan_zero = zero  # type: ignore[attr-defined]
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=root_zero == 3, mp_policy=mp_policy)
    root._autoplan_zero = root_zero  # type: ignore[attr-defined]


def apply_expert_dp(modules: Sequence[tuple[nn.Module, int]], edp_mesh: DeviceMesh, *,
                    mp_policy: MixedPrecisionPolicy = _FP32) -> None:
    """Data parallelism of expert-parallel modules (:mod:`.ep`) over their ``edp`` replicas,
    before the enclosing layer and the root take the dense parameters over ``dp x cp``.

    ZeRO 0 replicates (gradients all-reduced at the last micro-batch), ZeRO 1-3 shard as
    :func:`apply_fsdp` does.  Their banks are already ``Shard(0)`` over the ep mesh; FSDP
    shards them over ``edp`` on dimension 1 (a plain 2-D ``(Shard(1), Shard(0))`` layout
    rather than a strided shard of dimension 0, which E / ep < edp would pad).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.tensor import Shard

    def placement(p: nn.Parameter) -> Shard:
        return Shard(1 if p.dim() > 1 else 0)

    for module, zero in modules:
        if zero == 0:
            replicate(module, mesh=edp_mesh, mp_policy=mp_policy)
        else:
            fully_shard(module, mesh=edp_mesh, reshard_after_forward=zero == 3,
                        shard_placement_fn=placement, mp_policy=mp_policy)
        module._autoplan_zero = zero  # type: ignore[attr-defined]


def apply_replicate(root: nn.Module, dp_mesh: DeviceMesh, *,
                    mp_policy: MixedPrecisionPolicy = _FP32) -> nn.Module:
    """torch's FSDP-based ``replicate`` (gradients all-reduced; works with DTensor params
    and with every pipeline schedule), under ``mp_policy``.  On a one-rank mesh it reduces
    nothing and only installs the policy (a plan without data parallelism)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(root, mesh=dp_mesh, mp_policy=mp_policy)
    # ZeRO-0 for set_micro_batch_sync: accumulate locally, all-reduce at the last
    # micro-batch only (once per step, as priced; replicas running different numbers of
    # micro-batches then issue the same collectives)
    root._autoplan_zero = 0  # type: ignore[attr-defined]
    return root


def apply_ddp(root: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Classic DDP (no ``device_ids`` on CPU) over the data-parallel group.  Buffers are
    synchronised once, when it wraps the model, not broadcast from rank 0 before each
    forward (``forward_sync_buffers=False``): every rank builds them alike, and FSDP2's
    wrappers, which run every other layout, do not broadcast them either, so every layout
    moves the same bytes for them in a step (none)."""
    return DistributedDataParallel(root, process_group=dp_mesh.get_group(),
                                   forward_sync_buffers=False)


def set_micro_batch_sync(root: nn.Module, last: bool) -> None:
    """Before a micro-batch's backward: reduce gradients and reshard parameters as each
    layer's ZeRO stage asks (table above)."""
    for m in root.modules():
        if not isinstance(m, FSDPModule):
            continue
        zero = getattr(m, "_autoplan_zero", 3)
        m.set_requires_gradient_sync(last or zero >= 2, recurse=False)
        m.set_reshard_after_backward(last or zero == 3, recurse=False)
