"""NVIDIA: a launch list replayed as a CUDA graph, on memory OpenCL shares.

Why: NVIDIA's OpenCL driver has no cl_khr_command_buffer, and its queue spends about 6 us of
device time on each launch, whatever the kernel (BENCHMARKS.md round 22): a decode step of 82-152
small kernels is paced by its launch count. The CUDA driver on the same machine records launches
into a graph that the GPU runs as one submission (what llama.cpp's CUDA back end does). Two
facts let a graph hold our OpenCL kernels unchanged:

  * NVIDIA's OpenCL program binaries are PTX, which the CUDA driver loads. That PTX reads a few
    registers the OpenCL driver sets and CUDA does not (%envreg<N>); each read becomes what it
    means for one CUDA launch of the whole grid (ENVREGS).
  * The memory is one. Every buffer of the back end is allocated through CUDA's virtual memory API,
    exported as a file descriptor and imported into OpenCL (cl_khr_external_memory_opaque_fd): a
    kernel run by either API reads and writes the same bytes.

OpenCL keeps everything else: the builds, uploads, the KV cache's own kernels and copies, reads
of any value. Order between the two: a replay waits for OpenCL's queue to finish first, and the
back end waits for CUDA's stream before any OpenCL operation (a step's own reads go through the
stream and wait on it).
LLMRS_OPENCL_CUDA_GRAPHS=0 keeps every launch on OpenCL's queue.
"""
from __future__ import annotations

import ctypes
import os
import re
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from .opencl_device import OpenCLError, _cl
from .opencl_launch import icd_loader

_c = ctypes
vp, u64 = _c.c_void_p, _c.c_uint64
GRAPHS_KEPT = 64            # instantiated graphs kept (one per launch list and size), oldest dropped
# %envreg<N> of NVIDIA's OpenCL PTX, as its code reads them: 0-2 are added to %ctaid (the group
# id: the driver may split a big grid into several launches), 3-5 the global work offset, 6-8 the
# whole grid's groups a dimension (get_num_groups). One CUDA launch is the whole grid, with no
# offset, so they read 0 and %nctaid
ENVREGS = {0: "0", 1: "0", 2: "0", 3: "0", 4: "0", 5: "0", 6: "%nctaid.x", 7: "%nctaid.y", 8: "%nctaid.z"}
_EXTERNAL_FD = 0x2060       # CL_EXTERNAL_MEMORY_HANDLE_OPAQUE_FD_KHR
_POSIX_FD = 1               # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class CudaUnavailable(RuntimeError):
    """Why launch lists stay on OpenCL's queue here (one line); raised before anything of the
    list was enqueued."""


class CudaLaunchFailed(RuntimeError):
    """A launch failed after earlier launches of its list were enqueued (one line)."""


def enabled() -> bool:
    """LLMRS_OPENCL_CUDA_GRAPHS: on unless 0 (unset or empty: on)."""
    return os.environ.get("LLMRS_OPENCL_CUDA_GRAPHS", "").strip() != "0"


def pdl_default() -> int:
    """LLMRS_OPENCL_CUDA_PDL: 2 (default) programmatic dependent launch, the next kernel launched
    as each kernel's groups end; 1 the next let launch at each kernel's start; 0 plain graphs
    (pdl_ptx). H200, decode tok/s in one process, 2 against 0: Qwen3-0.6B shape q4_0 1.031, 1B
    q4_0 1.025; 1 against 0: 0.942, 0.917, 1B f16 1.035 (BENCHMARKS.md round 23)."""
    mode = os.environ.get("LLMRS_OPENCL_CUDA_PDL", "2").strip() or "2"
    if mode not in ("0", "1", "2"):
        raise ValueError(f"LLMRS_OPENCL_CUDA_PDL={mode!r}: choose 0, 1 or 2")
    return int(mode)


