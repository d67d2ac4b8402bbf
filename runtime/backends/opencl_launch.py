"""Kernels bound and launched. bind_program builds every kernel of a plan's program and sets its
arguments once, at load (buffers plus byte offsets; only the step buffer's scalars change per
step). The launchers enqueue launch lists the ways pyopencl cannot: with no event, and as
recorded cl_khr_command_buffer replays; both call the OpenCL C API through ctypes on the handles
of pyopencl's objects.

Why: a decode step is ~80 small kernels, and on NVIDIA's driver the host's enqueue call is the
step's pace. pyopencl asks every enqueue for an event; without one an empty launch costs the
H200's driver 4.2 us of host time instead of 5.8 (tools/bench_opencl.py measures both), and a
1B q4_0 decode step 0.74 ms instead of 0.89. Nothing in a step waits on a per-launch event:
in-order queues order the launches, and a blocking read or finish ends the step. A launch list
goes to the driver from one native loop JIT-compiled at load (_native_loop), not one ctypes call
a launch: greedy decode on the H200 ran 1.27-1.32x faster for it on the q4_0 / q4_1 plans of
82-152 launches a step, and the same on the device-bound 1B f16 plan (BENCHMARKS.md round 21).
"""
from __future__ import annotations

import ctypes
import functools
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


@functools.lru_cache(maxsize=None)   # one JIT a process and driver, however many back ends load
def _native_loop(enqueue_addr: int) -> tuple[Any, Callable[..., int]] | None:
    """A native function that calls clEnqueueNDRangeKernel (at enqueue_addr) for every launch of
    a list, `repeat` times over; (its JIT engine, to keep alive; the function), or None where the
    JIT cannot run here (then the launches go from Python one by one).

    Why: from Python every launch is a ctypes call, 1.3 us of host time each on a Zen 5 (a
    decode step of 82-152 launches: 0.1-0.2 ms), which on NVIDIA's driver adds to the host time
    that paces a decode step. The loop makes a step one ctypes call.

        i64 llmrs_enqueue(fn, queue, n, repeat, kernels[n], sizes[n][4], rc*)
    returns -1 when every launch went, else the index of the launch that failed (its error in rc)."""
    if _c.sizeof(_c.c_size_t) != 8:   # the sizes are passed as 64-bit words
        return None
    try:
        import llvmlite.binding as llvm
        from llvmlite import ir

        from .cpu_native import _host_machine
        i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
        enq = ir.FunctionType(i32, [i8p, i8p, i32, i64.as_pointer(), i64.as_pointer(), i64.as_pointer(), i32,
                                    i8p, i8p])
        mod = ir.Module("llmrs_launch")
        fn = ir.Function(mod, ir.FunctionType(i64, [i8p, i8p, i64, i64, i8p.as_pointer(), i64.as_pointer(),
                                                    i32.as_pointer()]), "llmrs_enqueue")
        fptr, queue, n, repeat, kernels, sizes, rc_out = fn.args
        entry, loop, ok, fail, done = (fn.append_basic_block(x) for x in ("entry", "loop", "ok", "fail", "done"))
        b = ir.IRBuilder(entry)
        total = b.mul(n, repeat)
        call = b.bitcast(fptr, enq.as_pointer())
        b.cbranch(b.icmp_unsigned("==", total, i64(0)), done, loop)
        b.position_at_end(loop)
        t = b.phi(i64)
        t.add_incoming(i64(0), entry)
        i = b.urem(t, n)
        kern = b.load(b.gep(kernels, [i]))
        g = b.gep(sizes, [b.mul(i, i64(4))])
        loc = b.gep(sizes, [b.add(b.mul(i, i64(4)), i64(2))])
        null8, null64 = ir.Constant(i8p, None), ir.Constant(i64.as_pointer(), None)
        rc = b.call(call, [queue, kern, i32(2), null64, g, loc, i32(0), null8, null8])
        b.cbranch(b.icmp_signed("!=", rc, i32(0)), fail, ok)
        b.position_at_end(ok)
        nxt = b.add(t, i64(1))
        t.add_incoming(nxt, ok)
        b.cbranch(b.icmp_unsigned("<", nxt, total), loop, done)
        b.position_at_end(fail)
        b.store(rc, rc_out)
        b.ret(i)
        b.position_at_end(done)
        b.ret(i64(-1))
        parsed = llvm.parse_assembly(str(mod))
        parsed.triple = llvm.get_process_triple()
        parsed.verify()
        engine = llvm.create_mcjit_compiler(parsed, _host_machine())
        engine.finalize_object()
        addr = engine.get_function_address("llmrs_enqueue")
    except Exception:   # noqa: BLE001 (no JIT here, e.g. memory that may not be executable): launch from Python
        return None
    vp = _c.c_void_p
    native = _c.CFUNCTYPE(_c.c_int64, vp, vp, _c.c_int64, _c.c_int64, vp, vp, _c.POINTER(_c.c_int32))(addr)
    return engine, native


