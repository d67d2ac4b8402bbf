"""Kernels bound and launched. bind_program builds every kernel of a plan's program and sets its
arguments once, at load (buffers plus byte offsets; only the step buffer's scalars change per
step). The launchers enqueue launch lists the ways pyopencl cannot: with no event, and as
recorded cl_khr_command_buffer replays; both call the OpenCL C API through ctypes on the handles
of pyopencl's objects.

Why: a decode step is ~80 small kernels, and on NVIDIA's driver the host's enqueue call is the
step's pace. pyopencl asks every enqueue for an event; without one an empty launch costs the
H200's driver 4.2 us of host time instead of 5.8 (tools/bench_opencl.py measures both), and a
1B q4_0 decode step 0.74 ms instead of 0.89. Nothing in a step waits on a per-launch event:
in-order queues order the launches, and a blocking read or finish ends the step.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...compiler.ir import Graph
from .opencl_device import OpenCLError, _cl
from .opencl_memory import ALIGN
from .opencl_program import build_with_fallbacks

_c = ctypes
GREEDY_MAX_STEPS = 4096   # run_greedy_steps: tokens one batch may produce

# the error codes a launch can give on a loaded plan, named as the OpenCL headers name them
_ERRORS = {-4: "CL_MEM_OBJECT_ALLOCATION_FAILURE", -5: "CL_OUT_OF_RESOURCES", -6: "CL_OUT_OF_HOST_MEMORY",
           -36: "CL_INVALID_COMMAND_QUEUE", -48: "CL_INVALID_KERNEL", -52: "CL_INVALID_KERNEL_ARGS",
           -54: "CL_INVALID_WORK_GROUP_SIZE"}


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


# -- binding ----------------------------------------------------------------------------------

@dataclass
class Bound:
    """One kernel with its arguments set, and how to size its launch."""
    op: str
    kernel: Any
    local: int
    groups: int
    rows: int
    row_tile: int
    variant: str = ""   # the fused prologue/epilogue switches, for profiles
    scores: bool = False  # eviction scores: in a step only while the back end is scoring
    part: str = ""      # a step graph's row split: "lead" takes rows 0..lead-1, "rest" the others;
                        # "logits": the head, as many rows as the step has logit rows
    splits: int = 0     # attention_paged_rows built with ATT_GRID_BY_ROWS: its ATT_SPLITS, of which a
                        # step launches only those its longest row needs (0: the grid is fixed)
    family: str = ""    # its template family and build options, and the arguments set on it:
    options: tuple[str, ...] = ()   # what a persistent step (opencl_persistent.py) rebuilds it from
    args: tuple[Any, ...] = ()

    def rows_of(self, n_tokens: int, lead: int, logits: int | None = None) -> int:
        """Rows this launch runs in a step of n_tokens rows split at `lead` (matmul_common.cl
        ROW_SPLIT) with `logits` logit rows (default: every row); 0: nothing to launch."""
        n = (lead if self.part == "lead" else n_tokens - lead if self.part == "rest"
             else n_tokens if self.part != "logits" or logits is None else logits)
        return min(self.rows, n)

    def global_size(self, n_tokens: int, lead: int | None = None, logits: int | None = None,
                    longest: int | None = None) -> tuple[int, int]:
        """longest: the step's longest row in KV entries, which sizes a paged attention's splits."""
        rows = self.rows_of(n_tokens, n_tokens if lead is None else lead, logits)
        groups = self.groups
        if self.splits and longest is not None:   # attention_paged_rows.cl: a row of L entries uses
            groups = self.groups // self.splits * min(self.splits, max(1, -(-longest // self.local)))
        return groups * self.local, math.ceil(rows / self.row_tile)


@dataclass
class Binding:
    """A plan's program bound on one device: what a step enqueues, and the buffers only kernels use."""
    launches: dict[str, list[Bound]]   # phase -> its kernels, in launch order
    greedy: dict[str, Bound]           # phase -> the argmax that follows its kernels on a greedy step
    advance: Bound | None              # decode's argmax that also writes the next step's token and scalars
    scratch: Any                       # kernels' partial results (split attention, greedy argmax), zeroed once
    result: Any                        # int32 [rows]: greedy tokens, the only bytes a greedy step reads back
    staging: Any                       # one launch's output for the next (stage_x's Q8_0 activations)
    steps: Any                         # int32 [GREEDY_MAX_STEPS]: the tokens of a batch of greedy steps


