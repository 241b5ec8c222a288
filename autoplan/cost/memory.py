"""Memory formulas: saved activations of one layer, model states per ZeRO stage.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Sec. 4, Table 2), from a layer's captured saved bytes
split three ways (:class:`~autoplan.cost.summary.LayerCost`):

* ``R`` saved outside tensor-parallel regions (layer norms, dropout masks,
  the inputs of the column-parallel linears): divided by ``tp`` only under
  sequence parallelism;
* ``S`` saved inside them and linear in the sequence: divided by ``tp``;
* ``Q`` the attention core's ``s x s`` tensors: divided by ``tp``; dropped by
  selective recompute and by a fused attention kernel.

So ``act = R / (tp if sp else 1) + (S + Q) / tp``; for Megatron's GPT layer
(``R = 10 sbh``, ``S = 24 sbh``, ``Q = 5 a s^2 b``) this is exactly
``sbh (10 + 24/t + 5as/(ht))`` (tensor parallel), ``sbh/t (34 + 5as/h)``
(with sequence parallel) and ``34 sbh / t`` (plus selective recompute).  Full
recompute keeps only each layer's input, ``2 sbh`` (``/t`` with sequence
parallelism, whose checkpoint is the sharded input).  Context parallelism
divides everything by ``cp`` (each rank holds ``s / cp`` tokens).

Model states per parameter (Rajbhandari et al. 2020, Sec. 5): ZeRO-1
partitions the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also the
parameters, over the ``dp * cp`` ranks.

Examples
--------
>>> model_state_bytes(1000, zero=0, shards=4, per_param=(2, 2, 12))
(2000.0, 2000.0, 12000.0)
>>> model_state_bytes(1000, zero=3, shards=4, per_param=(2, 2, 12))
(500.0, 500.0, 3000.0)
"""

from __future__ import annotations

from ..strategy import Recompute
from .summary import LayerCost

__all__ = ["activation_bytes", "model_state_bytes", "fsdp2_state_bytes"]


def activation_bytes(layer: LayerCost, *, tp: int = 1, sequence_parallel: bool = False,
                     recompute: Recompute = Recompute.NONE, cp: int = 1,
                     fused_attention: bool = False) -> float:
    """Saved activation bytes of ``layer`` per sequence on one device (captured dtype).

    See the module docstring for the formula (Korthikanti et al. 2022, Sec. 4).
    Recompute applies to blocks only (embeddings and heads are never recomputed).
    """
    drop_quadratic = fused_attention or (recompute is Recompute.SELECTIVE and layer.is_block)
    quad = 0.0 if drop_quadratic else layer.saved_quadratic_bytes
    outside = layer.saved_replicated_bytes / (tp if sequence_parallel else 1)
    whole = (outside + (layer.saved_sharded_bytes + quad) / tp) / cp
    if recompute is Recompute.FULL and layer.is_block:
        # the checkpoint is the layer's input, never more than the layer saves anyway
        return min(whole, layer.stream_bytes / ((tp if sequence_parallel else 1) * cp))
    return whole


def model_state_bytes(params: float, *, zero: int, shards: int,
                      per_param: tuple[int, int, int]) -> tuple[float, float, float]:
    """``(parameter, gradient, optimizer)`` bytes of ``params`` parameters on one device.

    ``per_param`` is ``(param, grad, optimizer)`` bytes per parameter; ``shards``
    the number of ranks ZeRO partitions over (Rajbhandari et al. 2020, Sec. 5).
    """
    pb, gb, ob = per_param
    return (params * pb / (shards if zero >= 3 else 1),
            params * gb / (shards if zero >= 2 else 1),
            params * ob / (shards if zero >= 1 else 1))


def fsdp2_state_bytes(params: float, *, zero: int, shards: int, master_bytes: int,
                      compute_bytes: int, grad_bytes: int, optimizer_bytes: int,
                      accumulates: bool) -> tuple[float, float, float]:
    """``(parameter, gradient, optimizer)`` bytes of ``params`` parameters on one device
    during a step, as FSDP2 holds them under a ``MixedPrecisionPolicy``
    (``CostOptions.master_weights == "fsdp2"``, :mod:`autoplan.precision`).

    The parameters are the master weights (``master_bytes``), sharded over ``shards``
    ranks under ZeRO-1/2/3 (``fully_shard``; whole under ZeRO-0's ``replicate``).  Their
    ``compute_bytes`` copies are gathered for the forward and kept until the last
    micro-batch's backward under ZeRO-0/1/2 (``reshard_after_forward=False``); under
    ZeRO-3 only the layers being computed hold them (the engine's gathered-layer
    buffers, not counted here).  Gradients (``grad_bytes``, the reduction dtype) are
    whole under ZeRO-0; under ZeRO-1 whole while they accumulate over micro-batches
    (no reduce-scatter before the last), else sharded as under ZeRO-2/3.  The
    optimizer's moments shard with the parameters.

    >>> fsdp2_state_bytes(1000, zero=1, shards=4, master_bytes=4, compute_bytes=2,
    ...                   grad_bytes=4, optimizer_bytes=8, accumulates=True)
    (3000.0, 4000.0, 2000.0)
    >>> fsdp2_state_bytes(1000, zero=3, shards=4, master_bytes=4, compute_bytes=2,
    ...                   grad_bytes=4, optimizer_bytes=8, accumulates=True)
    (1000.0, 1000.0, 2000.0)
    """
    split = shards if zero >= 1 else 1
    held = params * master_bytes / split + (params * compute_bytes if zero <= 2 else 0.0)
    whole_grads = zero == 0 or (zero == 1 and accumulates)
    return held, params * grad_bytes / (1 if whole_grads else shards), \
        params * optimizer_bytes / split
