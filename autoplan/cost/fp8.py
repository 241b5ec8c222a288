"""What an FP8 recipe costs, as the library that runs it runs it.

An FP8 recipe (``Precision.is_fp8``) runs the bf16 program with the GEMMs of some linears
(:func:`autoplan.precision.fp8_converts`) in FP8.  Per converted linear ``y = x W^T`` of
``m`` tokens (``x``: ``m x k``, ``W``: ``n x k``, the output gradient ``dy``: ``m x n``,
``k`` and ``n`` on one rank after tensor parallelism), the cost engine
(:mod:`autoplan.cost.compute` and :mod:`autoplan.cost.comm`) prices:

* the three GEMMs at the device's FP8 rate (peak times the ``fp8`` efficiency table;
  torchao's rowwise forward GEMM at the profile's ``fp8_rowwise`` table where it measured
  one: :func:`fp8_gemm_rate`);
* the quantization of their operands, memory-bound on the device
  (:func:`cast_bytes`), which is where the libraries differ most:

  - **torchao** (``CostOptions.fp8_library="torchao"``, the ``autoplan`` stack): eager
    ``Float8Linear`` quantizes each operand for each GEMM it enters, input and weight
    twice, the output gradient twice (``matmul_with_hp_or_float8_args``: the backward
    saves the 16-bit tensors and casts them again), once each where its float8
    tensor-parallel styles cast a region's input and the output gradient before their
    collectives.  A cast is five kernels over the tensor (:data:`TORCHAO_CAST_BYTES`);
    ``torch._scaled_mm`` wants its second operand column-major, so the backward copies
    the weight, the gradient and the input transposed (:data:`FP8_TRANSPOSE_BYTES`); the
    rowwise recipe's backward GEMMs run the tensorwise kernel with unit scales and
    rescale their outputs in a pass of their own (:data:`ROWWISE_RESCALE_BYTES`).
  - **Transformer Engine** (``"transformer-engine"``): fused casts that quantize each
    operand once and write its transpose with it (:data:`TE_CAST_BYTES`).  Its weights
    are quantized once per optimizer step, not per micro-batch: Megatron-Core calls
    ``set_is_first_microbatch()`` on the model at a step's first micro-batch, and TE's
    modules then cast the weight and its transpose and cache them for the step's other
    micro-batches (``is_first_microbatch``; TE ``Linear.forward``).  Under ZeRO-3 the
    weights are gathered again for every micro-batch, and so cast again
    (:func:`te_weight_cast_bytes`).

* torchao's scale collectives, which its tensorwise scales need wherever a tensor is
  split over ranks (:func:`tp_amax_reduces`): one all-reduce of the absolute maximum per
  cast of a tensor split over the tensor-parallel group (``amax_to_scale`` upcasts it:
  8 bytes, float64); under the rowwise recipe one per row (or column) a cast reduces over
  split features; under ZeRO-3 one all-reduce a step of every FP8-gathered weight's
  maximum (``precompute_float8_dynamic_scale_for_fsdp``: fp32, 4 bytes a weight) per
  mesh dimension the weights are split over.
* torchao's FP8 all-gathers: ZeRO-3 gathers the converted weights at one byte a parameter
  (the rest of a unit at 2: FSDP2 gathers mixed dtypes as one byte buffer), each rank
  casting its fp32 shard with the precomputed scale (:data:`TORCHAO_SHARD_CAST_BYTES`)
  instead of the GEMMs casting the weight; sequence parallelism gathers a region's input,
  and in the backward the row linear's output gradient, in FP8.

Transformer Engine's amax reductions (one number per sequence-parallel gather) are not
priced: Megatron-Core overlaps them with its tensor-parallel communication.

Examples
--------
>>> lin = Fp8Linear("mlp.fc1", "column", 4096, 14336)
>>> fwd, bwd = cast_bytes(lin, "torchao", "tensor", tokens=8192, tp=1)
>>> round(fwd / 1e9, 3), round(bwd / 1e9, 3)       # GB a micro-batch on one rank
(3.045, 11.216)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..precision import fp8_converts

__all__ = ["Fp8Linear", "TORCHAO_CAST_BYTES", "TORCHAO_SHARD_CAST_BYTES", "FP8_TRANSPOSE_BYTES",
           "ROWWISE_RESCALE_BYTES", "TE_CAST_BYTES", "AMAX_BYTES", "SCALE_BYTES",
           "fp8_linears_of", "cast_bytes", "te_weight_cast_bytes", "weight_cast_bytes",
           "fp8_gemm_rate", "tp_amax_reduces", "float8_tp", "region_fp8", "FP8_ROWWISE_TABLE",
           "LayerFp8"]

#: Device-memory bytes one eager torchao cast moves per element of a 16-bit tensor
#: (``hp_tensor_to_float8_dynamic``, one kernel each): ``abs`` (read 2, write 2), ``max``
#: (read 2), the upcast ``to(float32)`` (read 2, write 4), the multiplication by the scale
#: (read 4, write 4), the saturating ``clamp`` (read 4, write 4) and the cast to FP8 (read
#: 4, write 1): 33.  From an fp32 tensor (the master weight) the upcast is free and the
#: rest reads 4: 33 as well.
TORCHAO_CAST_BYTES = 33.0
#: The same cast with its scale known (an FP8 all-gather's shard, with the scale
#: ``precompute_float8_dynamic_scale_for_fsdp`` computed): multiplication, clamp and
#: cast of an fp32 tensor, 8 + 8 + 5.
TORCHAO_SHARD_CAST_BYTES = 21.0
#: Bytes per element of an FP8 tensor copied transposed for ``torch._scaled_mm`` (read 1,
#: write 1): the backward's weight, output gradient and input (torchao ``preprocess_addmm``).
FP8_TRANSPOSE_BYTES = 2.0
#: Bytes per element of a bf16 GEMM output rescaled in place (read 2, write 2): torchao's
#: rowwise backward GEMMs (``addmm_float8_unwrapped`` without fast accumulation).
ROWWISE_RESCALE_BYTES = 4.0
#: Device-memory bytes moved per element Transformer Engine quantizes, per scaling.
#: ``"tensor"`` (current scaling, ``Float8CurrentScaling``): an amax pass reads the 16-bit
#: tensor (2 B), then the cast reads it again (2 B) and writes the FP8 copy and its
#: transpose (1 + 1 B) = 6 B.  ``"block"`` (MXFP8 1x32, Blackwell): one pass reads the
#: 16-bit tensor (2 B) and writes both FP8 layouts (1 + 1 B) plus one 8-bit scale per 32
#: elements for each (2/32 B) = 4.0625 B.  (Transformer Engine user guide, "Using FP8 with
#: Transformer Engine"; OCP Microscaling Formats (MX) v1.0 specification, Sec. 5.)
TE_CAST_BYTES = {"tensor": 6.0, "block": 4.0625}
#: Bytes of one tensorwise scale's absolute maximum as torchao all-reduces it (float64,
#: ``amax_to_scale``), and of one weight's maximum in the step's scale all-reduce (fp32).
AMAX_BYTES = 8
SCALE_BYTES = 4
#: The efficiency-table key of torchao's rowwise-scaled FP8 GEMM in a device profile
#: (``autoplan profile`` measures it on GPUs with FP8; ``VARIANT_TABLES``)
FP8_ROWWISE_TABLE = "fp8_rowwise"


@dataclass(frozen=True)
class Fp8Linear:
    """A linear whose GEMMs an FP8 recipe runs in FP8 (names and features as captured)."""

    name: str
    role: str
    in_features: int
    out_features: int
    num_experts: int = 1

    def local(self, tp: int) -> tuple[float, float]:
        """``(k, n)`` on one rank of ``tp``: column linears split ``n``, row linears ``k``."""
        if tp > 1 and self.role == "column":
            return self.in_features, self.out_features / tp
        if tp > 1 and self.role == "row":
            return self.in_features / tp, self.out_features
        return self.in_features, self.out_features

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features * self.num_experts


def fp8_linears_of(linears, library: str) -> dict[str, Fp8Linear]:
    """The converted linears among ``linears`` (``LinearRecord``\\ s of one layer), by name."""
    out = {}
    for l in linears:
        role = getattr(l.role, "value", l.role)
        if fp8_converts(role, l.in_features, l.out_features, l.num_experts, library):
            out[l.name] = Fp8Linear(l.name, role, l.in_features, l.out_features, l.num_experts)
    return out


def float8_tp(library: str, scaling: str, tp: int) -> bool:
    """Whether torchao's float8 tensor-parallel styles run (tensorwise, ``tp > 1``)."""
    return library == "torchao" and scaling == "tensor" and tp > 1