def cuda_ptx(ptx: str) -> str:
    """OpenCL's PTX as the CUDA driver runs it: each read of a driver-set register (a mov of
    %envreg<N>) reads what ENVREGS says instead; CudaUnavailable for any other use or register."""
    def one(m: re.Match) -> str:
        n = int(m.group(3))
        if n not in ENVREGS:
            raise CudaUnavailable(f"the PTX reads %envreg{n}, which CUDA does not set")
        return f"mov.u32{m.group(2)}, {ENVREGS[n]};"
    out = re.sub(r"mov\.(b32|u32)(\s+%\w+),\s*%envreg(\d+);", one, ptx)
    if "%envreg" in out:
        raise CudaUnavailable("the PTX reads a driver-set register (%envreg) other than by a mov")
    return out


_ENTRY = re.compile(r"\.entry\s+[\w$]+\s*\(.*?\)[^{]*\{\n", re.S)


def pdl_ptx(ptx: str, trigger: bool = True) -> str:
    """Every kernel made ready for programmatic dependent launch (Hopper): its first instruction
    waits until the kernels it depends on have finished and their writes are visible
    (griddepcontrol.wait), before any of its own memory accesses, so the order of memory is that
    of plain serialized launches. With `trigger`, before that wait it lets the next kernel launch
    (griddepcontrol.launch_dependents), whose groups then wait on the GPU while this one's last
    groups run; without, the next launches as this one's groups end. Where launched without the
    attribute both are no-ops. A kernel that already has griddepcontrol instructions (its source
    places them, common.cl USE_NV_PDL) is left as it is. CudaUnavailable for PTX older than ISA
    7.8 or a target before sm_90."""
    version = re.search(r"^\.version\s+(\d+)\.(\d+)", ptx, re.M)
    target = re.search(r"^\.target\s+sm_(\d+)", ptx, re.M)
    if not version or (int(version.group(1)), int(version.group(2))) < (7, 8) or not target \
            or int(target.group(1)) < 90:
        raise CudaUnavailable("programmatic dependent launch needs PTX ISA 7.8 for sm_90 or later")
    out, at = [], 0
    entries = list(_ENTRY.finditer(ptx))
    for m, after in zip(entries, entries[1:] + [None]):
        out.append(ptx[at:m.end()])
        body = ptx[m.end():after.start() if after else len(ptx)]
        if "griddepcontrol." in body:   # the kernel's source places its own (common.cl USE_NV_PDL)
            at = m.end()
            continue
        lines = body.split("\n")
        i = 0
        while i < len(lines) and (not lines[i].strip() or lines[i].strip().startswith(("//", "."))):
            i += 1
        head = "\n".join(lines[:i])
        out.append(head + ("\n" if i else "") + ("\tgriddepcontrol.launch_dependents;\n" if trigger else "")
                   + "\tgriddepcontrol.wait;\n")
        at = m.end() + len(head) + (1 if i else 0)
    out.append(ptx[at:])
    return "".join(out)


def kernel_params(args: tuple[Any, ...], pointer: Callable[[Any], int]) -> tuple[Any, list[Any]]:
    """A bound kernel's OpenCL arguments as cuLaunchKernel's parameter array (void *[n]), and the
    values it points at (to keep alive): a buffer as its device address, np.uint64 / np.int32 /
    np.float32 scalars as themselves."""
    cl = _cl()
    vals: list[Any] = []
    for a in args:
        if isinstance(a, cl.MemoryObjectHolder):
            vals.append(u64(pointer(a)))
        elif isinstance(a, np.uint64):
            vals.append(u64(int(a)))
        elif isinstance(a, np.int32):
            vals.append(_c.c_int32(int(a)))
        elif isinstance(a, np.float32):
            vals.append(_c.c_float(float(a)))
        else:
            raise CudaUnavailable(f"a kernel argument of type {type(a).__name__} has no CUDA form")
    return (vp * max(1, len(vals)))(*[_c.cast(_c.pointer(v), vp) for v in vals]), vals


class _Loc(_c.Structure):
    _fields_ = [("type", _c.c_int), ("id", _c.c_int)]


