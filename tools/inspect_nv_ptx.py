#!/usr/bin/env python3
"""What NVIDIA's OpenCL compiler made of a plan's kernels, read from its PTX (the program binaries):
per program, the driver-set registers it reads (%envreg<N>, which runtime/backends/opencl_cuda.py
rewrites for CUDA launches) with the lines around their first reads, and the fences it emits (a
work-group-scope membar.cta where device scope was meant is how BENCHMARKS.md round 23's stale
partials were found).

    python tools/inspect_nv_ptx.py PLAN [--context N]

Runs on any OpenCL device; only NVIDIA's binaries are PTX (others print that they are not).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from llmrs.runtime.backends.opencl import OpenCLBackend, OpenCLError, _cl
from llmrs.runtime.plan import Plan, PlanError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", type=Path)
    ap.add_argument("--context", type=int, default=2, help="lines shown around each of the first reads (default 2)")
    args = ap.parse_args(argv)
    cl = _cl()
    try:
        be = OpenCLBackend(Plan.open(args.plan))
    except (OpenCLError, PlanError, OSError) as e:
        sys.exit(f"inspect_nv_ptx: {e}")
    seen: set[int] = set()
    for b in be._bound_of.values():
        prg = b.kernel.get_info(cl.kernel_info.PROGRAM)
        if prg.int_ptr in seen:
            continue
        seen.add(prg.int_ptr)
        text = prg.get_info(cl.program_info.BINARIES)[0].decode(errors="replace")
        name = f"{b.kernel.function_name} {b.variant}".strip()
        if ".entry" not in text:
            print(f"{name}: the binary is not PTX ({be.device_name})")
            continue
        lines = text.split("\n")
        regs = sorted({int(n) for n in re.findall(r"%envreg(\d+)", text)})
        fences = sorted(set(re.findall(r"\b(membar\.\w+|fence\.[\w.]+)", text)))
        print(f"{name}: envreg {regs or 'none'}; fences {fences or 'none'}")
        for i in [i for i, line in enumerate(lines) if "%envreg" in line][:4]:
            print("    " + " | ".join(x.strip() for x in lines[max(0, i - args.context):i + args.context + 1]))
    print(f"CUDA graphs: {be.cuda_graphs}; notes: {be.build_notes or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
