"""Run a plan's graphs with OpenCL: one arena buffer, weights uploaded once, kernels bound once.

Memory (all planned at compile time, graph.meta["layout"]):
    arena    one buffer, CL_MEM_ALLOC_HOST_PTR (the host maps it without copies): every
             activation and input, prefill and decode sharing it
    weights  the plan's weights section, read-only, uploaded once; quantized tensors are
             converted to the split layout of templates/opencl/common.cl (quants, then
             scales; same size, so every offset stays the plan's)
    kv       the KV caches, persistent across steps
    step     int32[4]: n_tokens, n_past, start_pos, k; written once per step, or once per
             batch of greedy steps, which advance it on the device (k: the batch's step)
    scratch  kernels' partial results (split attention, greedy argmax), zero-filled once
    result   int32 [rows]: greedy tokens, the only bytes a greedy step reads back
    staging  one launch's output for the next (stage_x's Q8_0 activations for its matmul)
A region larger than CL_DEVICE_MAX_MEM_ALLOC_SIZE is split over several buffers at tensor
boundaries. Every kernel's arguments are set at load; a step writes `step` and the tokens,
enqueues the launch table and reads the logits back.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ...compiler.ir import Graph, IRError, storage_shape
from ..plan import Plan
from .opencl_launch import CommandBuffer, DirectLaunches, OpenCLError
from .opencl_probe import FIX as PROBE_FIX, is_pocl, why_unusable

ALIGN = 64
GREEDY_MAX_STEPS = 4096   # run_greedy_steps: tokens one batch may produce
COMMAND_BUFFERS_KEPT = 8  # recorded launch lists kept (one per phase and size), oldest dropped
# per 32-value block: (header bytes, quant bytes); the header is the f16 scale d, and for
# q4_1 d then the f16 minimum m, kept together so a kernel reads both in one 4-byte load
_SPLIT_BYTES = {"q4_0": (2, 16), "q4_1": (4, 16), "q8_0": (2, 32)}


def to_split_blocks(raw: np.ndarray, dtype: str) -> np.ndarray:
    """GGML blocks (uint8, any shape) -> the device's split layout: every block's quants, then
    every block's header (f16 scale; q4_1: scale and minimum); the same number of bytes."""
    hb, qb = _SPLIT_BYTES[dtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, hb + qb)
    return np.concatenate([blocks[:, hb:].reshape(-1), blocks[:, :hb].reshape(-1)])


def from_split_blocks(data: np.ndarray, dtype: str) -> np.ndarray:
    """The inverse of to_split_blocks: uint8 [nbytes] of GGML blocks."""
    hb, qb = _SPLIT_BYTES[dtype]
    n = data.size // (hb + qb)
    out = np.empty((n, hb + qb), np.uint8)
    out[:, hb:] = data[:n * qb].reshape(n, qb)
    out[:, :hb] = data[n * qb:].reshape(n, hb)
    return out.reshape(-1)


def _cl():
    try:
        import pyopencl as cl
    except ImportError as e:
        raise OpenCLError(f"pyopencl is not installed ({e}); pip install pyopencl "
                          "pocl-binary-distribution") from None
    return cl


# -- device choice ----------------------------------------------------------------------------

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


# -- memory regions ---------------------------------------------------------------------------

@dataclass
class Region:
    """A planned region held in one or more device buffers: chunks[i] = (start, end, buffer)."""
    name: str
    chunks: list[tuple[int, int, Any]]

    def locate(self, offset: int, nbytes: int, what: str) -> tuple[Any, int]:
        for start, end, buf in self.chunks:
            if start <= offset and offset + nbytes <= end:
                return buf, offset - start
        raise OpenCLError(f"{what} at {self.name} offset {offset} (+{nbytes} B) lies in no buffer of the region")


def split_region(intervals: Iterable[tuple[int, int]], max_bytes: int, what: str) -> list[tuple[int, int]]:
    """Chunks [start, end) covering the intervals, each <= max_bytes, no interval cut in two.
    Overlapping intervals (reused arena storage) form one cluster that cannot be cut."""
    clusters: list[list[int]] = []
    for s, e in sorted(intervals):
        if clusters and s < clusters[-1][1]:
            clusters[-1][1] = max(clusters[-1][1], e)
        else:
            clusters.append([s, e])
    chunks: list[tuple[int, int]] = []
    for s, e in clusters:
        if e - s > max_bytes:
            raise OpenCLError(f"{what}: {e - s} bytes at offset {s} must sit in one buffer but the device "
                              f"allows {max_bytes} per allocation; use a smaller prefill chunk or weights dtype")
        if chunks and e - chunks[-1][0] <= max_bytes:
            chunks[-1] = (chunks[-1][0], e)
        else:
            chunks.append((s, e))
    return chunks


