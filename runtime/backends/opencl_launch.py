"""Enqueueing launch lists the ways pyopencl cannot: with no event, and as recorded
cl_khr_command_buffer replays. Both call the OpenCL C API through ctypes on the handles of
pyopencl's objects (whose arguments stay set at load, by pyopencl).

Why: a decode step is ~80 small kernels, and on NVIDIA's driver the host's enqueue call is the
step's pace. pyopencl asks every enqueue for an event; without one an empty launch costs the
H200's driver 4.2 us of host time instead of 5.8 (tools/bench_opencl.py measures both), and a
1B q4_0 decode step 0.74 ms instead of 0.89. Nothing in a step waits on a per-launch event:
in-order queues order the launches, and a blocking read or finish ends the step.
"""
from __future__ import annotations

import ctypes
from typing import Any

_c = ctypes

# the error codes a launch can give on a loaded plan, named as the OpenCL headers name them
_ERRORS = {-4: "CL_MEM_OBJECT_ALLOCATION_FAILURE", -5: "CL_OUT_OF_RESOURCES", -6: "CL_OUT_OF_HOST_MEMORY",
           -36: "CL_INVALID_COMMAND_QUEUE", -48: "CL_INVALID_KERNEL", -52: "CL_INVALID_KERNEL_ARGS",
           -54: "CL_INVALID_WORK_GROUP_SIZE"}


class OpenCLError(RuntimeError):
    """A device-side failure; str() is one line naming the device and what to do."""


def icd_loader() -> Any:
    """The OpenCL library pyopencl itself calls, opened through ctypes.

    Reached through pyopencl's extension module, never looked up by name: dlopen of a loaded
    object returns its handle, and dlsym on that handle searches the module, then the libraries
    it was linked against, so the symbols are those of the libOpenCL pyopencl loaded: the ICD
    loader its wheel bundles (pyopencl/.libs/libOpenCL-<hash>.so; the folder's name depends on
    the auditwheel version) or the system's where pyopencl was built from source. A look-up by
    name (ctypes.util.find_library, dlopen("libOpenCL.so.1")) finds only a system loader, which a
    machine with nothing but pip's PoCL lacks; /proc/self/maps is Linux-only and lists every
    libOpenCL mapped, not which one pyopencl calls."""
    try:
        import pyopencl._cl as ext
        lib = ctypes.CDLL(ext.__file__)
        lib.clEnqueueNDRangeKernel   # an AttributeError if no linked library defines it
    except (ImportError, OSError, AttributeError) as e:
        raise OpenCLError(f"cannot reach the OpenCL library pyopencl uses through ctypes ({e})") from None
    return lib


Launch = tuple[Any, tuple[int, int], tuple[int, int]]   # (pyopencl Kernel, global size, local size)


class DirectLaunches:
    """Launch lists enqueued by clEnqueueNDRangeKernel with no event. A list is converted to
    C arguments once (prepare) and replayed by enqueue; the kernels must outlive it."""

    def __init__(self, queue: Any):
        fn = icd_loader().clEnqueueNDRangeKernel
        vp, sz = _c.c_void_p, _c.POINTER(_c.c_size_t)
        fn.restype = _c.c_int32
        fn.argtypes = [vp, vp, _c.c_uint32, sz, sz, sz, _c.c_uint32, vp, vp]
        self._fn = fn
        self.queue = queue
        self._queue = vp(queue.int_ptr)

    @staticmethod
    def prepare(launches: list[Launch]) -> list[tuple[Any, Any, Any, Any]]:
        return [(_c.c_void_p(k.int_ptr), (_c.c_size_t * 2)(*g), (_c.c_size_t * 2)(*l), k)
                for k, g, l in launches]

    def enqueue(self, prepared: list[tuple[Any, Any, Any, Any]]) -> None:
        fn, queue = self._fn, self._queue
        for kern, gsize, lsize, k in prepared:
            rc = fn(queue, kern, 2, None, gsize, lsize, 0, None, None)
            if rc:
                raise OpenCLError(f"{self.queue.device.name.strip()}: launching kernel {k.function_name} "
                                  f"failed ({_ERRORS.get(rc, rc)})")


class CommandBuffer:
    """Launches recorded once with cl_khr_command_buffer (which pyopencl does not wrap, hence
    ctypes) and replayed by one enqueue: the driver gets the whole list, the host issues one
    call instead of one per kernel."""

    def __init__(self, queue: Any, launches: list[tuple[Any, tuple[int, int], tuple[int, int]]]):
        lib = icd_loader()
        get = lib.clGetExtensionFunctionAddressForPlatform
        get.restype, get.argtypes = _c.c_void_p, [_c.c_void_p, _c.c_char_p]
        platform = queue.device.platform.int_ptr

        def fn(name: str, *argtypes: Any, restype: Any = _c.c_int32) -> Any:
            addr = get(_c.c_void_p(platform), name.encode())
            if not addr:
                raise OpenCLError(f"{queue.device.name.strip()}: the driver has no {name}; "
                                  "set LLMRS_OPENCL_NO_COMMAND_BUFFER=1")
            return _c.CFUNCTYPE(restype, *argtypes)(addr)

        vp, u32, sz = _c.c_void_p, _c.c_uint32, _c.POINTER(_c.c_size_t)
        create = fn("clCreateCommandBufferKHR", u32, _c.POINTER(vp), vp, _c.POINTER(_c.c_int32), restype=vp)
        record = fn("clCommandNDRangeKernelKHR", vp, vp, vp, vp, u32, vp, sz, sz, u32,
                    _c.POINTER(u32), _c.POINTER(u32), vp)
        finalize = fn("clFinalizeCommandBufferKHR", vp)
        self._enqueue = fn("clEnqueueCommandBufferKHR", u32, _c.POINTER(vp), vp, u32, vp, vp)
        self._release = fn("clReleaseCommandBufferKHR", vp)
        self.queue = queue
        queues = (vp * 1)(queue.int_ptr)
        err = _c.c_int32(0)
        self.handle = create(1, queues, None, _c.byref(err))
        if err.value != 0 or not self.handle:
            raise OpenCLError(f"clCreateCommandBufferKHR failed ({err.value}); set LLMRS_OPENCL_NO_COMMAND_BUFFER=1")
        prev, point = u32(0), u32(0)
        for i, (kern, gsize, lsize) in enumerate(launches):
            g, l = (_c.c_size_t * 2)(*gsize), (_c.c_size_t * 2)(*lsize)
            # each launch waits for the one before: the order holds whatever the queue's mode
            rc = record(self.handle, None, None, _c.c_void_p(kern.int_ptr), 2, None, g, l,
                        1 if i else 0, _c.byref(prev) if i else None, _c.byref(point), None)
            if rc != 0:
                raise OpenCLError(f"clCommandNDRangeKernelKHR failed ({rc}) on kernel "
                                  f"{kern.function_name}; set LLMRS_OPENCL_NO_COMMAND_BUFFER=1")
            prev = u32(point.value)
        rc = finalize(self.handle)
        if rc != 0:
            raise OpenCLError(f"clFinalizeCommandBufferKHR failed ({rc}); set LLMRS_OPENCL_NO_COMMAND_BUFFER=1")

    def enqueue(self) -> None:
        queues = (_c.c_void_p * 1)(self.queue.int_ptr)
        rc = self._enqueue(1, queues, self.handle, 0, None, None)
        if rc != 0:
            raise OpenCLError(f"clEnqueueCommandBufferKHR failed ({rc}); set LLMRS_OPENCL_NO_COMMAND_BUFFER=1")

    def release(self) -> None:
        if self.handle:
            self._release(self.handle)
            self.handle = None
