"""Whether a PoCL device can build and run kernels in a process that also holds llvmlite's LLVM,
asked of a child process once per machine and cached.

Why a child: pip's PoCL carries its own LLVM 14. On a CPU newer than that LLVM (a Zen 5) every
build fails, which an in-process build sees; but on others (a Zen 4 with AVX-512) kernels build
and run, and the process then aborts when PoCL releases its last context ("still have references
to IRs - can't release LLVM context !", SIGABRT), after the answer is printed. No in-process check
survives that, so a child runs the whole life of an OpenCL user beside an llvmlite JIT (build,
run, release, a second context, exit), and only a child that exits cleanly clears the device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBE_TIMEOUT_S = 120
PROBE_VERSION = 2   # in the cache key: 2 builds with the back end's options, and one of its programs
FIX = ("pip's PoCL has an LLVM older than this CPU; apt-get install pocl-opencl-icd (Debian's PoCL), "
       "or a GPU driver's OpenCL ICD")

_SOURCE = """
__kernel void probe(__global float *x, __global const float4 *y) {
    size_t i = get_global_id(0);
    x[i] = dot(y[i], y[i]) + native_sqrt((float)i);
}
"""
_verdicts: dict[str, str] = {}   # key -> "" (usable) or why not, for this process


def is_pocl(dev: Any) -> bool:
    return "portable computing language" in dev.platform.name.lower()


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
    import pyopencl as cl   # the caller has it (a device in hand)
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


def _key(dev: Any) -> str:
    import llvmlite

    return "|".join([f"probe {PROBE_VERSION}", dev.platform.name, dev.platform.version, dev.name, dev.driver_version,
                     f"llvmlite {llvmlite.__version__}", sys.executable])


def _cache_file() -> Path:
    return Path(os.environ.get("LLMRS_CACHE_DIR") or Path.home() / ".cache" / "llmrs") / "opencl" / "probe.json"


def _read_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_file().read_text())
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, verdict: str) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = verdict
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass    # a read-only cache only costs a probe per process


def _run_child(platform: str, device: str) -> subprocess.CompletedProcess:
    from llmrs.child import python_argv

    code = "from llmrs.runtime.backends.opencl_probe import child; child(sys.argv[1], sys.argv[2])"
    return subprocess.run(python_argv(code, platform, device), capture_output=True,
                          text=True, errors="replace", timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)


def why_unusable(dev: Any) -> str:
    """"" where `dev` can run kernels in this process; else the reason, in a few words. Devices
    other than PoCL's are not probed (their compilers share no LLVM with llvmlite)."""
    if not is_pocl(dev):
        return ""
    key = _key(dev)
    if key in _verdicts:
        return _verdicts[key]
    cached = _read_cache()
    if key in cached:
        _verdicts[key] = cached[key]
        return cached[key]
    try:
        done = _run_child(dev.platform.name, dev.name)
        lines = [ln.strip() for ln in (done.stderr or "").splitlines() if ln.strip()]
        if done.returncode == 0 and "probe ok" in done.stdout:
            verdict = ""
        elif done.returncode < 0 or done.returncode >= 128:
            sig = -done.returncode if done.returncode < 0 else done.returncode - 128
            last = next((ln for ln in reversed(lines) if "IRs" in ln or "LLVM" in ln), "")
            verdict = f"a process using it dies with signal {sig}" + (f" ({last})" if last else "")
        else:
            verdict = "its compiler cannot build kernels for this CPU" if any(
                "build" in ln.lower() for ln in lines) else f"a probe exited with {done.returncode}"
    except subprocess.TimeoutExpired:
        verdict = f"a probe did not finish in {PROBE_TIMEOUT_S} s"
    _verdicts[key] = verdict
    _write_cache(key, verdict)
    return verdict


def _backend_source() -> str:
    """One of the back end's programs as codegen assembles it: common.cl, then embedding.cl."""
    from importlib import resources
    folder = resources.files("llmrs.templates").joinpath("opencl")
    return "\n".join(folder.joinpath(f"{name}.cl").read_text() for name in ("common", "embedding"))


def child(platform: str, device: str) -> None:
    """The probe itself (in the child): an llvmlite JIT, as the CPU back end makes, then OpenCL
    on the named device three times over, each time built (the probe kernel and one of the back
    end's programs), run, checked and released."""
    import numpy as np
    import llvmlite.binding as llvm
    import pyopencl as cl

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = llvm.parse_assembly("define i32 @inc(i32 %x) {\n %y = add i32 %x, 1\n ret i32 %y\n}")
    machine = llvm.Target.from_default_triple().create_target_machine()
    jit = llvm.create_mcjit_compiler(module, machine)
    jit.finalize_object()
    dev = next(d for p in cl.get_platforms() if p.name == platform for d in p.get_devices() if d.name == device)
    y = (np.arange(64 * 4, dtype=np.float32) % 7 + 1).reshape(64, 4)
    want = (y * y).sum(1) + np.sqrt(np.arange(64, dtype=np.float32))
    for _ in range(3):
        ctx = cl.Context([dev])
        queue = cl.CommandQueue(ctx)
        try:
            # the back end's own options: pip's PoCL 3.0 on a Zen 4 builds a program with
            # -cl-fp32-correctly-rounded-divide-sqrt (which it advertises) without its kernels
            prg = cl.Program(ctx, _SOURCE).build(options=" ".join(device_options(dev)))
        except cl.Error as e:
            print(f"build failed: {' '.join(str(e).split())[:200]}", file=sys.stderr)
            sys.exit(3)
        if prg.get_info(cl.program_info.NUM_KERNELS) == 0:
            print("build failed: the built program has no kernels", file=sys.stderr)
            sys.exit(3)
        # and a program of the back end's, which pip's PoCL 3.0 on a Zen 4 builds without its
        # kernel now and then (then aborts at exit): a few tries
        real = cl.Program(ctx, _backend_source()).build(
            options=" ".join(["-DTABLE_T=f32", "-DTABLE_F32"] + device_options(dev)))
        if real.get_info(cl.program_info.NUM_KERNELS) == 0:
            print("build failed: a program of the back end's built without its kernels", file=sys.stderr)
            sys.exit(3)
        del real
        mf = cl.mem_flags
        x = cl.Buffer(ctx, mf.WRITE_ONLY, 64 * 4)
        yb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=y)
        prg.probe(queue, (64,), None, x, yb)
        got = np.empty(64, np.float32)
        cl.enqueue_copy(queue, got, x)
        queue.finish()
        if not np.allclose(got, want, rtol=1e-4):
            print("wrong results from the probe kernel", file=sys.stderr)
            sys.exit(4)
        del prg, x, yb, queue, ctx
    del jit
    print("probe ok", flush=True)


__all__ = ["FIX", "device_options", "is_pocl", "why_unusable"]