class _Binder:
    """Builds each kernel family once per option set and binds entries of the program's tables."""

    def __init__(self, ctx: Any, queue: Any, device: Any, program: dict[str, Any], graphs: dict[str, Graph],
                 locate: Callable[[str, str], tuple[Any, int]], step_buf: Any, placeholder: Any,
                 device_opts: list[str], notes: list[str]):
        cl = _cl()
        self.ctx, self.device, self.program, self.graphs, self.locate = ctx, device, program, graphs, locate
        self.step_buf, self.placeholder, self.device_opts, self.notes = step_buf, placeholder, device_opts, notes
        self.built: dict[tuple[str, tuple[str, ...]], Any] = {}
        entries = [e for t in program["graphs"].values() for e in t] + list(program.get("greedy", {}).values())
        # every launch gets its own slice: ticket counters must be 0 when a kernel starts, and
        # kernels that take tickets leave theirs at 0, so one zero fill at load lasts
        scratch = sum(-(-a["scratch"] // ALIGN) * ALIGN for e in entries for a in e["args"] if "scratch" in a)
        result = max([a["result"] for e in entries for a in e["args"] if "result" in a], default=0)
        # launches run in order on one queue, so one staging buffer serves every producer /
        # consumer pair (stage_x, then its matmul)
        staging = max([a["staging"] for e in entries for a in e["args"] if "staging" in a], default=0)
        mf = cl.mem_flags
        self.scratch = cl.Buffer(ctx, mf.READ_WRITE, max(scratch, ALIGN))
        cl.enqueue_fill_buffer(queue, self.scratch, np.uint8(0), 0, max(scratch, ALIGN))
        self.result = cl.Buffer(ctx, mf.READ_WRITE, max(result, ALIGN))
        self.staging = cl.Buffer(ctx, mf.READ_WRITE, max(staging, ALIGN))
        self.steps = cl.Buffer(ctx, mf.READ_WRITE, 4 * GREEDY_MAX_STEPS)
        self.scratch_next = 0
        self.scratch_at: dict[tuple[str, str], int] = {}   # (phase, kernel) -> its scratch slice

    def bind(self, phase: str, entry: dict[str, Any], advance: int | None = None) -> Bound:
        """advance: the scratch offset of the phase's greedy launch, whose slice the
        step-advancing copy of it shares (never in flight at the same time)."""
        cl = _cl()
        options = list(entry["options"]) + (["-DARG_ADVANCE"] if advance is not None else [])
        key = (entry["family"], tuple(options))
        if key not in self.built:
            self.built[key] = build_with_fallbacks(self.ctx, self.device, self.program["sources"][entry["family"]],
                                                   options, self.device_opts, entry["family"], self.notes)
        max_wg = self.device.max_work_group_size
        if entry["local"] > max_wg:
            raise OpenCLError(f"kernel {entry['kernel']} of op {entry['op']} needs {entry['local']} "
                              f"threads per group; {self.device.name.strip()} allows {max_wg}")
        kern = cl.Kernel(self.built[key], entry["kernel"])
        args = self._args(phase, entry, advance)
        if advance is not None:
            buf, off = self.locate(phase, self.graphs[phase].inputs[0])
            args += [buf, np.uint64(off)]
        kern.set_args(*args)
        variant = "+".join(o[2:].split("=")[0].lower() for o in entry["options"]
                           if o.startswith(("-DEPI_", "-DPROLOGUE_")))
        splits = next((int(o.split("=")[1]) for o in entry["options"] if o.startswith("-DATT_SPLITS=")), 0) \
            if "-DATT_GRID_BY_ROWS" in entry["options"] else 0
        return Bound(entry["op"], kern, entry["local"], entry["groups"], entry["rows"],
                     entry["row_tile"], variant, bool(entry.get("scores")), entry.get("part", ""), splits,
                     entry["family"], tuple(options), tuple(args))

    def _args(self, phase: str, entry: dict[str, Any], advance: int | None) -> list[Any]:
        args: list[Any] = [self.step_buf]
        for a in entry["args"]:
            if "value" in a:
                buf, off = self.locate(phase, a["value"])
                args += [buf, np.uint64(off)]
            elif "none" in a:
                args += [self.placeholder, np.uint64(0)]
            elif "scratch" in a and advance is not None:
                args += [self.scratch, np.uint64(advance)]
            elif "scratch" in a:
                self.scratch_at[(phase, entry["kernel"])] = self.scratch_next
                args += [self.scratch, np.uint64(self.scratch_next)]
                self.scratch_next += -(-a["scratch"] // ALIGN) * ALIGN
            elif "staging" in a:
                args += [self.staging, np.uint64(0)]
            elif "result" in a and advance is not None:
                args += [self.steps, np.uint64(0)]
            elif "result" in a:
                args += [self.result, np.uint64(0)]
            elif "int" in a:
                args.append(np.int32(a["int"]))
            else:
                args.append(np.float32(a["float"]))
        return args


def bind_program(ctx: Any, queue: Any, device: Any, program: dict[str, Any], graphs: dict[str, Graph],
                 locate: Callable[[str, str], tuple[Any, int]], step_buf: Any, placeholder: Any,
                 device_opts: list[str], notes: list[str]) -> Binding:
    """Every launch of the program's tables for the phases in `graphs`, bound: value arguments at
    locate(phase, value), every kernel's first argument the step buffer (int32 [4]: n_tokens,
    n_past, start_pos, k), `placeholder` for an argument a variant leaves unused. Build
    fallbacks taken are appended to `notes`."""
    b = _Binder(ctx, queue, device, program, graphs, locate, step_buf, placeholder, device_opts, notes)
    launches = {phase: [b.bind(phase, entry) for entry in table]
                for phase, table in program["graphs"].items() if phase in graphs}
    greedy = {phase: b.bind(phase, entry) for phase, entry in program.get("greedy", {}).items() if phase in graphs}
    entry, g = program.get("greedy", {}).get("decode"), graphs.get("decode")
    advance = None
    if entry is not None and entry["rows"] == 1 and g is not None and len(g.inputs) == 1 \
            and g.values[g.inputs[0]].dtype == "i32":
        advance = b.bind("decode", entry, advance=b.scratch_at[("decode", entry["kernel"])])
    return Binding(launches, greedy, advance, b.scratch, b.result, b.staging, b.steps)


__all__ = ["GREEDY_MAX_STEPS", "Bound", "Binding", "CommandBuffer", "DirectLaunches", "OpenCLError", "bind_program",
           "icd_loader"]
