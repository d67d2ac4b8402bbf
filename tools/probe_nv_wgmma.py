#!/usr/bin/env python3
"""Whether an NVIDIA OpenCL driver can run Hopper's wgmma, the way matmul.cl's USE_NV_WGMMA body
needs it (BENCHMARKS.md, GPU round 13). Prints, one line each:
  the PTX target the OpenCL compiler emits;
  whether OpenCL C with wgmma in inline asm builds (sm_90 has no wgmma: it should not);
  whether the same PTX, retargeted to sm_90a by runtime/backends/opencl.py patch_wgmma_ptx, builds
  and runs a 128-thread kernel (a warpgroup) that executes wgmma.fence.
Each check runs in a process of its own: a kernel that faults ends its process's context.

    python tools/probe_nv_wgmma.py
"""
from __future__ import annotations

import subprocess
import sys

KERNEL = "__kernel void k(__global int* a) { %s a[get_global_id(0)] = 1; }"


def check(mode: str) -> str:
    import pyopencl as cl
    from llmrs.runtime.backends.opencl import patch_wgmma_ptx
    devs = [d for p in cl.get_platforms() for d in p.get_devices() if "NVIDIA" in p.vendor.upper()]
    if not devs:
        return "no NVIDIA OpenCL device"
    ctx = cl.Context(devs[:1])
    dev = ctx.devices[0]
    ptx = cl.Program(ctx, KERNEL % "").build().binaries[0].decode()
    if mode == "target":
        return "PTX: " + " ".join(line for line in ptx.splitlines() if line.startswith((".version", ".target")))
    if mode == "source":
        try:
            cl.Program(ctx, KERNEL % 'asm volatile("wgmma.fence.sync.aligned;" ::: "memory");').build()
            return "wgmma in OpenCL C: builds"
        except cl.Error as e:
            return "wgmma in OpenCL C: does not build: " + " ".join(
                line.strip() for line in str(e).splitlines() if "error" in line.lower())[:200]
    patched = patch_wgmma_ptx(ptx.replace("\tret;", "\t// LLMRS_WGMMA_FENCE\n\tret;", 1))
    try:
        prg = cl.Program(ctx, [dev], [patched.encode()]).build()
        q = cl.CommandQueue(ctx)
        buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * 128)
        cl.Kernel(prg, "k")(q, (128,), (128,), buf)
        q.finish()
        return "PTX patched to sm_90a with wgmma.fence: builds and runs"
    except cl.Error as e:
        return f"PTX patched to sm_90a with wgmma.fence: fails: {str(e)[:200]}"


def main() -> int:
    if len(sys.argv) == 2:
        print(check(sys.argv[1]))
        return 0
    for mode in ("target", "source", "patched"):
        r = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True)
        print(r.stdout.strip() or f"{mode}: failed: {r.stderr.strip().splitlines()[-1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
