"""Write a stack's measured kernel tables (``profiles/cost/kernels-<name>.yaml``).

The ``autoplan`` stack prices its GPUs with the kernels torch runs, measured by
``autoplan profile --device cuda`` (:mod:`autoplan.cost.kernels`).  This script turns
measured profiles into those tables: one measured profile per architecture, each with the
shipped datasheet profile of the GPU it was measured on.

    python benchmarks/stack_kernels.py                    # the committed measurement
    python benchmarks/stack_kernels.py --measured profiles/measured/h200-...yaml \\
        --datasheet h200-sxm-141gb --out /tmp/kernels-h200.yaml

It also prints how the committed GPU-truth runs (``benchmarks/gpu_truth/``) are priced
with them, each run on the shipped profile of its GPU: the runs on a GPU other than the
one measured are held out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autoplan.cost.constants import cost_profiles_dir
from autoplan.cost.kernels import KernelTables, kernels_from_profiles, write_kernel_tables
from autoplan.errors import AutoplanError
from autoplan.hardware import load_profile

ROOT = Path(__file__).resolve().parent.parent

#: The committed measurement the shipped tables come from: the H100 of the GPU-truth
#: layout run (benchmarks/gpu_truth/h100-2026-11-27-layout), torch 2.11.0+cu130.
MEASURED = {"hopper": ("profiles/measured/h100-sxm5-80gb-2026-11-27.yaml", "h100-sxm5-80gb")}
NAME = "torch-eager"
DESCRIPTION = ("the kernels torch runs eagerly on CUDA (cuBLAS matmuls, "
               "scaled_dot_product_attention, torch's elementwise kernels), as "
               "autoplan.parallelize runs them; measured by `autoplan profile --device cuda`")
HEADER = ("# Measured kernel speeds of the autoplan stack (autoplan.cost.kernels), per GPU\n"
          "# architecture, as fractions of the measured GPU's datasheet peaks and bandwidth.\n"
          "# Written by `python benchmarks/stack_kernels.py` (do not edit by hand).\n")


def build(measured: dict[str, tuple[str, str]]) -> KernelTables:
    archs = {}
    for arch, (path, datasheet_name) in sorted(measured.items()):
        m = load_profile(ROOT / path if not Path(path).is_absolute() else path)
        d = load_profile(datasheet_name)
        if m.device.architecture != arch or d.device.architecture != arch:
            raise SystemExit(f"{path} / {datasheet_name}: expected {arch} devices, got "
                             f"{m.device.architecture!r} / {d.device.architecture!r}")
        source = (f"measured by `autoplan profile --device cuda` ({path}: {m.device.source}); "
                  f"as fractions of the {datasheet_name} datasheet, carried to every {arch} "
                  f"device by its own datasheet")
        archs[arch] = kernels_from_profiles(m.device, d.device, profile_name=datasheet_name,
                                            source=source)
    return KernelTables(NAME, DESCRIPTION, archs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", help="a measured profile (default: the committed H100's)")
    p.add_argument("--datasheet", help="the shipped profile of the GPU it was measured on")
    p.add_argument("--out", type=Path, default=None,
                   help=f"where to write (default profiles/cost/kernels-{NAME}.yaml)")
    args = p.parse_args(argv)
    measured = dict(MEASURED)
    if args.measured or args.datasheet:
        if not (args.measured and args.datasheet):
            p.error("--measured and --datasheet go together")
        try:
            arch = load_profile(args.measured).device.architecture
        except AutoplanError as exc:
            p.error(str(exc))
        measured = {arch: (args.measured, args.datasheet)}
    try:
        tables = build(measured)
    except AutoplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or cost_profiles_dir() / f"kernels-{NAME}.yaml"
    write_kernel_tables(tables, out, HEADER)
    print(f"wrote {out}")
    for arch, k in tables.architectures.items():
        big = {dt: t.points[-1][1] for dt, t in k.matmul_efficiency.items()}
        print(f"  {arch}: {k.measured_on}; largest matmul, fraction of the datasheet peak: "
              + ", ".join(f"{dt} {v:.3f}" for dt, v in big.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
