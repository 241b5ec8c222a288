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

``fp32`` runs everything in fp32.  ``fp16`` (which needs loss scaling) is priced only
(:func:`autoplan.runtime.parallelize.check_runnable_precision`).

The FP8 recipes (``fp8``, ``fp8-rowwise``, ``fp8-blockwise``) run the bf16 program
above, master weights, gradients and optimizer states included, and compute the GEMMs
of some linears in FP8 (:func:`fp8_linears`, the one rule the cost model and
:func:`autoplan.parallelize` both read): each of those quantizes its input, its weight
and its output gradient to FP8 (e4m3 forward, e5m2 gradients under tensorwise scaling,
e4m3 throughout rowwise) with scales from their absolute maxima, and multiplies them at
the device's FP8 rate.  Which linears, and how their scales are made and reduced,
depend on the library that runs them (:data:`FP8_LIBRARIES`): torchao's float8
training (the ``autoplan`` stack) or Transformer Engine (``megatron-core``).  Under
torchao's tensorwise recipe, ZeRO-3 all-gathers those linears' weights in FP8
(:func:`fp8_all_gather`), one byte a parameter.

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
           "torch_dtype", "FP8_ALIGNMENT", "FP8_LIBRARIES", "fp8_converts", "fp8_linears",
           "fp8_all_gather", "fp8_problem"]

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

    FP8 recipes compute the GEMMs of :func:`fp8_linears` in FP8 and everything else as
    ``bf16`` does; the program here is that of the rest (the GEMMs' casts are the cost
    model's FP8 terms, :mod:`autoplan.cost.fp8`).
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


# ---------------------------------------------------------------------- FP8
#: Every dimension of an FP8 GEMM is a multiple of this: ``torch._scaled_mm`` (cuBLASLt's
#: FP8 kernels) requires it, and torchao's and torchtitan's filters leave a linear whose
#: in or out features are not one in bf16 (``torchao.float8`` ``_auto_filter_for_recipe``;
#: torchtitan ``components/quantization/utils.module_filter_fn``).
FP8_ALIGNMENT = 16

#: The libraries that run FP8 recipes (``CostOptions.fp8_library``), and the scalings each
#: offers (:attr:`autoplan.strategy.Precision.fp8_scaling`).  torchao 0.18's float8 training
#: (``Float8LinearRecipeName``): tensorwise and rowwise.  Transformer Engine: current
#: per-tensor scaling (``Float8CurrentScaling``) and block scaling (``MXFP8BlockScaling``,
#: ``Float8BlockScaling``).
FP8_LIBRARIES: dict[str, tuple[str, ...]] = {"torchao": ("tensor", "row"),
                                             "transformer-engine": ("tensor", "block")}

#: Linear roles whose GEMMs each library runs in FP8 (:func:`fp8_converts`)
_FP8_ROLES = {
    # the linears of the blocks tensor parallelism splits (torchtitan's float8 converter
    # with its filter of the output head: the vocabulary head, the router and the experts
    # stay bf16; torchao 0.18 has no FP8 grouped GEMM for training that torch 2.13's
    # wheels run)
    "torchao": frozenset({"column", "row"}),
    # Megatron-Core's Transformer Engine layers: the blocks' linears and the experts'
    # grouped GEMMs (TEGroupedLinear); the router and the output layer are not TE modules
    "transformer-engine": frozenset({"column", "row", "expert_column", "expert_row"}),
}


def fp8_problem(precision: Precision | str, library: str) -> str | None:
    """Why ``library`` cannot run ``precision``, or None (also for recipes that are not FP8).

    >>> fp8_problem("fp8-blockwise", "torchao")
    "precision='fp8-blockwise' scales FP8 by blocks, which torchao does not run (its recipes: fp8 and fp8-rowwise); use stack 'megatron-core' (Transformer Engine) or another recipe"
    """
    precision = Precision(precision)
    if not precision.is_fp8:
        return None
    if library not in FP8_LIBRARIES:
        return (f"fp8_library must be one of {', '.join(FP8_LIBRARIES)}, got {library!r}")
    scalings = FP8_LIBRARIES[library]
    if precision.fp8_scaling in scalings:
        return None
    recipes = [p.value for p in Precision if p.fp8_scaling in scalings]
    other = next(name for name, s in FP8_LIBRARIES.items() if precision.fp8_scaling in s)
    stack = "megatron-core" if other == "transformer-engine" else "autoplan"
    return (f"precision={precision.value!r} scales FP8 by {precision.fp8_scaling}s, which "
            f"{library} does not run (its recipes: {' and '.join(recipes)}); use stack "
            f"{stack!r} ({'Transformer Engine' if other == 'transformer-engine' else other}) "
            "or another recipe")


def fp8_converts(role: str, in_features: int, out_features: int, num_experts: int = 1,
                 library: str = "torchao") -> bool:
    """Whether ``library`` runs the GEMMs of a linear of ``role`` (a
    :class:`~autoplan.graph.LinearRole` value) and these features in FP8: its role is one
    the library converts (the blocks' column and row linears; with Transformer Engine the
    experts' too) and both features are multiples of :data:`FP8_ALIGNMENT`.

    >>> fp8_converts("column", 4096, 14336), fp8_converts("column", 4096, 1000)
    (True, False)
    >>> fp8_converts("vocab_head", 4096, 128256), fp8_converts("expert_column", 4096, 14336, 8)
    (False, False)
    """
    role = getattr(role, "value", role)
    if role not in _FP8_ROLES[library]:
        return False
    if num_experts > 1 and library == "torchao":
        return False
    return in_features % FP8_ALIGNMENT == 0 and out_features % FP8_ALIGNMENT == 0


def fp8_linears(layer, library: str = "torchao") -> tuple[str, ...]:
    """The linears of ``layer`` (a :class:`~autoplan.graph.LayerRecord`) whose GEMMs run
    in FP8 under ``library`` (:func:`fp8_converts`), by module path relative to the layer
    (a block's) or the model (the other layers'), as the capture names them."""
    return tuple(l.name for l in layer.tp.linears
                 if fp8_converts(l.role, l.in_features, l.out_features, l.num_experts, library))


def fp8_all_gather(precision: Precision | str, zero: int, shards: int) -> bool:
    """Whether FSDP2 all-gathers the FP8 linears' weights of a layer with ZeRO stage
    ``zero`` over ``shards`` ranks in FP8 (torchao's ``enable_fsdp_float8_all_gather``):
    under the tensorwise recipe (its one scale a tensor comes from one all-reduce of the
    weights' absolute maxima a step, ``precompute_float8_dynamic_scale_for_fsdp``) and
    ZeRO-3, which gathers every micro-batch; ZeRO-1/2 gather once a step, in bf16.

    >>> fp8_all_gather("fp8", 3, 8), fp8_all_gather("fp8-rowwise", 3, 8), fp8_all_gather("fp8", 1, 8)
    (True, False, False)
    """
    return Precision(precision).fp8_scaling == "tensor" and zero == 3 and shards > 1
