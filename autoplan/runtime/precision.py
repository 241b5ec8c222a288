"""The precision policy :func:`autoplan.parallelize` installs: FSDP2's ``MixedPrecisionPolicy``.

A 16-bit plan runs as :mod:`autoplan.precision` describes, the way torchtitan runs
bf16: the parameters stay fp32 (the master weights the optimizer updates, sharded
by ZeRO-1/2/3), FSDP2 casts them to bf16 when it gathers a unit for compute, every
floating input of a unit is cast to bf16, so activations are bf16 from the
embedding to the logits and every tensor-, sequence-, context-, pipeline- and
expert-parallel transfer moves bf16; the weight gradients autograd produces in bf16
are reduced, accumulated over micro-batches and stepped in the dtype the
``autoplan`` stack states (``CostOptions.grad_reduce_dtype``, fp32).

The data-parallel wrapper installs the policy on every layout: ``fully_shard``
(ZeRO-1/2/3) and ``replicate`` (ZeRO-0, pipelines, tensor and expert
parallelism) take it directly; a plan without data parallelism gets
``replicate`` over its one-rank ``dp`` mesh, which reduces nothing; DDP's own
mixed precision needs CUDA events, so 16-bit plans never use DDP
(:func:`autoplan.strategy.uses_ddp`).  No ``torch.autocast``: it would leave the
residual stream, and with it every transfer, in fp32, and it does not cast
``torch._grouped_mm``'s inputs (MoE experts would run in fp32).
"""

from __future__ import annotations

from torch.distributed.fsdp import MixedPrecisionPolicy

from ..precision import precision_program, torch_dtype
from ..strategy import Precision

__all__ = ["mixed_precision_policy", "FP32_POLICY", "STACK"]

#: The software stack whose :class:`~autoplan.cost.CostOptions` describe what the runtime
#: runs (its ``grad_reduce_dtype`` is the policy's ``reduce_dtype``).
STACK = "autoplan"

#: No casting: an fp32 plan's wrappers.
FP32_POLICY = MixedPrecisionPolicy()


def mixed_precision_policy(precision: Precision | str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``precision`` as the ``autoplan`` stack runs it, or None in fp32.

    >>> mixed_precision_policy("bf16")
    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=True)
    """
    from ..cost.constants import STACKS

    program = precision_program(precision, STACKS[STACK].settings["grad_reduce_dtype"])
    if not program.mixed:
        return None
    return MixedPrecisionPolicy(param_dtype=torch_dtype(program.compute),
                                reduce_dtype=torch_dtype(program.grad_reduce))
