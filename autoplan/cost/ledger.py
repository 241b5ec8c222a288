"""The ledger of a step: what each device moves over each group and computes, as priced.

The cost engine prices a layout from bytes and FLOPs; the ledger lists them, per
device, so that the program :func:`autoplan.parallelize` runs can be checked against
the estimate operator by operator (:mod:`autoplan.runtime.ledger` records the same
quantities from a real step).  The engine fills it from the very figures it prices
(:meth:`autoplan.cost.engine.CostEngine.ledger`): a collective in the ledger is one
the estimate paid for, with the bytes it paid for.

Bytes of a collective, per call on one device (the same definitions on both sides):

==============  ============================================================
kind            bytes
==============  ============================================================
all_reduce      the tensor reduced
all_gather      the gathered (output) tensor
reduce_scatter  the input tensor, before the reduction
all_to_all      the whole send buffer (the part a rank keeps included)
send            the tensor sent to another pipeline stage (receives mirror it)
==============  ============================================================

Groups are named by the mesh dimension they span: ``tp``, ``cp``, ``ep``, ``dp`` (the
data-parallel group, ``dp x cp`` ranks: parameters are replicated over context
parallelism too), ``edp`` (the ranks holding the same experts), ``pp`` (pipeline
sends), ``tied`` (the first and last stages holding a tied embedding) and ``world``.

FLOPs are those of the matmuls (linear layers, attention scores and values, expert
GEMMs) of each layer on one device per step: forward, backward (input and weight
gradients) and the recomputed forward, as the engine prices them (sharded by tensor
and context parallelism, an attention core under a causal fused kernel at the part
of its blocks the kernel computes).  Under an FP8 recipe a layer lists the GEMMs of its
converted linears as ``fp8`` and the rest (attention, the head) as ``bf16``; its
scale all-reduces (float64, fp32) and FP8 all-gathers (``fp8``, or ``uint8`` where FSDP2
gathers FP8 weights and bf16 ones in one byte buffer) are in ``transfers`` with
term ``fp8`` or their parallelism's (:mod:`autoplan.cost.fp8`).

Examples
--------
>>> from autoplan import Strategy, trace
>>> from autoplan.models import GPT, GPTConfig
>>> from autoplan.hardware import load_cluster
>>> from autoplan.cost.engine import CostEngine
>>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)), seq_len=16)
>>> ledger = CostEngine(g, load_cluster("a100-sxm4-80gb")).ledger(Strategy(dp=8, global_batch=8))
>>> [(t.kind, t.group, t.dtype) for t in ledger.of_device(0).transfers]
[('all_reduce', 'dp', 'fp32'), ('all_reduce', 'world', 'float64')]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..records import Record

__all__ = ["Transfer", "LayerFlops", "DeviceLedger", "Ledger", "LedgerBuilder"]

#: Collective kinds a ledger names.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


@dataclass(frozen=True)
class Transfer(Record):
    """One kind of collective of one device in one step, summed over its calls.

    ``term``: the priced term it belongs to (``tp``, ``sp_grads``, ``cp``, ``ep``,
    ``zero`` (ZeRO-2/3's per-micro-batch collectives), ``dp_step`` (the once-a-step
    gradient reduction and parameter gather), ``pp``, ``tied``, ``loss``).
    """

    kind: str
    group: str
    dtype: str
    bytes: float
    calls: float
    term: str


@dataclass(frozen=True)
class LayerFlops(Record):
    """Matmul FLOPs of one layer on one device in one step."""

    layer: str
    dtype: str
    forward: float
    backward: float
    recompute: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


@dataclass(frozen=True)
class DeviceLedger(Record):
    """What each of ``devices`` (one pipeline rank of replicas priced alike: every one of
    them moves and computes the same) moves and computes in one step."""

    pipeline_rank: int
    devices: tuple[int, ...]
    micro_batches: int
    transfers: tuple[Transfer, ...]
    flops: tuple[LayerFlops, ...]

    def totals(self) -> dict[tuple[str, str, str], tuple[float, float]]:
        """``(kind, group, dtype) -> (bytes, calls)`` per step, every term summed."""
        out: dict[tuple[str, str, str], tuple[float, float]] = {}
        for t in self.transfers:
            b, c = out.get((t.kind, t.group, t.dtype), (0.0, 0.0))
            out[t.kind, t.group, t.dtype] = (b + t.bytes, c + t.calls)
        return out

    def flops_by_dtype(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for f in self.flops:
            out[f.dtype] = out.get(f.dtype, 0.0) + f.total
        return out


@dataclass(frozen=True)
class Ledger(Record):
    """Every device's :class:`DeviceLedger` of a layout's step."""

    ranks: tuple[DeviceLedger, ...] = field(default=())

    def of_device(self, device: int) -> DeviceLedger:
        """The ledger of ``device``.

        Raises
        ------
        KeyError
            When the layout does not use ``device``.
        """
        for r in self.ranks:
            if device in r.devices:
                return r
        raise KeyError(f"device {device} is in no pipeline rank of this layout")


class LedgerBuilder:
    """Collects one pipeline rank's ledger while the engine prices it (engine use)."""

    def __init__(self, act_dtype: str, grad_dtype: str, param_dtype: str,
                 matmul_dtype: str, fp8: bool = False) -> None:
        #: dtypes of the activations (and their gradients) a transfer moves, of the
        #: weight gradients reduced, of the weights gathered, and of the matmuls; ``fp8``:
        #: an FP8 recipe, whose converted GEMMs are listed as ``fp8``
        self.act_dtype, self.grad_dtype, self.param_dtype = act_dtype, grad_dtype, param_dtype
        self.dtype = matmul_dtype
        self.fp8 = fp8
        self._per_micro_batch: dict[tuple[str, str, str, str], list[float]] = {}
        self._per_step: dict[tuple[str, str, str, str], list[float]] = {}
        self._flops: dict[tuple[str, str], list[float]] = {}

    def volumes(self, volumes, count: int) -> None:
        """``count`` layers' collectives per micro-batch, ``(kind, group, dtype, bytes,
        calls, term)`` each as :meth:`CostEngine._layer_terms` priced them."""
        for kind, group, dtype, nbytes, calls, term in volumes:
            self.per_micro_batch(kind, group, dtype, nbytes, calls * count, term)

    def flops(self, layer: str, forward: float, backward: float, recompute: float,
              dtype: str | None = None) -> None:
        """One layer's matmul FLOPs per micro-batch (in ``dtype``, default the builder's)."""
        if dtype is not None and forward + backward + recompute <= 0:
            return
        acc = self._flops.setdefault((layer, dtype or self.dtype), [0.0, 0.0, 0.0])
        acc[0] += forward
        acc[1] += backward
        acc[2] += recompute

    def per_micro_batch(self, kind: str, group: str, dtype: str, nbytes: float, calls: float,
                        term: str) -> None:
        """A collective of every micro-batch: ``nbytes`` per call, ``calls`` calls."""
        if nbytes <= 0 or calls <= 0:
            return
        acc = self._per_micro_batch.setdefault((kind, group, dtype, term), [0.0, 0.0])
        acc[0] += nbytes * calls
        acc[1] += calls

    def per_step(self, kind: str, group: str, dtype: str, nbytes: float, calls: float,
                 term: str) -> None:
        """A collective of the step: ``nbytes`` in all over ``calls`` calls."""
        if nbytes <= 0 or calls <= 0:
            return
        acc = self._per_step.setdefault((kind, group, dtype, term), [0.0, 0.0])
        acc[0] += nbytes
        acc[1] += calls

    def build(self, pipeline_rank: int, devices: tuple[int, ...],
              micro_batches: int) -> DeviceLedger:
        m = micro_batches
        merged: dict[tuple[str, str, str, str], list[float]] = {}
        for (key, (b, c)) in self._per_micro_batch.items():
            merged[key] = [m * b, m * c]
        for (key, (b, c)) in self._per_step.items():
            acc = merged.setdefault(key, [0.0, 0.0])
            acc[0] += b
            acc[1] += c
        transfers = tuple(Transfer(kind, group, dtype, b, c, term)
                          for (kind, group, dtype, term), (b, c) in merged.items())
        flops = tuple(LayerFlops(name, dtype, m * f, m * g, m * r)
                      for (name, dtype), (f, g, r) in self._flops.items())
        return DeviceLedger(pipeline_rank, devices, m, transfers, flops)

