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
from .opencl_probe import FIX, device_options


def cache_dir() -> Path:
    return Path(os.environ.get("LLMRS_CACHE_DIR") or Path.home() / ".cache" / "llmrs") / "opencl"


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