class _AllocFlags(_c.Structure):
    _fields_ = [("compressionType", _c.c_ubyte), ("gpuDirectRDMACapable", _c.c_ubyte), ("usage", _c.c_ushort),
                ("reserved", _c.c_ubyte * 4)]


class _AllocProp(_c.Structure):   # CUmemAllocationProp
    _fields_ = [("type", _c.c_int), ("requestedHandleTypes", _c.c_int), ("location", _Loc),
                ("win32HandleMetaData", vp), ("allocFlags", _AllocFlags)]


class _AccessDesc(_c.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Loc), ("flags", _c.c_int)]


class _LaunchAttr(_c.Structure):  # CUlaunchAttribute: an id, then a 64-byte union at offset 8
    _fields_ = [("id", _c.c_int), ("pad", _c.c_char * 4), ("value", _c.c_int * 16)]


class _LaunchConfig(_c.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", _c.c_uint), ("gridDimY", _c.c_uint), ("gridDimZ", _c.c_uint),
                ("blockDimX", _c.c_uint), ("blockDimY", _c.c_uint), ("blockDimZ", _c.c_uint),
                ("sharedMemBytes", _c.c_uint), ("hStream", vp), ("attrs", _c.POINTER(_LaunchAttr)),
                ("numAttrs", _c.c_uint)]


