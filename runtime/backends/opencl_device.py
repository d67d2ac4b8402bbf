"""Which OpenCL device runs a plan: every platform's devices listed (GPUs first), one picked by
index or name, and whether it can run kernels in this process at all (pip's PoCL on a CPU newer
than its LLVM cannot build; on some CPUs it aborts the process: opencl_probe.py asks a child).
Also the two things every other OpenCL module needs first: pyopencl itself,
imported on use, and OpenCLError.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from .opencl_probe import FIX as PROBE_FIX, is_pocl, why_unusable


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


def _why_unusable(dev: Any) -> str:
    """"" where the device builds and runs kernels here, else why not. PoCL is asked in a child
    process (opencl_probe.py: pip's PoCL can abort the whole process); others build a probe here."""
    if is_pocl(dev):
        return why_unusable(dev)
    cl = _cl()
    try:
        _build(cl.Program(cl.Context([dev]), "__kernel void probe(__global int *x) { x[0] = 1; }"))
        return ""
    except cl.Error:
        return "its compiler cannot build a probe kernel"


def _unusable_error(found: list[tuple[str, str]]) -> OpenCLError:
    return OpenCLError("no OpenCL device here can run kernels ("
                       + "; ".join(f"{n}: {why}" for n, why in found) + f"): {PROBE_FIX}")


def _first_working_cpu(found: list[tuple[str, Any]]) -> tuple[str, Any]:
    refused = []
    for name, dev in found:
        why = _why_unusable(dev)
        if not why:
            return name, dev
        refused.append((name, why))
    raise _unusable_error(refused)


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
        return _checked(*found[i])
    hits = [(n, d) for n, d in found if str(want).lower() in n.lower()]
    if not hits:
        raise OpenCLError(f"no OpenCL device matches {want!r}; devices: "
                          + "; ".join(f"{j}: {n}" for j, (n, _) in enumerate(found)))
    return _checked(*hits[0])


def _checked(name: str, dev: Any) -> Any:
    """A device the user named, refused with the fix where it cannot run kernels here (PoCL only:
    a GPU driver's compiler is left to report its own errors)."""
    why = why_unusable(dev)
    if why:
        raise _unusable_error([(name, why)])
    return dev


__all__ = ["INSTALL_OPENCL", "OpenCLError", "list_devices", "pick_device"]