def cast_bytes(lin: Fp8Linear, library: str, scaling: str, *, tokens: float, tp: int,
               experts_tokens: float | None = None) -> tuple[float, float]:
    """Device-memory bytes one rank moves quantizing ``lin``'s operands for one micro-batch
    of ``tokens`` tokens, ``(forward, backward)`` (see the module docstring).  An expert
    bank (converted by Transformer Engine only) quantizes the ``experts_tokens`` rows its
    local experts take instead: every token-to-expert assignment, each expert's rows
    quantized for its own GEMM (``GroupedLinear``'s ``fused_multi_quantize`` over the
    per-expert splits of its input, and of its output gradient in the backward).

    >>> bank = Fp8Linear("mlp.experts.w1", "expert_column", 4096, 14336, num_experts=8)
    >>> cast_bytes(bank, "transformer-engine", "tensor", tokens=8192, tp=1,
    ...            experts_tokens=2 * 8192) == (6 * 2 * 8192 * 4096, 6 * 2 * 8192 * 14336)
    True
    """
    k, n = lin.local(tp)
    m = tokens if experts_tokens is None else experts_tokens
    weight = k * n * lin.num_experts
    if library == "transformer-engine":
        # the input forward, the output gradient backward; the weight once a step
        # (te_weight_cast_bytes)
        per = TE_CAST_BYTES[scaling]
        return per * m * k, per * m * n
    # torchao: input and weight cast for the forward GEMM and again for the backward's;
    # the output gradient for each backward GEMM; once each under its float8 TP styles
    styled = float8_tp(library, scaling, tp)
    fwd = TORCHAO_CAST_BYTES * (m * k + weight)
    bwd = TORCHAO_CAST_BYTES * (weight + (1 if styled else 2) * m * n
                                + (0 if styled else m * k))
    bwd += FP8_TRANSPOSE_BYTES * (weight + m * n + m * k)
    if scaling == "row":
        bwd += ROWWISE_RESCALE_BYTES * (m * k + weight)
    return fwd, bwd


