"""Which OpenCL device runs a plan: every platform's devices listed (GPUs first), one picked by
index or name, and whether its compiler builds kernels at all (pip's PoCL on a CPU newer than
its LLVM does not). Also the two things every other OpenCL module needs first: pyopencl itself,
imported on use, and OpenCLError.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any


class OpenCLError(RuntimeError):
    """A device-side failure; str() is one line naming the device and what to do."""


def _cl():
    try:
        import pyopencl as cl
    except ImportError as e:
        raise OpenCLError(f"pyopencl is not installed ({e}); pip install pyopencl "
                          "pocl-binary-distribution") from None
    return cl


def _build(prg: Any, **options: Any) -> Any:
    """prg.build(**options) without pyopencl's CompilerWarning ("Non-empty compiler output
    encountered", printed with pyopencl's source line): a driver's remarks on a build that works
    mean nothing to someone running a plan, and a build that fails raises with its log.
    PYOPENCL_COMPILER_OUTPUT=1, pyopencl's own switch, shows the logs again."""
    cl = _cl()
    with warnings.catch_warnings():
        if os.environ.get("PYOPENCL_COMPILER_OUTPUT", "").lower() not in ("1", "true", "yes", "on"):
            warnings.simplefilter("ignore", cl.CompilerWarning)
        return prg.build(**options)


INSTALL_OPENCL = ("install a GPU driver's OpenCL ICD, or PoCL for the CPU: pip install "
                  "pocl-binary-distribution, or apt-get install pocl-opencl-icd")


def list_devices() -> list[tuple[str, Any]]:
    """("platform: device", cl.Device) for every device of every platform, GPUs first."""
    cl = _cl()
    try:
        platforms = cl.get_platforms()
    except cl.Error as e:
        raise OpenCLError(f"no OpenCL platform found ({e}); {INSTALL_OPENCL}") from None
    found = []
    for p in platforms:
        try:
            devs = p.get_devices()
        except cl.Error:
            continue
        found += [(f"{p.name.strip()}: {d.name.strip()}", d) for d in devs]
    found.sort(key=lambda nd: 0 if nd[1].type & cl.device_type.GPU else 1)
    if not found:
        raise OpenCLError(f"no OpenCL device found on any platform; {INSTALL_OPENCL}")
    return found


def _compiles(dev: Any) -> bool:
    """Whether the device's compiler builds a trivial kernel: PoCL's LLVM cannot name CPUs newer
    than itself (the PyPI PoCL on a Zen 5 asks clang for target CPU 'generic' and fails)."""
    cl = _cl()
    try:
        _build(cl.Program(cl.Context([dev]), "__kernel void probe(__global int *x) { x[0] = 1; }"))
        return True
    except cl.Error:
        return False


def _first_working_cpu(found: list[tuple[str, Any]]) -> tuple[str, Any]:
    for name, dev in found:
        if _compiles(dev):
            return name, dev
    raise OpenCLError("no OpenCL device here can build kernels (" + "; ".join(n for n, _ in found)
                      + "): pip's PoCL has an LLVM older than this CPU; apt-get install pocl-opencl-icd "
                      "(Debian's PoCL), or a GPU driver's OpenCL ICD")


def pick_device(device: int | str | None = None) -> Any:
    """A device by index or name substring (else $LLMRS_OPENCL_DEVICE, else the first GPU), or
    the pyopencl Device given."""
    cl = _cl()
    if isinstance(device, cl.Device):
        return device
    found = list_devices()
    want = device if device is not None else os.environ.get("LLMRS_OPENCL_DEVICE")
    if want is None or want == "":
        name, dev = found[0]
        if not dev.type & cl.device_type.GPU:
            name, dev = _first_working_cpu(found)
            print(f"llmrs: no OpenCL GPU found; running on {name}", file=sys.stderr)
        return dev
    if isinstance(want, int) or str(want).isdigit():
        i = int(want)
        if not 0 <= i < len(found):
            raise OpenCLError(f"OpenCL device index {i} is out of range; devices: "
                              + "; ".join(f"{j}: {n}" for j, (n, _) in enumerate(found)))
        return found[i][1]
    hits = [d for n, d in found if str(want).lower() in n.lower()]
    if not hits:
        raise OpenCLError(f"no OpenCL device matches {want!r}; devices: "
                          + "; ".join(f"{j}: {n}" for j, (n, _) in enumerate(found)))
    return hits[0]


__all__ = ["INSTALL_OPENCL", "OpenCLError", "list_devices", "pick_device"]
