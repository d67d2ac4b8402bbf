"""OpenCL programs: the build options a device gets, the build itself (from an on-disk cache of
binaries keyed by source, options and device), and the PTX patch that gives NVIDIA's OpenCL
compiler Hopper's wgmma instructions.
"""
from __future__ import annotations

import hashlib
import os
import re
import warnings
from pathlib import Path
from typing import Any

from .opencl_device import OpenCLError, _build, _cl
from .opencl_probe import FIX, is_pocl


def cache_dir() -> Path:
    return Path(os.environ.get("LLMRS_CACHE_DIR") or Path.home() / ".cache" / "llmrs") / "opencl"


def device_options(dev: Any) -> list[str]:
    """Build options chosen for the device at bind time. NVIDIA's driver reports no subgroup
    extension but compiles inline PTX: warp shuffles and dp4a come from there, and on compute
    capability 8.0+ the tensor-core bodies of the prefill matmul and attention (-DUSE_NV_MMA)
    (LLMRS_OPENCL_PORTABLE=1 keeps the portable C path, LLMRS_OPENCL_NO_MMA=1 only drops the
    tensor cores, for comparisons; LLMRS_OPENCL_EMULATE_MMA=1 runs the tensor-core bodies on any
    device, their mma.sync emulated in C, for tests). Compute capability 9.x adds Hopper's
    warpgroup MMA to the f16 prefill matmul (-DUSE_NV_WGMMA; build_program assembles it for
    sm_90a; LLMRS_OPENCL_NO_WGMMA=1 keeps mma.sync; LLMRS_OPENCL_EMULATE_WGMMA=1 emulates it).
    LLMRS_OPENCL_PDL_MATVEC=1 (compute capability 9.0+) places programmatic dependent launch's
    wait, trigger and an L2 prefetch of the first weights in the decode matvec (-DUSE_NV_PDL,
    common.cl; no-ops unless a CUDA graph replays the kernels). Off by default: on an H200 it
    moved decode 1.05-1.07x on the Qwen3-0.6B shape, 1.12x on SmolLM2's, 1.03x on the 1B f16 and
    0.98x on the 1B q4_0 against the wait at each kernel's entry (BENCHMARKS.md round 23)."""
    cl = _cl()
    opts = ["-w"] if is_pocl(dev) else []   # pip's PoCL prints "N warnings generated." per kernel
    if dev.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
        opts.append("-cl-fp32-correctly-rounded-divide-sqrt")  # Q8_0 scales round as numpy's
    if "NVIDIA" in dev.platform.vendor.upper() and os.environ.get("LLMRS_OPENCL_PORTABLE", "") in ("", "0"):
        opts.append("-DUSE_NV_PTX")
        if _nv_compute_capability(dev) >= (8, 0) and os.environ.get("LLMRS_OPENCL_NO_MMA", "") in ("", "0"):
            opts.append("-DUSE_NV_MMA")   # mma.sync m16n8k32 s8 / m16n8k16 f16 need sm_80
            if _nv_compute_capability(dev)[0] == 9 and os.environ.get("LLMRS_OPENCL_NO_WGMMA", "") in ("", "0"):
                opts.append("-DUSE_NV_WGMMA")   # wgmma: sm_90a alone (not sm_100)
        pdl = os.environ.get("LLMRS_OPENCL_PDL_MATVEC", "")
        if _nv_compute_capability(dev) >= (9, 0) and pdl in ("1", "notrigger", "noprefetch"):
            opts.append("-DUSE_NV_PDL")   # griddepcontrol, prefetch: where kernels wait in a CUDA graph
            opts += {"notrigger": ["-DPDL_NO_TRIGGER"], "noprefetch": ["-DPDL_NO_PREFETCH"]}.get(pdl, [])
    emulate = {name: os.environ.get(f"LLMRS_OPENCL_EMULATE_{name}", "") not in ("", "0") for name in ("MMA", "WGMMA")}
    if (emulate["MMA"] or emulate["WGMMA"]) and "-DUSE_NV_MMA" not in opts:
        opts += ["-DUSE_NV_MMA", "-DEMU_MMA"]   # tests: the tensor-core bodies, emulated (common.cl)
        if emulate["WGMMA"]:
            opts.append("-DUSE_NV_WGMMA")
    return opts


def _nv_compute_capability(dev: Any) -> tuple[int, int]:
    """(major, minor) from cl_nv_device_attribute_query; (0, 0) where the driver lacks it."""
    try:
        return int(dev.compute_capability_major_nv), int(dev.compute_capability_minor_nv)
    except Exception:   # pyopencl raises its own error types, or AttributeError, for a missing query
        return 0, 0