def te_weight_cast_bytes(lin: Fp8Linear, scaling: str, tp: int, ep: int = 1) -> float:
    """Device-memory bytes Transformer Engine moves quantizing ``lin``'s weight (and its
    transpose) on one rank: once per optimizer step where the weights stay resident
    (its FP8 weight cache, module docstring), once per micro-batch under ZeRO-3.  An
    expert bank's weights are those of the rank's ``1/ep`` of its experts.

    >>> lin = Fp8Linear("mlp.fc1", "column", 4096, 14336)
    >>> te_weight_cast_bytes(lin, "tensor", tp=1) / 1e6           # 6 B per weight
    352.321536
    """
    k, n = lin.local(tp)
    experts = lin.num_experts / ep if lin.num_experts > 1 else 1
    return TE_CAST_BYTES[scaling] * k * n * experts


def weight_cast_bytes(lin: Fp8Linear, tp: int) -> float:
    """The part of torchao's :func:`cast_bytes` that quantizes the weight (forward and
    backward), which an FP8 all-gather replaces by the cast of the rank's shard."""
    k, n = lin.local(tp)
    return 2 * TORCHAO_CAST_BYTES * k * n


def fp8_gemm_rate(device, flops: float, *, rowwise: bool = False) -> float:
    """FLOP/s of one FP8 GEMM of ``flops`` on ``device``: its FP8 peak times the ``fp8``
    efficiency table, or, for torchao's rowwise forward GEMM (``rowwise``), the profile's
    measured ``fp8_rowwise`` table where it has one (else the ``fp8`` table: no published
    rowwise rate for the datasheet profiles)."""
    peak = device.peak("fp8")
    table = device.matmul_efficiency.get(FP8_ROWWISE_TABLE) if rowwise else None
    if table is not None:
        return peak * table.efficiency(flops)
    return peak * device.efficiency(flops, "fp8")