_PDL_ATTR = _LaunchAttr(6, b"", (_c.c_int * 16)(1))   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Driver:
    """The CUDA driver API calls used here, through ctypes; each raises CudaUnavailable naming
    the call and CUDA's error on failure."""

    _SIGS = {
        "cuInit": (_c.c_uint,),
        "cuDeviceGetCount": (_c.POINTER(_c.c_int),),
        "cuDeviceGet": (_c.POINTER(_c.c_int), _c.c_int),
        "cuDeviceGetAttribute": (_c.POINTER(_c.c_int), _c.c_int, _c.c_int),
        "cuDevicePrimaryCtxRetain": (_c.POINTER(vp), _c.c_int),
        "cuDevicePrimaryCtxRelease_v2": (_c.c_int,),
        "cuCtxSetCurrent": (vp,),
        "cuStreamCreate": (_c.POINTER(vp), _c.c_uint),
        "cuStreamDestroy_v2": (vp,),
        "cuStreamSynchronize": (vp,),
        "cuMemGetAllocationGranularity": (_c.POINTER(_c.c_size_t), _c.POINTER(_AllocProp), _c.c_int),
        "cuMemCreate": (_c.POINTER(u64), _c.c_size_t, _c.POINTER(_AllocProp), u64),
        "cuMemAddressReserve": (_c.POINTER(u64), _c.c_size_t, _c.c_size_t, u64, u64),
        "cuMemMap": (u64, _c.c_size_t, _c.c_size_t, u64, u64),
        "cuMemSetAccess": (u64, _c.c_size_t, _c.POINTER(_AccessDesc), _c.c_size_t),
        "cuMemExportToShareableHandle": (vp, u64, _c.c_int, u64),
        "cuMemUnmap": (u64, _c.c_size_t),
        "cuMemAddressFree": (u64, _c.c_size_t),
        "cuMemRelease": (u64,),
        "cuMemcpyHtoDAsync_v2": (u64, vp, _c.c_size_t, vp),
        "cuMemcpyDtoHAsync_v2": (vp, u64, _c.c_size_t, vp),
        "cuModuleLoadDataEx": (_c.POINTER(vp), _c.c_char_p, _c.c_uint, _c.POINTER(_c.c_int), _c.POINTER(vp)),
        "cuModuleUnload": (vp,),
        "cuModuleGetFunction": (_c.POINTER(vp), vp, _c.c_char_p),
        "cuFuncGetAttribute": (_c.POINTER(_c.c_int), _c.c_int, vp),
        "cuLaunchKernelEx": (_c.POINTER(_LaunchConfig), vp, _c.POINTER(vp), _c.POINTER(vp)),
        "cuLaunchKernel": (vp, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, _c.c_uint, vp,
                           _c.POINTER(vp), _c.POINTER(vp)),
        "cuStreamBeginCapture_v2": (vp, _c.c_int),
        "cuStreamEndCapture": (vp, _c.POINTER(vp)),
        "cuGraphInstantiateWithFlags": (_c.POINTER(vp), vp, _c.c_ulonglong),
        "cuGraphDestroy": (vp,),
        "cuGraphExecDestroy": (vp,),
        "cuGraphLaunch": (vp, vp),
    }

    def __init__(self) -> None:
        try:
            self.lib = _c.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaUnavailable(f"no CUDA driver library ({e})") from None
        self.lib.cuGetErrorString.argtypes = [_c.c_int, _c.POINTER(_c.c_char_p)]
        for name, argtypes in self._SIGS.items():
            f = getattr(self.lib, name, None)
            if f is None:
                raise CudaUnavailable(f"the CUDA driver has no {name}")
            f.restype, f.argtypes = _c.c_int, list(argtypes)

    def __call__(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            msg = _c.c_char_p()
            self.lib.cuGetErrorString(rc, _c.byref(msg))
            raise CudaUnavailable(f"{name} failed ({(msg.value or b'').decode() or rc})")


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        d = _Driver()
        d("cuInit", 0)
        _DRIVER = d
    return _DRIVER


def _cuda_device(cu: _Driver, device: Any) -> int:
    """The CUDA ordinal of the OpenCL device, matched by PCI bus and slot (cl_nv_device_attribute_query)."""
    try:
        bus, slot = int(device.pci_bus_id_nv), int(device.pci_slot_id_nv)
    except Exception:   # pyopencl raises its own error types for a missing query
        raise CudaUnavailable("the OpenCL driver does not give the device's PCI address") from None
    n = _c.c_int()
    cu("cuDeviceGetCount", _c.byref(n))
    for i in range(n.value):
        dev, b, d = _c.c_int(), _c.c_int(), _c.c_int()
        cu("cuDeviceGet", _c.byref(dev), i)
        cu("cuDeviceGetAttribute", _c.byref(b), 33, dev)   # CU_DEVICE_ATTRIBUTE_PCI_BUS_ID
        cu("cuDeviceGetAttribute", _c.byref(d), 34, dev)   # CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID
        if (b.value, d.value) == (bus, slot):
            return dev.value
    raise CudaUnavailable(f"no CUDA device at PCI bus {bus}, slot {slot}")


def _release(cu: _Driver, ctx: Any, stream: Any, allocations: list[tuple[int, int, int]], modules: list[Any],
             graphs: list[Any], dev: int) -> None:
    """Everything a CudaGraphs holds, given back (its weakref finalizer). The order against the
    OpenCL buffers does not matter: an import holds its own reference to the memory."""
    try:
        cu("cuCtxSetCurrent", ctx)
        cu("cuStreamSynchronize", stream)
        for g in graphs:
            cu("cuGraphExecDestroy", g)
        for m in modules:
            cu("cuModuleUnload", m)
        for ptr, size, handle in allocations:
            cu("cuMemUnmap", u64(ptr), size)
            cu("cuMemAddressFree", u64(ptr), size)
            cu("cuMemRelease", u64(handle))
        cu("cuStreamDestroy_v2", stream)
        cu("cuDevicePrimaryCtxRelease_v2", dev)
    except CudaUnavailable:
        pass   # at interpreter exit the driver may be gone already


class Replay:
    """A launch list as CUDA launches (functions, grids, parameters), and its graph once captured."""

    def __init__(self, launches: list[tuple[Any, int, int, int, Any, list[Any]]], pdl: int, stream: Any):
        self.launches = launches
        self.pdl = pdl
        self.graph: Any = None
        self.runs = 0
        self.configs = []   # cuLaunchKernelEx's, with programmatic dependent launch
        if pdl:
            for f, gx, gy, block, params, _ in launches:
                self.configs.append(_LaunchConfig(gx, gy, 1, block, 1, 1, 0, stream, _c.pointer(_PDL_ATTR), 1))


class CudaGraphs:
    """The CUDA side of one OpenCL back end on an NVIDIA device: its shared allocations, the
    modules loaded from its programs' PTX, a stream, and graphs of its launch lists."""

    def __init__(self, ctx: Any, device: Any):
        """CudaUnavailable where this device or driver cannot share memory with CUDA."""
        if "NVIDIA" not in device.platform.vendor.upper():
            raise CudaUnavailable("not an NVIDIA device")
        if "cl_khr_external_memory_opaque_fd" not in device.extensions.split():
            raise CudaUnavailable("the OpenCL driver cannot import CUDA memory (no cl_khr_external_memory_opaque_fd)")
        cu = self.cu = _driver()
        self.dev = _cuda_device(cu, device)
        self.ctx = vp()
        cu("cuDevicePrimaryCtxRetain", _c.byref(self.ctx), self.dev)
        cu("cuCtxSetCurrent", self.ctx)
        self.stream = vp()
        cu("cuStreamCreate", _c.byref(self.stream), 1)   # CU_STREAM_NON_BLOCKING
        self.cl_ctx = ctx
        self.pdl = pdl_default()   # kernels launched with programmatic dependent launch (pdl_ptx)
        self.prop = _AllocProp(1, _POSIX_FD, _Loc(1, self.dev), None, _AllocFlags())   # pinned, on the device
        gran = _c.c_size_t()
        cu("cuMemGetAllocationGranularity", _c.byref(gran), _c.byref(self.prop), 0)
        self.granularity = gran.value
        lib = icd_loader()
        self._import = lib.clCreateBufferWithProperties
        self._import.restype = vp
        self._import.argtypes = [vp, _c.POINTER(u64), u64, _c.c_size_t, vp, _c.POINTER(_c.c_int32)]
        self.pointers: dict[int, int] = {}                 # cl_mem handle -> CUDA address
        self.allocations: list[tuple[int, int, int]] = []  # (address, size, allocation handle)
        self.modules: dict[tuple[int, int], tuple[Any, dict[str, Any]]] = {}   # (cl_program, pdl) -> (module, functions)
        self.graphs: OrderedDict[Any, Replay] = OrderedDict()
        # what the finalizer gives back; lists it sees grow
        self._module_list: list[Any] = []
        self._graph_execs: list[Any] = []
        weakref.finalize(self, _release, cu, self.ctx, self.stream, self.allocations, self._module_list,
                         self._graph_execs, self.dev)

    # -- memory -----------------------------------------------------------------------------
    def alloc(self, size: int, hostbuf: np.ndarray | None = None, flags: int = 0) -> Any:
        """A pyopencl Buffer over new CUDA memory (size bytes, rounded up to the allocation
        granularity for CUDA; OpenCL sees `size`), filled from hostbuf when given. flags, OpenCL's
        hints (read-only, host-mappable), change nothing: the memory is device memory either way."""
        cl, cu = _cl(), self.cu
        cu("cuCtxSetCurrent", self.ctx)
        whole = -(-max(size, 1) // self.granularity) * self.granularity
        handle, ptr = u64(), u64()
        cu("cuMemCreate", _c.byref(handle), whole, _c.byref(self.prop), 0)
        try:
            cu("cuMemAddressReserve", _c.byref(ptr), whole, 0, 0, 0)
            cu("cuMemMap", ptr, whole, 0, handle, 0)
            access = _AccessDesc(_Loc(1, self.dev), 3)   # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            cu("cuMemSetAccess", ptr, whole, _c.byref(access), 1)
            fd = _c.c_int(-1)
            cu("cuMemExportToShareableHandle", _c.byref(fd), handle, _POSIX_FD, 0)
        except CudaUnavailable:
            cu("cuMemRelease", handle)
            raise
        self.allocations.append((ptr.value, whole, handle.value))
        props = (u64 * 3)(_EXTERNAL_FD, fd.value, 0)
        err = _c.c_int32(0)
        # a successful import owns the descriptor (as Vulkan's does): it is not closed here
        mem = self._import(vp(self.cl_ctx.int_ptr), props, cl.mem_flags.READ_WRITE, size, None, _c.byref(err))
        if err.value or not mem:
            os.close(fd.value)
            raise CudaUnavailable(f"OpenCL could not import CUDA memory (clCreateBufferWithProperties: {err.value})")
        buf = cl.Buffer.from_int_ptr(mem, retain=False)
        self.pointers[buf.int_ptr] = ptr.value
        if hostbuf is not None:
            self.write(buf, 0, hostbuf)
            self.sync()
        return buf

    def pointer(self, buf: Any) -> int:
        try:
            return self.pointers[buf.int_ptr]
        except KeyError:
            raise CudaUnavailable("a kernel argument is a buffer CUDA did not allocate") from None

    # every call sets the context first: a back end may be driven from another thread than the
    # one that opened it (the server's), and a CUDA context is current per thread
    def write(self, buf: Any, offset: int, data: np.ndarray) -> None:
        """data's bytes into buf at offset, in stream order (pageable memory: CUDA copies it
        before returning, so data may change afterwards)."""
        data = np.ascontiguousarray(data)
        self.cu("cuCtxSetCurrent", self.ctx)
        self.cu("cuMemcpyHtoDAsync_v2", u64(self.pointer(buf) + offset), data.ctypes.data, data.nbytes, self.stream)

    def read(self, out: np.ndarray, buf: Any, offset: int = 0) -> np.ndarray:
        """buf's bytes at offset into `out` (C-contiguous), once the stream has run to here."""
        self.cu("cuCtxSetCurrent", self.ctx)
        self.cu("cuMemcpyDtoHAsync_v2", out.ctypes.data, u64(self.pointer(buf) + offset), out.nbytes, self.stream)
        self.cu("cuStreamSynchronize", self.stream)
        return out

    def sync(self) -> None:
        self.cu("cuCtxSetCurrent", self.ctx)
        self.cu("cuStreamSynchronize", self.stream)

    # -- launches ---------------------------------------------------------------------------
    def _function(self, kernel: Any, pdl: int) -> Any:
        cl, cu = _cl(), self.cu
        prg = kernel.get_info(cl.kernel_info.PROGRAM)
        key = (prg.int_ptr, pdl)
        if key not in self.modules:
            ptx = cuda_ptx(prg.get_info(cl.program_info.BINARIES)[0].decode(errors="replace"))
            if pdl:
                ptx = pdl_ptx(ptx, trigger=pdl == 1)
            mod = vp()
            log = _c.create_string_buffer(4096)
            opts = (_c.c_int * 2)(5, 6)   # CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
            vals = (vp * 2)(_c.cast(log, vp), vp(4096))
            try:
                cu("cuModuleLoadDataEx", _c.byref(mod), ptx.encode() + b"\0", 2, opts, vals)
            except CudaUnavailable as e:
                raise CudaUnavailable(f"{e}: {log.value.decode(errors='replace').strip()[:300]}") from None
            self.modules[key] = (mod, {})
            self._module_list.append(mod)
        mod, functions = self.modules[key]
        name = kernel.function_name
        if name not in functions:
            f = vp()
            cu("cuModuleGetFunction", _c.byref(f), mod, name.encode())
            functions[name] = f
        return functions[name]

    def prepare(self, launches: list[tuple[Any, tuple[int, int], tuple[int, int]]],
                bound_of: dict[int, Any]) -> Replay:
        """The launch list (kernel, global size, local size) as CUDA launches; CudaUnavailable
        where a kernel or argument has no CUDA form, or a size no CUDA launch takes (checked here,
        so that a list never fails part way)."""
        cu = self.cu
        cu("cuCtxSetCurrent", self.ctx)
        out = []
        for kern, gsize, lsize in launches:
            f = self._function(kern, self.pdl)
            most = _c.c_int()
            cu("cuFuncGetAttribute", _c.byref(most), 0, f)   # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
            gx, gy, block = gsize[0] // max(lsize[0], 1), gsize[1], lsize[0]
            if lsize[1] != 1 or gsize[0] % max(block, 1) or not 1 <= block <= most.value \
                    or not 1 <= gx < 2 ** 31 or not 1 <= gy <= 65535:
                raise CudaUnavailable(f"kernel {kern.function_name}: a launch of {gsize} in groups of {lsize} "
                                      f"has no CUDA form (at most {most.value} threads a group)")
            params, vals = kernel_params(bound_of[kern.int_ptr].args, self.pointer)
            out.append((f, gx, gy, block, params, vals))
        return Replay(out, self.pdl, self.stream)

    def _launch_all(self, replay: Replay, capturing: bool) -> None:
        cu, stream = self.cu, self.stream
        for i, (f, gx, gy, block, params, _) in enumerate(replay.launches):
            try:
                if replay.pdl:
                    cu("cuLaunchKernelEx", _c.byref(replay.configs[i]), f, params, None)
                else:
                    cu("cuLaunchKernel", f, gx, gy, 1, block, 1, 1, 0, stream, params, None)
            except CudaUnavailable as err:
                if i and not capturing:   # launches before it will run: the step is not whole
                    raise CudaLaunchFailed(f"{err} after {i} of the list's {len(replay.launches)} launches") from None
                raise

    def run(self, key: Any, replay: Replay, repeat: int = 1) -> None:
        """Enqueue the launch list `repeat` times on the stream: launch by launch on its first
        run, as a graph captured on its second and replayed from then on (a list run once, such
        as a long prompt's one-off size, never pays for a capture)."""
        cu = self.cu
        cu("cuCtxSetCurrent", self.ctx)
        if replay.graph is None and replay.runs >= 1:
            cu("cuStreamBeginCapture_v2", self.stream, 2)   # CU_STREAM_CAPTURE_MODE_RELAXED
            try:
                self._launch_all(replay, capturing=True)
            finally:
                graph = vp()
                cu("cuStreamEndCapture", self.stream, _c.byref(graph))
            ex = vp()
            try:
                cu("cuGraphInstantiateWithFlags", _c.byref(ex), graph, 0)
            finally:
                cu("cuGraphDestroy", graph)
            replay.graph = ex
            self._graph_execs.append(ex)
            self.graphs[key] = replay
            if len(self.graphs) > GRAPHS_KEPT:
                _, old = self.graphs.popitem(last=False)
                self.sync()
                cu("cuGraphExecDestroy", old.graph)
                self._graph_execs.remove(old.graph)
                old.graph = None
        replay.runs += 1
        for _ in range(repeat):
            if replay.graph is not None:
                cu("cuGraphLaunch", replay.graph, self.stream)
            else:
                self._launch_all(replay, capturing=False)


def open_cuda_graphs(ctx: Any, device: Any, notes: list[str]) -> CudaGraphs | None:
    """CudaGraphs for the device where it can run them and LLMRS_OPENCL_CUDA_GRAPHS is not 0;
    else None (on an NVIDIA device, why goes to notes)."""
    if not enabled() or "NVIDIA" not in device.platform.vendor.upper():
        return None
    try:
        pdl_default()
        return CudaGraphs(ctx, device)
    except CudaUnavailable as err:
        notes.append(f"{err}; launching through OpenCL's queue")
        return None
    except ValueError as err:   # a bad LLMRS_OPENCL_CUDA_PDL: the one-line error a back end gives
        raise OpenCLError(str(err)) from None


__all__ = ["CudaGraphs", "CudaLaunchFailed", "CudaUnavailable", "ENVREGS", "GRAPHS_KEPT", "Replay", "cuda_ptx",
           "enabled", "kernel_params", "open_cuda_graphs", "pdl_default", "pdl_ptx"]