class Prepared:
    """A launch list as C arguments: kernel handles and sizes for the native loop, and per launch
    for Python's; the pyopencl kernels it names must outlive it (it holds them)."""

    def __init__(self, launches: list[Launch]):
        self.launches = list(launches)
        self.kernels = [k for k, _, _ in launches]
        self.handles = np.array([k.int_ptr for k in self.kernels], np.uint64)
        self.sizes = np.array([[*g, *l] for _, g, l in launches], np.uint64).reshape(-1, 4)
        self.calls = [(_c.c_void_p(k.int_ptr), (_c.c_size_t * 2)(*g), (_c.c_size_t * 2)(*l))
                      for k, g, l in launches]

    def __len__(self) -> int:
        return len(self.kernels)

    def __getitem__(self, part: slice) -> "Prepared":
        return Prepared(self.launches[part])


class DirectLaunches:
    """Launch lists enqueued by clEnqueueNDRangeKernel with no event. A list is converted to
    C arguments once (prepare) and replayed by enqueue: by one native loop (_native_loop) where
    the JIT runs, else launch by launch from Python (native=False: always, for measurements)."""

    def __init__(self, queue: Any, native: bool = True):
        fn = icd_loader().clEnqueueNDRangeKernel
        vp, sz = _c.c_void_p, _c.POINTER(_c.c_size_t)
        fn.restype = _c.c_int32
        fn.argtypes = [vp, vp, _c.c_uint32, sz, sz, sz, _c.c_uint32, vp, vp]
        self._fn = fn
        self.queue = queue
        self._queue = vp(queue.int_ptr)
        self._fn_addr = _c.cast(fn, vp).value
        self._loop = _native_loop(self._fn_addr) if native else None
        self._rc = _c.c_int32(0)

    @property
    def native(self) -> bool:
        """Whether enqueue runs the native loop."""
        return self._loop is not None

    @staticmethod
    def prepare(launches: list[Launch]) -> Prepared:
        return Prepared(launches)

    def enqueue(self, prepared: Prepared, repeat: int = 1) -> None:
        if not prepared.kernels:
            return
        if self._loop is not None:
            failed = self._loop[1](self._fn_addr, self._queue, len(prepared.kernels), repeat,
                                   prepared.handles.ctypes.data, prepared.sizes.ctypes.data, _c.byref(self._rc))
            if failed >= 0:
                self._failed(prepared.kernels[failed], self._rc.value)
            return
        fn, queue = self._fn, self._queue
        for _ in range(repeat):
            for (kern, gsize, lsize), k in zip(prepared.calls, prepared.kernels):
                rc = fn(queue, kern, 2, None, gsize, lsize, 0, None, None)
                if rc:
                    self._failed(k, rc)

    def _failed(self, kernel: Any, rc: int) -> None:
        raise OpenCLError(f"{self.queue.device.name.strip()}: launching kernel {kernel.function_name} "
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
    rows_from: int = 0  # launched only where its part has this many rows at least (a step's generated
    rows_below: int = 0  # or logit rows) and fewer than rows_below (0: no bound): matvec.cl MV_SX's pair

    def rows_of(self, n_tokens: int, lead: int, logits: int | None = None) -> int:
        """Rows this launch runs in a step of n_tokens rows split at `lead` (matmul_common.cl
        ROW_SPLIT) with `logits` logit rows (default: every row); 0: nothing to launch."""
        n = (lead if self.part == "lead" else n_tokens - lead if self.part == "rest"
             else n_tokens if self.part != "logits" or logits is None else logits)
        if n < self.rows_from or (self.rows_below and n >= self.rows_below):
            return 0
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
                 device_opts: list[str], notes: list[str], alloc: Callable[[int], Any] | None = None):
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
        staging = max([a["staging"] + a.get("at", 0) for e in entries for a in e["args"] if "staging" in a], default=0)
        if alloc is None:
            alloc = functools.partial(cl.Buffer, ctx, cl.mem_flags.READ_WRITE)
        self.scratch = alloc(max(scratch, ALIGN))
        cl.enqueue_fill_buffer(queue, self.scratch, np.uint8(0), 0, max(scratch, ALIGN))
        self.result = alloc(max(result, ALIGN))
        self.staging = alloc(max(staging, ALIGN))
        self.steps = alloc(4 * GREEDY_MAX_STEPS)
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
        # the rows kernel's grid is heads x splits, and the runtime launches only the splits a step
        # needs; attention_paged_tiles shares its options but has a group a head, never split
        splits = next((int(o.split("=")[1]) for o in entry["options"] if o.startswith("-DATT_SPLITS=")), 0) \
            if "-DATT_GRID_BY_ROWS" in entry["options"] and entry["kernel"] == "attention_paged_rows" else 0
        return Bound(entry["op"], kern, entry["local"], entry["groups"], entry["rows"],
                     entry["row_tile"], variant, bool(entry.get("scores")), entry.get("part", ""), splits,
                     entry["family"], tuple(options), tuple(args), entry.get("rows_from", 0),
                     entry.get("rows_below", 0))

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
                args += [self.staging, np.uint64(a.get("at", 0))]
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
                 device_opts: list[str], notes: list[str], alloc: Callable[[int], Any] | None = None) -> Binding:
    """Every launch of the program's tables for the phases in `graphs`, bound: value arguments at
    locate(phase, value), every kernel's first argument the step buffer (int32 [4]: n_tokens,
    n_past, start_pos, k), `placeholder` for an argument a variant leaves unused. Build
    fallbacks taken are appended to `notes`. alloc(size): where the kernels' own buffers come from
    (default: OpenCL's; memory CUDA shares: opencl_cuda.py)."""
    b = _Binder(ctx, queue, device, program, graphs, locate, step_buf, placeholder, device_opts, notes, alloc)
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
