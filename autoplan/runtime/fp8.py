"""FP8 training with torchao's float8 linears: the FP8 recipes :func:`autoplan.parallelize` runs.

An FP8 plan (``Precision.is_fp8``) runs the bf16 program of :mod:`.precision` (fp32
master weights and Adam states, bf16 compute copies and activations, gradients reduced
in fp32) with the linears :func:`autoplan.precision.fp8_linears` names swapped for
torchao's ``Float8Linear`` (``torchao.float8.convert_to_float8_training``), as torchtitan's
float8 converter does:

- **which linears**: the blocks' column and row linears whose features are multiples of
  16; the vocabulary head, the embeddings, routers and expert banks stay bf16;
- **scaling**: ``fp8`` is torchao's tensorwise recipe (one scale a tensor from its
  current absolute maximum; e4m3 inputs and weights, e5m2 gradients), ``fp8-rowwise``
  its rowwise recipe (one scale a row, rounded down to a power of two, e4m3 throughout);
- **ZeRO-3** (tensorwise): FSDP2 all-gathers those weights in FP8
  (``enable_fsdp_float8_all_gather``), cast from the fp32 master shard with a scale
  all the ranks share: after every optimizer step one all-reduce of the weights'
  absolute maxima computes the next step's scales
  (``precompute_float8_dynamic_scale_for_fsdp``; also once when the program is built,
  so every step runs alike);
- **tensor and sequence parallelism** (tensorwise): torchao's float8 styles
  (``Float8ColwiseParallel``, ``Float8RowwiseParallel``, ``PrepareFloat8ModuleInput``)
  cast a region's input to FP8 before the sequence all-gather, so the gather moves FP8;
  the rowwise recipe keeps torch's styles (as torchtitan does);
- **pipelines**: each stage's linears are converted alike.

On a device without FP8 matmuls (CPU ranks, GPUs before compute capability 8.9),
:func:`check_fp8_device` refuses, unless emulation is asked for
(``parallelize(..., fp8_emulate=True)``): torchao then multiplies the dequantized FP8
values in fp32 (``Float8LinearConfig(emulate=True)``), the same quantization at the
speed of an fp32 matmul, which the tests use.

torchao is the ``fp8`` extra (``pip install 'autoplan[fp8]'``); it is imported here only,
when an FP8 plan runs, with its messages about CUDA kernels a CPU wheel cannot load kept
off the console (:func:`autoplan._optional.quiet_torchao`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..graph import LayerKind, LayerRecord
from ..precision import fp8_all_gather, fp8_linears, fp8_problem
from ..strategy import Precision

__all__ = ["FP8_MIN_CAPABILITY", "check_fp8_device", "import_torchao", "apply_fp8",
           "Float8Styles", "float8_tp_styles", "has_fp8_all_gather", "precompute_fsdp_scales",
           "is_float8_linear", "gather_fp8_as_bytes"]

#: CUDA compute capability of the first GPUs with FP8 tensor cores (Ada 8.9, Hopper 9.0;
#: ``torch._scaled_mm`` requires it: CUDA C Programming Guide, "Compute Capabilities")
FP8_MIN_CAPABILITY = (8, 9)

#: The library the runtime runs FP8 recipes with (``CostOptions.fp8_library`` of the
#: ``autoplan`` stack)
LIBRARY = "torchao"


def import_torchao():
    """``torchao.float8``, quietly (see the module); raises
    :class:`~autoplan.errors.MissingDependencyError` with the install line without it."""
    from .._optional import quiet_torchao, require

    quiet_torchao()
    require("torchao", "FP8 training runs (precision='fp8')")
    import torchao.float8 as float8

    return float8


def check_fp8_device(precision: Precision | str, device: torch.device, *,
                     emulate: bool,
                     emulate_hint: str = "pass parallelize(..., fp8_emulate=True)") -> None:
    """Raise :class:`ConfigError` (one line) when this rank cannot run ``precision``: a
    recipe torchao does not have, or a device without FP8 matmuls unless ``emulate``.
    ``emulate_hint`` says how the caller asks for emulation (an emitted script: its
    ``--fp8-emulate`` flag)."""
    precision = Precision(precision)
    if not precision.is_fp8:
        return
    problem = fp8_problem(precision, LIBRARY)
    if problem:
        raise ConfigError(problem)
    if emulate:
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) >= FP8_MIN_CAPABILITY:
            return
        what = (f"CUDA device {torch.cuda.get_device_name(device)} (compute capability "
                f"{capability[0]}.{capability[1]})")
    else:
        what = f"a {device.type} device"
    raise ConfigError(
        f"precision={precision.value!r} needs FP8 matmuls (CUDA compute capability "
        f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or later: Ada, Hopper, Blackwell) "
        f"and this rank runs on {what}; {emulate_hint} to run its "
        "numerics emulated (slow: for tests), or use precision='bf16'")


_BYTE_GATHER: list[bool] = []


def gather_fp8_as_bytes() -> None:
    """All-gather torchao's FP8 tensors as bytes (``uint8`` views of their data), for gloo:
    it has no float8 dtypes ("Invalid scalar type"), and a gather moves bytes without
    combining them, so the result is the same.  NCCL gathers float8 itself; FSDP2 already
    gathers a unit's mixed dtypes through one byte buffer.  Installed once per process,
    by :func:`apply_fp8` on CPU ranks; the recorder (:mod:`.ledger`) counts the gather as
    what it is, FP8 data."""
    if _BYTE_GATHER:
        return
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

    ops = [op for op in FLOAT8_OPS_TABLE
           if str(op).endswith("all_gather_into_tensor.default")]
    for op in ops:
        original = FLOAT8_OPS_TABLE[op]

        def as_bytes(aten_op, args, kwargs=None, original=original):
            fp8 = args[0]
            data = fp8._data.contiguous()
            out = original(aten_op, (_with_data(fp8, data.view(torch.uint8)), *args[1:]),
                           kwargs)
            return _with_data(out, out._data.view(data.dtype))

        FLOAT8_OPS_TABLE[op] = as_bytes
    _BYTE_GATHER.append(True)


def _with_data(fp8, data: torch.Tensor):
    """A ``Float8TrainingTensor`` like ``fp8`` over ``data``."""
    return type(fp8)(data, fp8._scale, fp8._orig_dtype, fp8._linear_mm_config,
                     fp8._gemm_input_role, fp8._axiswise_dim)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (without importing torchao)."""
    return type(module).__name__ == "Float8Linear" and isinstance(module, nn.Linear)