def tp_amax_reduces(linears: dict[str, Fp8Linear], scaling: str, *, fp8_regions: int,
                    tokens: float, tp: int, sp: bool, weights_gathered: bool
                    ) -> list[tuple[str, float, int]]:
    """torchao's scale all-reduces over the tensor-parallel group for one micro-batch of a
    layer: ``(phase, bytes, calls)`` with phase ``"forward"`` or ``"backward"`` (counted on
    2 gloo ranks, ``tests/test_ledger.py``).

    Tensorwise (float8 styles): a cast of a tensor split over tp reduces its maximum, one
    float64: a column linear's weight in each direction (not when ZeRO-3 gathered it in
    FP8, ``weights_gathered``) and its output gradient once; a row linear's input and
    weight likewise, and its output gradient under sequence parallelism; the input of each
    of the ``fp8_regions`` regions entered in FP8 (:func:`region_fp8`) under sequence
    parallelism, once at its entry.  Rowwise (torch's styles): a cast along
    split features reduces one float64 per row: a column linear's output gradient
    (``tokens`` rows) and its weight for the input gradient (``k`` rows) in the backward,
    a row linear's input (``tokens``) and weight (``n``) in the forward.
    """
    if tp <= 1:
        return []
    out: list[tuple[str, float, int]] = []
    if scaling == "tensor":
        weight = 0 if weights_gathered else 1
        fwd = bwd = 0
        for lin in linears.values():
            if lin.role == "column":
                fwd += weight
                bwd += weight + 1
            elif lin.role == "row":
                fwd += 1 + weight
                bwd += weight + (1 if sp else 0)
        if sp:
            fwd += fp8_regions
        out += [("forward", AMAX_BYTES, fwd), ("backward", AMAX_BYTES, bwd)]
        return [x for x in out if x[2]]
    for lin in linears.values():
        k, n = lin.in_features, lin.out_features
        if lin.role == "column":
            out += [("backward", AMAX_BYTES * tokens, 1), ("backward", AMAX_BYTES * k, 1)]
        elif lin.role == "row":
            out += [("forward", AMAX_BYTES * tokens, 1), ("forward", AMAX_BYTES * n, 1)]
    return out


def region_fp8(entry: str, all_linears, converted: dict[str, Fp8Linear]) -> bool:
    """Whether every column linear opening ``entry``'s region (of ``all_linears``, the
    layer's ``LinearRecord``\\ s) is converted, so the region gathers its input in FP8
    (``PrepareFloat8ModuleInput``, :func:`autoplan.runtime.tp.tp_plan`)."""
    columns = [l.name for l in all_linears
               if getattr(l.role, "value", l.role) == "column"
               and l.name.rpartition(".")[0] == entry]
    return bool(columns) and all(c in converted for c in columns)


@dataclass(frozen=True)
class LayerFp8:
    """torchao's FP8 terms of one layer as one rank runs it (the cost engine's use):
    ``converted`` its FP8 linears, ``gathered_params`` the parameters of those whose
    weights ZeRO-3 all-gathers in FP8 on this rank (0 without), ``fp8_regions`` the
    entries of the regions whose input its float8 styles gather in FP8."""

    converted: dict[str, Fp8Linear]
    scaling: str
    tp: int
    sp: bool
    gathered_params: float
    fp8_regions: frozenset[str]
    tokens_per_sequence: int

    @property
    def styled(self) -> bool:
        return float8_tp("torchao", self.scaling, self.tp)

    def weight_cast_s(self, device) -> float:
        """Seconds of the GEMMs' weight casts a micro-batch (forward and backward)."""
        return (sum(weight_cast_bytes(l, self.tp) for l in self.converted.values())
                / device.memory_bw_bytes_per_s)

    def shard_cast_s(self, device, shards: int) -> float:
        """Seconds of one FP8 all-gather's cast of this rank's shard of the weights."""
        return (TORCHAO_SHARD_CAST_BYTES * self.gathered_params / shards
                / device.memory_bw_bytes_per_s)

    def gathers_fp8(self, layer, index: int, phase: str) -> bool:
        """Whether the layer's sequence-parallel all-gather ``index`` (of
        ``LayerCost.sp_collectives``) moves FP8: in the forward a region's input entered in
        FP8, in the backward a converted row linear's output gradient."""
        if not self.styled or index >= len(layer.sp_collective_linears):
            return False
        where = layer.sp_collective_linears[index]
        if phase == "backward":
            lin = self.converted.get(where)
            return lin is not None and lin.role == "row"
        return where.rpartition(".")[0] in self.fp8_regions

    def amax_reduces(self, b: int, cp: int) -> list[tuple[str, float, int]]:
        """:func:`tp_amax_reduces` of a micro-batch of ``b`` sequences."""
        return tp_amax_reduces(self.converted, self.scaling, fp8_regions=len(self.fp8_regions),
                               tokens=b * self.tokens_per_sequence / cp, tp=self.tp,
                               sp=self.sp, weights_gathered=self.gathered_params > 0)
