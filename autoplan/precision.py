"""What a precision recipe runs: the dtypes of one training step, read by both sides.

The cost model prices, and :func:`autoplan.parallelize` runs, one program per
recipe (:class:`~autoplan.strategy.Precision`) and gradient-reduction dtype
(:attr:`autoplan.cost.CostOptions.grad_reduce_dtype`, which the software stack
states).  Under ``bf16`` that program is torchtitan's, built on FSDP2's
``MixedPrecisionPolicy``:

==================  =====================================================================
tensor              dtype
==================  =====================================================================
master weights      fp32, the parameters the optimizer updates (sharded under ZeRO-1/2/3)
compute weights     bf16 copies, made when a unit's parameters are gathered (ZeRO-3: every
                    forward and backward; ZeRO-0/1/2: once a step) and freed after its backward
activations         bf16 between operators (norms and softmax may upcast inside, as the
                    model does); so every tensor-, sequence-, context-, pipeline- and
                    expert-parallel transfer moves 2 bytes an element
weight gradients    bf16 as autograd makes them, then ``grad_reduce`` for the data-parallel
                    reduction, the accumulation over micro-batches and the optimizer
optimizer states    fp32 (Adam's two moments)
==================  =====================================================================

``fp32`` runs everything in fp32.  ``fp16`` (which needs loss scaling) and ``fp8`` are
priced only (:func:`autoplan.runtime.parallelize.check_runnable_precision`).

Examples
--------
>>> p = precision_program("bf16", grad_reduce="fp32")
>>> p.compute, p.master, p.grad_reduce, p.activation_bytes, p.grad_reduce_bytes
('bf16', 'fp32', 'fp32', 2, 4)
>>> precision_program("fp32").compute
'fp32'
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .strategy import Precision

__all__ = ["DTYPE_BYTES", "GRAD_REDUCE_DTYPES", "PrecisionProgram", "precision_program",
           "torch_dtype"]

#: Bytes per element of the dtypes a program names.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

#: The dtypes data-parallel gradients may be reduced in (``CostOptions.grad_reduce_dtype``).
GRAD_REDUCE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class PrecisionProgram:
    """The dtypes of one training step under a recipe (see the module docstring).

    Attributes
    ----------
    precision : Precision
    compute : str
        Weights as the matmuls read them, and the activations between operators.
    master : str
        Weights the optimizer updates.
    grad_reduce : str
        Weight gradients as the data-parallel ranks reduce them, as they accumulate over
        micro-batches and as the optimizer reads them.
    optimizer_state : str
        Adam's moments.
    """

    precision: Precision
    compute: str
    master: str
    grad_reduce: str
    optimizer_state: str = "fp32"

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a 16-bit (or narrower) dtype over fp32 master weights."""
        return self.compute != self.master

    @property
    def activation_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def compute_param_bytes(self) -> int:
        """Bytes per parameter of the weights as computed with (and all-gathered)."""
        return DTYPE_BYTES[self.compute]

    @property
    def master_param_bytes(self) -> int:
        return DTYPE_BYTES[self.master]

    @property
    def grad_reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.grad_reduce]


def precision_program(precision: Precision | str, grad_reduce: str = "fp32") -> PrecisionProgram:
    """The program of ``precision`` with gradients reduced in ``grad_reduce``.

    FP8 recipes compute their weight GEMMs in FP8 and everything else as ``bf16``
    does; the program here is that of the rest (the GEMMs' casts are the cost model's
    FP8 terms).
    """
    precision = Precision(precision)
    if grad_reduce not in GRAD_REDUCE_DTYPES:
        raise ConfigError(f"grad_reduce_dtype must be one of {', '.join(GRAD_REDUCE_DTYPES)}, "
                          f"got {grad_reduce!r}")
    if precision is Precision.FP32:
        return PrecisionProgram(precision, "fp32", "fp32", "fp32")
    compute = "fp16" if precision is Precision.FP16 else "bf16"
    return PrecisionProgram(precision, compute, "fp32", grad_reduce)


def torch_dtype(name: str):
    """The torch dtype of a program's dtype name (imports torch)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