def _config(float8, precision: Precision, *, emulate: bool, all_gather: bool):
    """torchao's config of ``precision``'s recipe (tensorwise, rowwise)."""
    recipe = "tensorwise" if precision.fp8_scaling == "tensor" else "rowwise"
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def _module_paths(layer: LayerRecord) -> list[str]:
    """The FP8 linears of ``layer`` by path from the model (or stage) root."""
    prefix = layer.name + "." if layer.kind is LayerKind.BLOCK else ""
    return [prefix + name for name in fp8_linears(layer, LIBRARY)]


def apply_fp8(part: nn.Module, layers: Sequence[tuple[LayerRecord, int]], precision: Precision,
              *, shards: int, emulate: bool) -> int:
    """Swap the FP8 linears of ``layers`` (``(record, ZeRO stage)`` pairs of the layers
    ``part`` holds) for ``Float8Linear``; a layer whose stage shards it over ``shards``
    data-parallel ranks with ZeRO-3 gathers them in FP8 (:func:`autoplan.precision.fp8_all_gather`).
    Returns how many linears were converted.

    Raises
    ------
    ConfigError
        When a module the capture counts as an FP8 linear is not an ``nn.Linear`` (torchao
        converts ``nn.Linear`` only, e.g. not GPT-2's ``Conv1D``): priced in FP8, it would
        run in bf16.
    """
    float8 = import_torchao()
    if next(part.parameters()).device.type == "cpu":
        gather_fp8_as_bytes()        # gloo
    precision = Precision(precision)
    chosen: dict[str, bool] = {}
    for layer, zero in layers:
        ag = fp8_all_gather(precision, zero, shards)
        for path in _module_paths(layer):
            try:
                module = part.get_submodule(path)
            except AttributeError:
                continue      # a layer of another pipeline stage's module
            if not isinstance(module, nn.Linear):
                raise ConfigError(
                    f"precision={precision.value!r} runs {path!r} in FP8 (a "
                    f"{module.__class__.__name__}), but torchao converts nn.Linear modules "
                    "only; use precision='bf16' for this model")
            chosen[path] = ag
    for ag in (False, True):
        paths = {p for p, g in chosen.items() if g is ag}
        if paths:
            float8.convert_to_float8_training(
                part, config=_config(float8, precision, emulate=emulate, all_gather=ag),
                module_filter_fn=lambda _, fqn, paths=paths: fqn in paths)
    return len(chosen)


@dataclass(frozen=True)
class Float8Styles:
    """torchao's float8 tensor-parallel styles (tensorwise recipe): FP8 all-gathers of a
    region's input, FP8 casts of the output gradients before their collectives."""

    colwise: Any
    rowwise: Any
    prepare_input: Any

    @staticmethod
    def converted(module: nn.Module) -> bool:
        return is_float8_linear(module)


def float8_tp_styles(precision: Precision | str) -> Float8Styles | None:
    """The styles :func:`autoplan.runtime.tp.apply_tp` uses for FP8 linears under
    ``precision``: torchao's float8 styles under tensorwise scaling; None (torch's own)
    otherwise, as torchtitan does for rowwise."""
    if Precision(precision).fp8_scaling != "tensor":
        return None
    import_torchao()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8Styles(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)


def has_fp8_all_gather(parts: Iterable[nn.Module]) -> bool:
    """Whether any FP8 linear of ``parts`` is all-gathered in FP8 by FSDP2."""
    return any(is_float8_linear(m) and m.config.enable_fsdp_float8_all_gather
               for part in parts for m in part.modules())


@torch.no_grad()
def precompute_fsdp_scales(parts: Iterable[nn.Module]) -> None:
    """The next step's scales of the weights FSDP2 all-gathers in FP8, from their current
    values: one all-reduce of their absolute maxima per part (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``), after every optimizer step."""
    float8 = import_torchao()
    for part in parts:
        float8.precompute_float8_dynamic_scale_for_fsdp(part)