def _device_key(dev: Any) -> str:
    return f"{dev.platform.name}|{dev.name}|{dev.driver_version}|{dev.version}"


_WGMMA_MARK = re.compile(r"// LLMRS_WGMMA_(FENCE|COMMIT|WAIT[01]|M64N(\d+)K16)([^\n]*)")


def patch_wgmma_ptx(ptx: str) -> str:
    """NVIDIA's OpenCL compiler emits PTX for sm_90, which has no wgmma; matmul.cl writes each
    wgmma instruction as a comment of its inline asm (with the registers the compiler bound), and
    this turns the comments into the instructions and the target into sm_90a."""
    def one(m: re.Match) -> str:
        what, n, ops = m.group(1), m.group(2), m.group(3)
        if what == "FENCE":
            return "wgmma.fence.sync.aligned;"
        if what == "COMMIT":
            return "wgmma.commit_group.sync.aligned;"
        if what.startswith("WAIT"):
            return f"wgmma.wait_group.sync.aligned {what[4]};"
        regs = [o.strip() for o in ops.split(",")]
        acc, (da, db, one_reg) = regs[:int(n) // 2], regs[int(n) // 2:]
        return ("{ .reg .pred p; setp.ne.b32 p, %s, 0; wgmma.mma_async.sync.aligned.m64n%sk16.f32.f16.f16 "
                "{%s}, %s, %s, p, 1, 1, 0, 0; }" % (one_reg, n, ", ".join(acc), da, db))
    out = _WGMMA_MARK.sub(one, ptx)
    return re.sub(r"^\.target sm_90\b", ".target sm_90a", out, count=1, flags=re.M)


def build_program(ctx: Any, dev: Any, source: str, options: list[str], label: str) -> Any:
    """A built program, from the on-disk cache (source hash + device) when it holds one."""
    cl = _cl()
    opts = " ".join(options)
    key = hashlib.sha256("\0".join([source, opts, _device_key(dev)]).encode()).hexdigest()[:32]
    path = cache_dir() / f"{key}.bin"
    if path.exists():
        try:
            return _build(cl.Program(ctx, [dev], [path.read_bytes()]), options=opts)
        except (cl.Error, OSError):
            pass  # a stale or foreign binary: build from source below
    try:
        prg = _build(cl.Program(ctx, source), options=opts, devices=[dev])
        if "-DUSE_NV_WGMMA" in options and "-DEMU_MMA" not in options:
            ptx = prg.get_info(cl.program_info.BINARIES)[0].decode(errors="replace")
            if "LLMRS_WGMMA_" in ptx:   # the PTX as a program binary: the driver assembles it
                prg = _build(cl.Program(ctx, [dev], [patch_wgmma_ptx(ptx).encode()]), options=opts)
    except cl.Error as e:
        log = " ".join(str(e).split())
        raise OpenCLError(f"OpenCL build of {label} ({opts}) failed on {dev.name.strip()}: {log[:400]}") from None
    if prg.get_info(cl.program_info.NUM_KERNELS) == 0:   # seen with pip's PoCL 3.0 on a Zen 4, now and then
        raise OpenCLError(f"OpenCL build of {label} on {dev.name.strip()} gave a program without its kernels; "
                          f"{FIX}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(prg.get_info(cl.program_info.BINARIES)[0])
        tmp.replace(path)
    except OSError:
        pass  # the cache is an optimisation; a read-only home still runs
    return prg


def build_with_fallbacks(ctx: Any, dev: Any, source: str, options: list[str], device_opts: list[str],
                         label: str, notes: list[str]) -> Any:
    """build_program with the device's options, dropping tensor-core bodies the driver's PTX
    assembler rejects: wgmma first (mma.sync still runs), then mma.sync (the fp32 body); each
    fallback taken is warned about and appended to `notes`."""
    tries = [device_opts] + [[o for o in device_opts if o not in drop] for drop in
                             (("-DUSE_NV_WGMMA",), ("-DUSE_NV_WGMMA", "-DUSE_NV_MMA")) if drop[-1] in device_opts]
    for here, after in zip(tries, tries[1:]):
        try:
            return build_program(ctx, dev, source, options + here, label)
        except OpenCLError as err:
            note = f"{err}; built without {' '.join(o for o in here if o not in after)}"
            warnings.warn(note)
            notes.append(note)
    return build_program(ctx, dev, source, options + tries[-1], label)


__all__ = ["build_program", "build_with_fallbacks", "cache_dir", "device_options", "patch_wgmma_ptx"]