def naive_layout(graphs: dict[str, Graph]) -> dict[str, dict[str, Any]]:
    """A layout in plan_memory's format with no reuse at all: for graphs that were not planned."""
    kv: dict[str, int] = {}
    kv_bytes = 0
    for g in graphs.values():
        for name in g.state:
            if name not in kv:
                kv[name] = kv_bytes
                kv_bytes += -(-g.values[name].nbytes // ALIGN) * ALIGN
    out = {}
    for phase, g in graphs.items():
        arena, off = {}, 0
        for v in g.values.values():
            if v.kind in ("input", "act") and v.alias is None:
                arena[v.name] = off
                off += -(-v.nbytes // ALIGN) * ALIGN
        out[phase] = {"alignment": ALIGN, "arena_bytes": off, "arena": arena, "kv_bytes": kv_bytes, "kv": kv}
    return out


# -- program builds ---------------------------------------------------------------------------

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
    sm_90a; LLMRS_OPENCL_NO_WGMMA=1 keeps mma.sync; LLMRS_OPENCL_EMULATE_WGMMA=1 emulates it)."""
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(prg.get_info(cl.program_info.BINARIES)[0])
        tmp.replace(path)
    except OSError:
        pass  # the cache is an optimisation; a read-only home still runs
    return prg


# -- the back end -----------------------------------------------------------------------------

@dataclass
class _Bound:
    op: str
    kernel: Any
    local: int
    groups: int
    rows: int
    row_tile: int
    variant: str = ""   # the fused prologue/epilogue switches, for profiles
    scores: bool = False  # eviction scores: in a step only while self.scoring

    def global_size(self, n_tokens: int) -> tuple[int, int]:
        return self.groups * self.local, math.ceil(min(self.rows, n_tokens) / self.row_tile)


class OpenCLBackend:
    """Runs the plan's prefill and decode graphs on one OpenCL device."""

    def __init__(self, plan: Any, device: int | str | None = None, kv_host: np.ndarray | None = None):
        """kv_host: host memory (uint8, at least the plan's KV bytes) the KV buffers are made over
        (CL_MEM_USE_HOST_PTR), so another back end shares the cache (runtime/backends/hybrid.py)."""
        missing = plan.missing_code("opencl") if isinstance(plan, Plan) else None
        if missing:   # the compiler left this back end out: say why, not which section is absent
            raise OpenCLError(f"{plan.path}: {missing}")
        try:
            program = json.loads(bytes(plan.section("opencl")).decode())
        except (KeyError, ValueError) as e:
            raise OpenCLError(f"{getattr(plan, 'path', 'plan')}: no usable 'opencl' section ({e}); "
                              "recompile with the opencl target") from None
        tensors = {n: (t.offset, t.nbytes) for n, t in plan.tensors.items()}
        self._setup(plan.graphs(), program, plan.weights_region(), tensors, device, kv_host)

    @classmethod
    def from_graphs(cls, graphs: dict[str, Graph] | Iterable[Graph], program: dict[str, Any] | None = None,
                    device: int | str | None = None) -> "OpenCLBackend":
        """A back end for graphs held in memory (tests, llmrs-check): weights are packed here,
        graphs without a memory plan get naive_layout()."""
        if not isinstance(graphs, dict):
            graphs = {g.name: g for g in graphs}
        if program is None:
            from ...compiler.codegen.opencl import generate  # tests only: a plan carries its program
            program = generate(graphs)
        tensors: dict[str, tuple[int, int]] = {}
        blobs: dict[str, np.ndarray] = {}
        off = 0
        for g in graphs.values():
            for name in g.by_kind("param") + g.by_kind("const"):
                if name not in tensors:
                    blobs[name] = np.ascontiguousarray(g.weights[name].load()).view(np.uint8).reshape(-1)
                    tensors[name] = (off, blobs[name].nbytes)
                    off += -(-blobs[name].nbytes // ALIGN) * ALIGN
        region = np.zeros(max(off, ALIGN), np.uint8)
        for name, (o, n) in tensors.items():
            region[o:o + n] = blobs[name]
        self = cls.__new__(cls)
        self._setup(graphs, program, region, tensors, device)
        return self

    # -- load ---------------------------------------------------------------------------------
    def _setup(self, graphs: dict[str, Graph], program: dict[str, Any], region: np.ndarray,
               tensors: dict[str, tuple[int, int]], device: int | str | None,
               kv_host: np.ndarray | None = None) -> None:
        cl = _cl()
        if program.get("format") != 1:
            raise OpenCLError(f"opencl section format {program.get('format')!r} is not 1; recompile the plan")
        self.graphs = graphs
        self.device = pick_device(device)
        self.device_name = self.device.name.strip()
        try:
            self.ctx = cl.Context([self.device])
            self.queue = cl.CommandQueue(self.ctx)
        except cl.Error as e:
            raise OpenCLError(f"cannot open OpenCL device {self.device_name}: {e}") from None
        self.layouts = {p: g.meta["layout"] for p, g in graphs.items() if "layout" in g.meta}
        if len(self.layouts) != len(graphs):
            self.layouts = naive_layout(graphs)
        self.max_alloc = int(os.environ.get("LLMRS_OPENCL_MAX_ALLOC") or self.device.max_mem_alloc_size)
        try:
            self._alloc(region, tensors, kv_host)
            self._bind(program)
        except cl.MemoryError as e:
            raise OpenCLError(f"out of memory on OpenCL device {self.device_name} ({e}); "
                              "use smaller weights (--weights q4_0) or a shorter --max-seq-len") from None
        except cl.Error as e:
            raise OpenCLError(f"OpenCL device {self.device_name} failed while loading the plan: {e}") from None

    def _alloc(self, region: np.ndarray, tensors: dict[str, tuple[int, int]], kv_host: np.ndarray | None = None) -> None:
        cl = _cl()
        mf = cl.mem_flags
        used = {n for g in self.graphs.values() for n in g.by_kind("param") + g.by_kind("const")}
        for n in used:
            if n not in tensors:
                raise OpenCLError(f"tensor {n!r} is used by the graphs but missing from the plan's weights")
        w_chunks = split_region([(tensors[n][0], tensors[n][0] + tensors[n][1]) for n in used],
                                self.max_alloc, "weights") or [(0, ALIGN)]
        self.quantized = {n: v.dtype for g in self.graphs.values() for n, v in g.values.items()
                          if n in used and v.dtype in _SPLIT_BYTES}
        self.weights = Region("weights", [
            (s, e, cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=self._device_bytes(region, tensors, s, e)))
            for s, e in w_chunks])
        self.tensors = tensors
        kv = next(iter(self.layouts.values()))["kv"]
        kv_sizes = {n: g.values[n].nbytes for g in self.graphs.values() for n in g.state}
        kv_chunks = split_region([(kv[n], kv[n] + kv_sizes[n]) for n in kv_sizes], self.max_alloc, "KV cache")
        if kv_host is None:
            self.kv = Region("kv", [(s, e, cl.Buffer(self.ctx, mf.READ_WRITE, e - s)) for s, e in kv_chunks])
        else:
            self.kv = Region("kv", [(s, e, cl.Buffer(self.ctx, mf.READ_WRITE | mf.USE_HOST_PTR, hostbuf=kv_host[s:e]))
                                    for s, e in kv_chunks])
        self.kv_offsets = kv
        spans = []
        for phase, g in self.graphs.items():
            for n, o in self.layouts[phase]["arena"].items():
                if n in g.values:
                    spans.append((o, o + g.values[n].nbytes))
        a_chunks = split_region(spans, self.max_alloc, "activation arena")
        self.arena = Region("arena", [(s, e, cl.Buffer(self.ctx, mf.READ_WRITE | mf.ALLOC_HOST_PTR, e - s))
                                      for s, e in a_chunks])
        self.step_buf = cl.Buffer(self.ctx, mf.READ_WRITE, 16)   # greedy steps advance it
        self._in_flight: list[np.ndarray] = []
        self._limits: dict[str, tuple[int, int, int | None]] = {}
        self._sized: dict[tuple[str, int, bool], list[Any]] = {}
        self._command_buffers: dict[tuple[Any, ...], CommandBuffer] = {}
        self._prepared: dict[tuple[Any, ...], list[Any]] = {}
        self.use_command_buffers = ("cl_khr_command_buffer" in self.device.extensions.split()
                                    and os.environ.get("LLMRS_OPENCL_NO_COMMAND_BUFFER", "") in ("", "0"))
        self.reset()

    def _device_bytes(self, region: np.ndarray, tensors: dict[str, tuple[int, int]], start: int, end: int) -> np.ndarray:
        """Bytes [start, end) of the weights region as the kernels read them."""
        chunk = np.asarray(region[start:end])
        inside = [n for n in self.quantized if start <= tensors[n][0] < end]
        if not inside:
            return chunk
        chunk = np.array(chunk)     # a private copy: the plan's memmap stays GGML bytes
        for n in inside:
            o, nbytes = tensors[n][0] - start, tensors[n][1]
            chunk[o:o + nbytes] = to_split_blocks(chunk[o:o + nbytes], self.quantized[n])
        return chunk

    def locate(self, phase: str, name: str) -> tuple[Any, int]:
        """(buffer, byte offset) holding value `name` of graph `phase`."""
        v = self.graphs[phase].values[name]
        if v.kind in ("param", "const"):
            off, n = self.tensors[name]
            return self.weights.locate(off, n, f"tensor {name!r}")
        if v.kind == "state" or v.alias:
            state = v.alias or name
            return self.kv.locate(self.kv_offsets[state], v.nbytes, f"cache {state!r}")
        arena = self.layouts[phase]["arena"]
        if name not in arena:
            raise OpenCLError(f"graph {phase}: value {name!r} has no arena offset in the memory plan")
        return self.arena.locate(arena[name], v.nbytes, f"value {name!r}")

    def _bind(self, program: dict[str, Any]) -> None:
        cl = _cl()
        extra = device_options(self.device)
        self.build_options = extra
        self.build_notes: list[str] = []   # build fallbacks taken, for benchmarks and reports
        try:
            self.direct: DirectLaunches | None = DirectLaunches(self.queue)
        except OpenCLError as err:   # no loader reachable by ctypes: pyopencl enqueues, with events
            self.direct = None
            self.build_notes.append(f"{err}; launching through pyopencl")
        built: dict[tuple[str, tuple[str, ...]], Any] = {}
        self.launches: dict[str, list[_Bound]] = {}
        self.kernel_table = program["graphs"]
        self.program = program
        self.scoring = False    # runtime/kv turns eviction scores on for the steps that want them
        max_wg = self.device.max_work_group_size
        entries = [e for t in program["graphs"].values() for e in t] + list(program.get("greedy", {}).values())
        # every launch gets its own slice: ticket counters must be 0 when a kernel starts, and
        # kernels that take tickets leave theirs at 0, so one zero fill at load lasts
        scratch = sum(-(-a["scratch"] // ALIGN) * ALIGN for e in entries for a in e["args"] if "scratch" in a)
        result = max([a["result"] for e in entries for a in e["args"] if "result" in a], default=0)
        # launches run in order on one queue, so one staging buffer serves every producer /
        # consumer pair (stage_x, then its matmul)
        staging = max([a["staging"] for e in entries for a in e["args"] if "staging" in a], default=0)
        mf = cl.mem_flags
        self.scratch_buf = cl.Buffer(self.ctx, mf.READ_WRITE, max(scratch, ALIGN))
        cl.enqueue_fill_buffer(self.queue, self.scratch_buf, np.uint8(0), 0, max(scratch, ALIGN))
        scratch_at = [0]
        self.result_buf = cl.Buffer(self.ctx, mf.READ_WRITE, max(result, ALIGN))
        self.staging_buf = cl.Buffer(self.ctx, mf.READ_WRITE, max(staging, ALIGN))
        self.steps_buf = cl.Buffer(self.ctx, mf.READ_WRITE, 4 * GREEDY_MAX_STEPS)  # int32 [steps]
        self._scratch_at: dict[tuple[str, str], int] = {}

        def bind(phase: str, entry: dict[str, Any], advance: int | None = None) -> _Bound:
            """advance: the scratch offset of the phase's greedy launch, whose slice the
            step-advancing copy of it shares (never in flight at the same time)."""
            options = list(entry["options"]) + (["-DARG_ADVANCE"] if advance is not None else [])
            key = (entry["family"], tuple(options))
            if key not in built:
                src, opts = program["sources"][entry["family"]], options
                # a driver whose PTX assembler rejects wgmma still runs mma.sync, and one that
                # rejects mma.sync the fp32 body
                tries = [extra] + [[o for o in extra if o not in drop] for drop in
                                   (("-DUSE_NV_WGMMA",), ("-DUSE_NV_WGMMA", "-DUSE_NV_MMA")) if drop[-1] in extra]
                for i, opts_dev in enumerate(tries):
                    try:
                        built[key] = build_program(self.ctx, self.device, src, opts + opts_dev, entry["family"])
                        break
                    except OpenCLError as err:
                        if i == len(tries) - 1:
                            raise
                        dropped = " ".join(o for o in tries[i] if o not in tries[i + 1])
                        note = f"{err}; built without {dropped}"
                        warnings.warn(note)
                        self.build_notes.append(note)
            if entry["local"] > max_wg:
                raise OpenCLError(f"kernel {entry['kernel']} of op {entry['op']} needs {entry['local']} "
                                  f"threads per group; {self.device_name} allows {max_wg}")
            kern = cl.Kernel(built[key], entry["kernel"])
            args: list[Any] = [self.step_buf]
            for a in entry["args"]:
                if "value" in a:
                    buf, off = self.locate(phase, a["value"])
                    args += [buf, np.uint64(off)]
                elif "none" in a:
                    args += [self.arena.chunks[0][2], np.uint64(0)]
                elif "scratch" in a and advance is not None:
                    args += [self.scratch_buf, np.uint64(advance)]
                elif "scratch" in a:
                    self._scratch_at[(phase, entry["kernel"])] = scratch_at[0]
                    args += [self.scratch_buf, np.uint64(scratch_at[0])]
                    scratch_at[0] += -(-a["scratch"] // ALIGN) * ALIGN
                elif "staging" in a:
                    args += [self.staging_buf, np.uint64(0)]
                elif "result" in a and advance is not None:
                    args += [self.steps_buf, np.uint64(0)]
                elif "result" in a:
                    args += [self.result_buf, np.uint64(0)]
                elif "int" in a:
                    args.append(np.int32(a["int"]))
                else:
                    args.append(np.float32(a["float"]))
            if advance is not None:
                args += list(self.locate(phase, self.graphs[phase].inputs[0]))
                args[-1] = np.uint64(args[-1])
            kern.set_args(*args)
            variant = "+".join(o[2:].split("=")[0].lower() for o in entry["options"]
                               if o.startswith(("-DEPI_", "-DPROLOGUE_")))
            return _Bound(entry["op"], kern, entry["local"], entry["groups"], entry["rows"],
                          entry["row_tile"], variant, bool(entry.get("scores")))

        for phase, table in program["graphs"].items():
            if phase in self.graphs:
                self.launches[phase] = [bind(phase, entry) for entry in table]
        self.greedy = {phase: bind(phase, entry) for phase, entry in program.get("greedy", {}).items()
                       if phase in self.graphs}
        # decode's argmax that also writes the next step's token and scalars: run_greedy_steps
        entry = program.get("greedy", {}).get("decode")
        g = self.graphs.get("decode")
        self.advance = None
        if entry is not None and entry["rows"] == 1 and g is not None and len(g.inputs) == 1 \
                and g.values[g.inputs[0]].dtype == "i32":
            self.advance = bind("decode", entry, advance=self._scratch_at[("decode", entry["kernel"])])

    # -- steps --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the KV cache (zero bytes, so stale slots never hold NaNs)."""
        cl = _cl()
        for s, e, buf in self.kv.chunks:
            cl.enqueue_fill_buffer(self.queue, buf, np.uint8(0), 0, e - s)
        self.queue.finish()
        self.scoring = False    # the score control is zero now: off

    def kv_store(self):
        """The caches for eviction (runtime/kv): scores read back, rows moved by kv_compact.cl."""
        from ..kv.opencl import OpenCLKV
        return OpenCLKV(self)

    def write_value(self, phase: str, name: str, arr: np.ndarray) -> None:
        """Copy host data into a value's storage (inputs of single-kernel checks, caches);
        quantized weights are given as GGML blocks, as the plan holds them."""
        cl = _cl()
        buf, off = self.locate(phase, name)
        data = np.ascontiguousarray(arr)
        if name in self.quantized:
            data = to_split_blocks(data.view(np.uint8), self.quantized[name])
        cl.enqueue_copy(self.queue, buf, data, dst_offset=off, is_blocking=True)

    def read_value(self, phase: str, name: str, rows: int | None = None) -> np.ndarray:
        """A value's current contents in its storage dtype; `rows` limits the first axis."""
        cl = _cl()
        v = self.graphs[phase].values[name]
        shape, np_dtype = storage_shape(v.shape, v.dtype)
        if rows is not None:
            shape = (min(rows, shape[0]), *shape[1:])
        out = np.empty(shape, np_dtype)
        buf, off = self.locate(phase, name)
        cl.enqueue_copy(self.queue, out, buf, src_offset=off, is_blocking=True)
        if name in self.quantized and rows is None:
            out = from_split_blocks(out.reshape(-1), self.quantized[name]).reshape(shape)
        elif name in self.quantized:
            raise OpenCLError(f"read_value: weight {name!r} is stored split on the device; read it whole (rows=None)")
        return out

    def _step_limits(self, phase: str) -> tuple[int, int, int | None]:
        """(tokens per step, KV slots, embedding vocab or None) of a graph: a step's checks."""
        if phase not in self._limits:
            g = self.graphs[phase]
            slots = g.kv_slots or 1 << 62
            vocab = next((g.values[op.inputs[0]].shape[0] for op in g.ops if op.kind == "embedding"), None)
            self._limits[phase] = (g.T, slots, vocab)
        return self._limits[phase]

    def _step_launches(self, phase: str, n_tokens: int) -> list[tuple[Any, tuple[int, int], tuple[int, int]]]:
        """(kernel, global size, local size) of every launch of a step, computed once per size."""
        key = (phase, n_tokens, self.scoring)
        if key not in self._sized:
            self._sized[key] = [(b.kernel, b.global_size(n_tokens), (b.local, 1)) for b in self.launches[phase]
                                if self.scoring or not b.scores]
        return self._sized[key]

    def enqueue(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int, kernels: bool = True) -> None:
        """Write the step's tokens and scalars and enqueue every kernel of the phase (none with
        kernels=False: profiles enqueue their own); returns without waiting (the arena's token
        slot may be reused within a step, so every step writes its tokens again)."""
        cl = _cl()
        g = self.graphs[phase]
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n_tokens = len(tokens)
        T, slots, vocab = self._step_limits(phase)
        if not 1 <= n_tokens <= T:
            raise IRError(f"graph {phase} takes 1..{T} tokens per step, got {n_tokens}")
        if n_past + n_tokens > slots:
            raise IRError(f"KV cache of graph {phase} holds {slots} tokens; {n_past} + {n_tokens} do not fit")
        if vocab is not None and (tokens.min() < 0 or tokens.max() >= vocab):
            raise IRError(f"graph {phase}: token id out of range 0..{vocab - 1}")
        # fills copy their pattern when enqueued, so no host array must outlive the call
        step = np.array([n_tokens, n_past, start_pos, 0], np.int32)
        cl.enqueue_fill_buffer(self.queue, self.step_buf, step, 0, step.nbytes)
        if g.inputs:
            buf, off = self.locate(phase, g.inputs[0])
            if n_tokens == 1:
                cl.enqueue_fill_buffer(self.queue, buf, tokens, off, 4)
            else:
                self._in_flight.append(tokens)   # released by the next blocking read
                cl.enqueue_copy(self.queue, buf, tokens, dst_offset=off, is_blocking=False)
        if kernels:
            self._enqueue_launches((phase, n_tokens, "logits", self.scoring), self._step_launches(phase, n_tokens))

    def _enqueue_launches(self, key: tuple[Any, ...], launches: list[tuple[Any, tuple[int, int], tuple[int, int]]],
                          repeat: int = 1) -> None:
        """Enqueue a launch list `repeat` times over: replayed from a command buffer recorded on
        first use where the driver has cl_khr_command_buffer (LLMRS_OPENCL_NO_COMMAND_BUFFER=1:
        never), else kernel by kernel with no events (opencl_launch.DirectLaunches), else
        through pyopencl."""
        cb = self._command_buffers.get((key, repeat))
        if cb is None and self.use_command_buffers:
            try:
                cb = CommandBuffer(self.queue, launches * repeat)
            except OpenCLError as err:   # a driver whose extension misbehaves still runs, launch by launch
                self.use_command_buffers = False
                warnings.warn(str(err))
                self.build_notes.append(f"{err}; enqueuing kernel by kernel")
            else:
                if len(self._command_buffers) >= COMMAND_BUFFERS_KEPT:
                    self._command_buffers.pop(next(iter(self._command_buffers))).release()
                self._command_buffers[(key, repeat)] = cb
        if cb is not None:
            try:
                cb.enqueue()
                return
            except OpenCLError as err:
                # PoCL refuses to re-enqueue a recording that is still pending (greedy steps
                # queued back to back): the launches still run, one by one, from now on
                self.use_command_buffers = False
                for kept in self._command_buffers.values():
                    kept.release()
                self._command_buffers.clear()
                warnings.warn(str(err))
                self.build_notes.append(f"{err}; enqueuing kernel by kernel")
        if self.direct is not None:
            prepared = self._prepared.get(key)
            if prepared is None:
                prepared = self._prepared[key] = self.direct.prepare(launches)
            for _ in range(repeat):
                self.direct.enqueue(prepared)
            return
        cl = _cl()
        queue, launch = self.queue, cl.enqueue_nd_range_kernel
        for _ in range(repeat):
            for kern, gsize, lsize in launches:
                launch(queue, kern, gsize, lsize)

    def run_greedy_steps(self, token: int, n_past: int, start_pos: int, n: int) -> np.ndarray:
        """n greedy decode steps enqueued back to back, one read at the end: step i feeds the
        token step i - 1 chose (the first feeds `token`) at n_past + i, start_pos + i; the
        device's argmax writes each next token and the step's scalars itself. int32 [n], the
        chosen tokens, as n calls of run_argmax("decode", ...) would give them (a caller
        stopping at an end-of-sequence token drops what follows it; the cache holds those
        steps' keys past the stop, which the next step's n_past overwrites)."""
        cl = _cl()
        if self.advance is None:
            raise OpenCLError("this plan's decode graph has no one-token device argmax; use run_argmax")
        if not 1 <= n <= GREEDY_MAX_STEPS:
            raise ValueError(f"run_greedy_steps: n = {n}; take 1..{GREEDY_MAX_STEPS} steps per call")
        _, slots, _ = self._step_limits("decode")
        if n_past + n > slots:
            raise IRError(f"KV cache of graph decode holds {slots} tokens; {n_past} + {n} steps do not fit")
        self.enqueue("decode", np.array([token], np.int32), n_past, start_pos, kernels=False)
        a = self.advance
        step = self._step_launches("decode", 1) + [(a.kernel, a.global_size(1), (a.local, 1))]
        self._enqueue_launches(("greedy", self.scoring), step, repeat=n)
        out = np.empty(n, np.int32)
        cl.enqueue_copy(self.queue, out, self.steps_buf, is_blocking=True)
        self._in_flight.clear()
        return out

    def run_argmax(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        """The engine's greedy path: int32 [rows] chosen on the device when the plan has the
        kernel, else the argmax of the logits read back (plans compiled before it existed)."""
        if phase in self.greedy:
            return self.run(phase, tokens, n_past, start_pos, want="argmax")
        return np.argmax(self.run(phase, tokens, n_past, start_pos), axis=-1).astype(np.int32)

    def run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int | None = None,
            want: str = "logits") -> np.ndarray:
        """One step. want="logits": float32 [rows, vocab] of the graph's output;
        want="argmax": int32 [rows], each row's argmax (first of equal maxima, as numpy)
        taken on the device, so a greedy step reads back 4 bytes per row."""
        cl = _cl()
        g = self.graphs[phase]
        tokens = np.asarray(tokens).reshape(-1)
        if want not in ("logits", "argmax"):
            raise ValueError(f"run(want={want!r}): choose 'logits' or 'argmax'")
        if want == "argmax" and phase not in self.greedy:
            raise OpenCLError(f"graph {phase} has no device argmax in this plan; recompile it or use want='logits'")
        self.enqueue(phase, tokens, n_past, n_past if start_pos is None else start_pos, kernels=False)
        launches = self._step_launches(phase, len(tokens))
        if want == "argmax":
            b = self.greedy[phase]
            launches = launches + [(b.kernel, b.global_size(len(tokens)), (b.local, 1))]
        self._enqueue_launches((phase, len(tokens), want, self.scoring), launches)
        if want == "argmax":
            rows = min(len(tokens), b.rows)
            out = np.empty(rows, np.int32)
            cl.enqueue_copy(self.queue, out, self.result_buf, is_blocking=True)
        else:
            out = self.read_value(phase, g.outputs[0], rows=len(tokens)).astype(np.float32, copy=False)
        self._in_flight.clear()
        return out
