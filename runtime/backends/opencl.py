"""Run a plan's graphs with OpenCL: one arena buffer, weights uploaded once, kernels bound once.

The parts, one module each: which device (opencl_device.py), its programs and their build cache
(opencl_program.py), the planned memory regions (opencl_memory.py: weights, kv, arena), the
kernels bound and the ways to launch them (opencl_launch.py). This module is the back end: it
opens them in that order and runs steps. Besides the regions it holds
    step     int32[4]: n_tokens, n_past, start_pos, k; written once per step, or once per
             batch of greedy steps, which advance it on the device (k: the batch's step; in a
             step graph's step, its generated rows: common.cl ROW_SPLIT)
and the kernels' own buffers (scratch, result, staging: opencl_launch.Binding). Every kernel's
arguments are set at load; a step writes `step` and the tokens, enqueues the launch table and
reads the logits back.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Callable, Iterable

import numpy as np

from ...compiler.ir import Graph, IRError, storage_shape
from ..plan import PREFILL_SHORT, VERIFY, Plan
from .base import Backend, StepRows, check_step_tokens
# the parts' public names, importable from here as before the split
from .opencl_device import INSTALL_OPENCL, OpenCLError, _cl, list_devices, pick_device
from .opencl_launch import GREEDY_MAX_STEPS, Bound, CommandBuffer, DirectLaunches, bind_program
from .opencl_chain import ChainedStep, ChainError, ChainProgram
from .opencl_cuda import CudaGraphs, CudaLaunchFailed, CudaUnavailable, Replay, open_cuda_graphs
from .opencl_persistent import PersistentError, PersistentProgram, PersistentStep
from .opencl_memory import (ALIGN, DeviceMemory, Region, from_split_blocks, naive_layout, pack_weights,
                            split_region, to_split_blocks)
from .opencl_program import build_program, cache_dir, device_options, patch_wgmma_ptx
from .opencl_step import InputRun, PreparedStep, StepShape, check_step, input_runs, split_rows

COMMAND_BUFFERS_KEPT = 8  # recorded launch lists kept (one per phase and size), oldest dropped


class OpenCLBackend(Backend):
    """Runs the plan's prefill and decode graphs on one OpenCL device."""
    name = "opencl"
    device_argmax = True     # the plan's argmax kernel (plans without one: the logits read back)
    async_steps = True       # a step's launches are enqueued; the host waits only for its result
    locate: Callable[[str, str], tuple[Any, int]]   # (buffer, byte offset) of a graph's value: DeviceMemory.locate

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
    def from_graphs(cls, graphs: dict[str, Graph] | Iterable[Graph], program: dict[str, Any],
                    device: int | str | None = None) -> "OpenCLBackend":
        """A back end for graphs held in memory and their generated program (tests, llmrs-check:
        compiler/codegen/opencl.py's generate(graphs)): weights are packed here, graphs without a
        memory plan get naive_layout()."""
        if not isinstance(graphs, dict):
            graphs = {g.name: g for g in graphs}
        region, tensors = pack_weights(graphs)
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
        self.verify_graph = VERIFY in graphs and VERIFY in program["graphs"]
        # prefill steps of up to this many tokens run the short prefill graph (0: none in the plan)
        self._short_T = graphs[PREFILL_SHORT].T if PREFILL_SHORT in graphs and PREFILL_SHORT in program["graphs"] else 0
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
        self.build_notes: list[str] = []   # build fallbacks taken, for benchmarks and reports
        try:
            self._alloc(region, tensors, kv_host)
            self._bind(program)
        except cl.MemoryError as e:
            raise OpenCLError(f"out of memory on OpenCL device {self.device_name} ({e}); "
                              "use smaller weights (--weights q4_0) or a shorter --max-seq-len") from None
        except cl.Error as e:
            raise OpenCLError(f"OpenCL device {self.device_name} failed while loading the plan: {e}") from None

    def _alloc(self, region: np.ndarray, tensors: dict[str, tuple[int, int]], kv_host: np.ndarray | None) -> None:
        cl = _cl()
        # NVIDIA: launch lists replayed as CUDA graphs on memory both APIs share (opencl_cuda.py).
        # Not with a cache in host memory (the hybrid back end's) or the opt-in persistent and
        # chained steps, whose programs and buffers are OpenCL's alone
        self.cuda: CudaGraphs | None = None
        if kv_host is None and not any(os.environ.get(f"LLMRS_OPENCL_{x}", "") == "1" for x in ("PERSISTENT", "CHAIN")):
            self.cuda = open_cuda_graphs(self.ctx, self.device, self.build_notes)
        self._replays: dict[tuple[Any, ...], Replay] = {}
        self._cuda_pending = False   # the stream has work the host has not waited for
        self._cuda_live = self.cuda is not None   # False once a launch list could not run there
        # where every buffer comes from: CUDA's shared memory, or OpenCL's own (None)
        self._alloc_shared = alloc = self.cuda.alloc if self.cuda is not None else None
        self.memory = DeviceMemory(self.ctx, self.graphs, self.layouts, region, tensors, self.max_alloc, kv_host,
                                   alloc)
        mem = self.memory
        self.weights, self.kv, self.arena = mem.weights, mem.kv, mem.arena
        self.tensors, self.quantized, self.kv_offsets = mem.tensors, mem.quantized, mem.kv_offsets
        self.locate = mem.locate      # bound once: a step calls it
        # greedy steps advance it
        self.step_buf = alloc(16) if alloc is not None else cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, 16)
        self._in_flight: list[np.ndarray] = []
        self._limits: dict[str, tuple[int, int, int | None]] = {}
        self._step_shape: StepShape | None = None   # the step graph's bounds, read on its first step
        self._paged_tiles: bool | None = None        # whether it has attention_paged_tiles (likewise)
        self._input_runs: dict[tuple[str, tuple[str, ...]], list[InputRun]] = {}
        self._sized: dict[tuple[str, int, bool, frozenset[str], int, int | None, int | None], list[Any]] = {}
        self._command_buffers: dict[tuple[Any, ...], CommandBuffer] = {}
        self._prepared: dict[tuple[Any, ...], list[Any]] = {}
        self.use_command_buffers = ("cl_khr_command_buffer" in self.device.extensions.split()
                                    and os.environ.get("LLMRS_OPENCL_NO_COMMAND_BUFFER", "") in ("", "0"))
        self.reset()

    def _bind(self, program: dict[str, Any]) -> None:
        self.build_options = device_options(self.device)
        try:
            self.direct: DirectLaunches | None = DirectLaunches(self.queue)
        except OpenCLError as err:   # no loader reachable by ctypes: pyopencl enqueues, with events
            self.direct = None
            self.build_notes.append(f"{err}; launching through pyopencl")
        self.kernel_table = program["graphs"]
        self.program = program
        self.scoring = False    # runtime/kv turns eviction scores on for the steps that want them
        b = bind_program(self.ctx, self.queue, self.device, program, self.graphs, self.locate, self.step_buf,
                         self.arena.chunks[0][2], self.build_options, self.build_notes, self._alloc_shared)
        self.launches: dict[str, list[Bound]] = b.launches
        self.greedy, self.advance = b.greedy, b.advance
        self._bound_of = {x.kernel.int_ptr: x for x in [*(x for t in b.launches.values() for x in t),
                                                        *b.greedy.values(), *([b.advance] if b.advance else [])]}
        self._persistent: dict[tuple[Any, ...], PersistentStep | None] = {}
        self._persistent_program: PersistentProgram | None = None
        # LLMRS_OPENCL_PERSISTENT=1: a decode step as one persistent kernel wherever it builds
        # (opencl_persistent.py). Off by default: on the H200 it ran 0.75-0.82x the launches on
        # the default f16 plans (BENCHMARKS.md round 20)
        self.persistent = os.environ.get("LLMRS_OPENCL_PERSISTENT", "") == "1"
        # LLMRS_OPENCL_CHAIN=1: a layer's matvecs as one launch (opencl_chain.py). Off by default:
        # on the H100 the f16 1B ran 0.57x the launches, and q4_0 plans' 512-thread chains cannot
        # launch there (BENCHMARKS.md round 22)
        self.chained = os.environ.get("LLMRS_OPENCL_CHAIN", "") == "1"
        self._chains: dict[tuple[Any, ...], ChainedStep | None] = {}
        self._chain_program: ChainProgram | None = None
        self._chain_abort: Any = None
        self.scratch_buf, self.result_buf, self.staging_buf, self.steps_buf = b.scratch, b.result, b.staging, b.steps

    # -- the KV cache shared with another back end (runtime/backends/hybrid.py) ---------------
    @property
    def shares_kv(self) -> bool:
        """Whether the KV buffers were made over the host memory given at load (kv_host)."""
        return self.memory.kv_on_host

    def map_kv(self) -> list[tuple[int, np.ndarray]]:
        """The KV region mapped for the host, once the queue is idle: (region offset, uint8 view)
        per buffer; the device must not run until unmap_kv."""
        self._cuda_idle()
        return self.kv.map(self.queue)

    def unmap_kv(self, maps: list[tuple[int, np.ndarray]]) -> None:
        self.kv.unmap(self.queue, maps)

    def copy_kv(self, host: np.ndarray, spans: list[tuple[int, int]], to_device: bool,
                zeros: list[tuple[int, int]] = ()) -> None:
        """(offset, nbytes) spans of the KV region copied from host[offset:offset + nbytes] to the
        device (to_device) or back, and `zeros` spans zeroed on the device; returns when done."""
        self._cuda_idle()
        self.kv.copy(self.queue, host, spans, to_device, zeros)

    def report_lines(self) -> list[str]:
        return []

    def close(self) -> None:
        """Releases the recorded command buffers (a pending one goes when it completes); buffers
        and programs go with the context when the back end is dropped."""
        for kept in self._command_buffers.values():
            kept.release()
        self._command_buffers.clear()

    # -- the launcher's order: CUDA's stream where launch lists replay as graphs --------------
    @property
    def cuda_graphs(self) -> bool:
        """Whether launch lists run as CUDA graphs (opencl_cuda.py) rather than on OpenCL's queue."""
        return self._cuda_live

    def _cuda_idle(self) -> None:
        """Wait for CUDA's stream: before OpenCL touches memory a replay may still be using."""
        if self._cuda_pending:
            self.cuda.sync()
            self._cuda_pending = False

    def _put(self, buf: Any, off: int, arr: np.ndarray) -> None:
        """A step's input bytes into buf at off, ordered before the step's launches; returns
        without waiting (the host array may change afterwards)."""
        arr = np.ascontiguousarray(arr)
        if self._cuda_live:
            self.cuda.write(buf, off, arr)
            self._cuda_pending = True
        elif arr.nbytes in (4, 8, 16) and off % arr.nbytes == 0:   # a fill copies its pattern when enqueued
            _cl().enqueue_fill_buffer(self.queue, buf, arr, off, arr.nbytes)
        else:
            self._in_flight.append(arr)   # released by the next blocking read
            _cl().enqueue_copy(self.queue, buf, arr, dst_offset=off, is_blocking=False)

    def _get(self, out: np.ndarray, buf: Any, off: int = 0) -> np.ndarray:
        """buf's bytes at off into out once the launches before have run."""
        if self._cuda_live:
            self.cuda.read(out, buf, off)
            self._cuda_pending = False
        else:
            _cl().enqueue_copy(self.queue, out, buf, src_offset=off, is_blocking=True)
        self._in_flight.clear()
        return out

    def _cuda_fallback(self, err: Exception) -> None:
        """A launch list has no CUDA form or its replay failed: every launch goes through
        OpenCL's queue from now on (the memory stays shared, so nothing is lost)."""
        try:
            self.cuda.sync()
        except CudaUnavailable:
            pass
        self._cuda_pending = self._cuda_live = False
        note = f"{self.device_name}: {err}; launching through OpenCL's queue from now on"
        warnings.warn(note)
        self.build_notes.append(note)

    # -- steps --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the KV cache (zero bytes, so stale slots never hold NaNs)."""
        cl = _cl()
        self._cuda_idle()
        for s, e, buf in self.kv.chunks:
            cl.enqueue_fill_buffer(self.queue, buf, np.uint8(0), 0, e - s)
        self.queue.finish()
        self.scoring = False    # the score control is zero now: off

    def kv_store(self):
        """The caches for eviction (runtime/kv): scores read back, rows moved by kv_compact.cl."""
        from ..kv.opencl import OpenCLKV
        self._cuda_idle()
        return OpenCLKV(self)

    def write_value(self, phase: str, name: str, arr: np.ndarray) -> None:
        """Copy host data into a value's storage (inputs of single-kernel checks, caches);
        quantized weights are given as GGML blocks, as the plan holds them."""
        cl = _cl()
        self._cuda_idle()
        buf, off = self.locate(phase, name)
        data = np.ascontiguousarray(arr)
        if name in self.quantized:
            data = to_split_blocks(data.view(np.uint8), self.quantized[name])
        cl.enqueue_copy(self.queue, buf, data, dst_offset=off, is_blocking=True)

    def read_value(self, phase: str, name: str, rows: int | None = None) -> np.ndarray:
        """A value's current contents in its storage dtype; `rows` limits the first axis."""
        cl = _cl()
        self._cuda_idle()
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

    def _step_launches(self, phase: str, n_tokens: int, idle: frozenset[str] = frozenset(),
                       lead: int | None = None, scoring: bool | None = None,
                       logits: int | None = None, longest: int | None = None
                       ) -> list[tuple[Any, tuple[int, int], tuple[int, int]]]:
        """(kernel, global size, local size) of every launch of a step, computed once per size;
        kernels named in `idle` (with nothing to do this step) left out, and a step graph's
        row-split launches with no row on their side of `lead` (default: every row leads), the
        scores launches unless `scoring` (default: the back end's flag); a step graph's head
        takes `logits` rows (default: as many as the step's), and its paged attention the splits
        of its `longest` row (in KV entries; default: the whole cache's)."""
        lead = n_tokens if lead is None else lead
        scoring = self.scoring if scoring is None else scoring
        key = (phase, n_tokens, scoring, idle, lead, logits, longest)
        if key not in self._sized:
            self._sized[key] = [(b.kernel, b.global_size(n_tokens, lead, logits, longest), (b.local, 1))
                                for b in self.launches[phase]
                                if (scoring or not b.scores) and b.kernel.function_name not in idle
                                and b.rows_of(n_tokens, lead, logits) > 0]
        return self._sized[key]

    def enqueue(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int, kernels: bool = True,
                generated: int = 0) -> None:
        """Write the step's tokens and scalars and enqueue every kernel of the phase (none with
        kernels=False: profiles enqueue their own, on OpenCL's queue); returns without waiting
        on OpenCL's queue, and once done where launches replay as CUDA graphs (the arena's token
        slot may be reused within a step, so every step writes its tokens again). generated:
        the step's last rows that a step graph's row-split matmuls run as generated rows."""
        self._write_inputs(phase, tokens, n_past, start_pos, generated)
        if kernels:
            n_tokens = len(np.asarray(tokens).reshape(-1))
            lead = n_tokens - generated
            self._enqueue_launches((phase, n_tokens, "logits", self.scoring, lead),
                                   self._step_launches(phase, n_tokens, lead=lead))
        self._cuda_idle()

    def _write_inputs(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int, generated: int = 0) -> None:
        """A step's tokens and scalars, checked and written ahead of its launches."""
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
        self._put(self.step_buf, 0, np.array([n_tokens, n_past, start_pos, generated], np.int32))
        if g.inputs:
            buf, off = self.locate(phase, g.inputs[0])
            self._put(buf, off, tokens)

    def _enqueue_launches(self, key: tuple[Any, ...], launches: list[tuple[Any, tuple[int, int], tuple[int, int]]],
                          repeat: int = 1) -> None:
        """Enqueue a launch list `repeat` times over: replayed from a command buffer recorded on
        first use where the driver has cl_khr_command_buffer (LLMRS_OPENCL_NO_COMMAND_BUFFER=1:
        never), else kernel by kernel with no events (opencl_launch.DirectLaunches), else
        through pyopencl. On NVIDIA, first of all: as a CUDA graph (opencl_cuda.py), after
        OpenCL's queue has finished (its writes and kernels come first); the caller waits on
        CUDA's stream (_get, _cuda_idle)."""
        if self._cuda_live:
            rkey = key + (self.cuda.pdl,)
            try:
                replay = self._replays.get(rkey)
                if replay is None:
                    replay = self._replays[rkey] = self.cuda.prepare(launches, self._bound_of)
                self.queue.finish()
                self.cuda.run(rkey, replay, repeat)
                self._cuda_pending = True
                return
            except CudaUnavailable as err:
                self._cuda_fallback(err)
            except CudaLaunchFailed as err:
                self._cuda_fallback(err)
                raise OpenCLError(f"{self.device_name}: {err}; the step ran in part, so the KV cache may hold "
                                  "a broken entry (reset it)") from None
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
            self.direct.enqueue(prepared, repeat)
            return
        cl = _cl()
        queue, launch = self.queue, cl.enqueue_nd_range_kernel
        for _ in range(repeat):
            for kern, gsize, lsize in launches:
                launch(queue, kern, gsize, lsize)

    def _decode_union(self) -> list[tuple[Any, tuple[int, int], tuple[int, int]]]:
        """Every launch of decode's three launch lists (the step's, with its argmax, with the
        step-advancing argmax): what one persistent or chain program is built for."""
        extra = ([self.greedy["decode"]] if "decode" in self.greedy else []) + ([self.advance] if self.advance else [])
        return list(self._step_launches("decode", 1)) + [(b.kernel, b.global_size(1), (b.local, 1)) for b in extra]

    def _persistent_step(self, key: tuple[Any, ...], launches: list[tuple[Any, tuple[int, int], tuple[int, int]]]
                         ) -> PersistentStep | None:
        """The launch list as one persistent kernel (opencl_persistent.py), built on first use;
        None where the back end launches kernel by kernel (off, or the list cannot run so: the
        reason goes to build_notes once)."""
        if not self.persistent:
            return None
        if key not in self._persistent:
            groups = int(os.environ.get("LLMRS_OPENCL_PERSISTENT_GROUPS", "0") or 0) or None
            try:
                if self._persistent_program is None:   # one program for decode's three launch lists
                    union = self._decode_union()
                    self._persistent_program = PersistentProgram(self.ctx, self.device, union, self._bound_of,
                                                                 self.program["sources"], self.build_options)
                self._persistent[key] = PersistentStep(self._persistent_program, self.queue, launches,
                                                       self._bound_of, groups)
            except PersistentError as err:
                self._persistent[key] = None
                self.build_notes.append(f"{err}; launching kernel by kernel")
        return self._persistent[key]

    def _chained_step(self, key: tuple[Any, ...], launches: list[tuple[Any, tuple[int, int], tuple[int, int]]]
                      ) -> ChainedStep | None:
        """The launch list with its runs of matvecs chained (opencl_chain.py), built on first
        use; None where the back end does not chain (off, or the list cannot be: the reason goes
        to build_notes once)."""
        if not self.chained:
            return None
        if key not in self._chains:
            cl = _cl()
            try:
                if self._chain_program is None:   # one program for decode's three launch lists
                    union = self._decode_union()
                    sizes = [lsize[0] for k, _, lsize in union if k.function_name == "matvec"]
                    if not sizes:
                        raise ChainError("chained decode: the decode step has no matvec")
                    group = max(set(sizes), key=sizes.count)
                    self._chain_program = ChainProgram(self.ctx, self.device, union, self._bound_of,
                                                       self.program["sources"], self.build_options, group)
                    self._chain_abort = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                                  hostbuf=np.zeros(1, np.int32))
                self._chains[key] = ChainedStep(self._chain_program, self.queue, launches, self._bound_of,
                                                self._chain_abort)
            except PersistentError as err:   # ChainError too
                self._chains[key] = None
                self.build_notes.append(f"{err}; launching kernel by kernel")
        return self._chains[key]

    def _enqueue_decode(self, key: tuple[Any, ...], launches: list[tuple[Any, tuple[int, int], tuple[int, int]]],
                        repeat: int = 1) -> PersistentStep | ChainedStep | None:
        """A one-token decode step's launches `repeat` times over: as one persistent kernel each
        where the back end runs them, else with its matvec runs chained where it chains (either
        returned: its abort word is read with the step's result, so the caller checks
        aborted() after its blocking read), else kernel by kernel."""
        pk = self._persistent_step(key, launches)
        if pk is not None:
            self._enqueue_launches(key + ("persistent",), [pk.launch], repeat)
            pk.read_status()
            return pk
        ch = self._chained_step(key, launches)
        if ch is not None:
            self._enqueue_launches(key + ("chained",), ch.launches, repeat)
            ch.read_status()
            return ch
        self._enqueue_launches(key, launches, repeat)
        return None

    def _persistent_aborted(self, pk: PersistentStep | ChainedStep) -> None:
        """A persistent step gave up waiting at a grid barrier (its groups were not all resident),
        or a chain at one of its waits: the caller reruns the step launch by launch, as every
        later step runs."""
        pk.reset_sync()
        self.queue.finish()
        if isinstance(pk, ChainedStep):
            self.chained = False
            note = (f"{self.device_name}: a chained decode step timed out waiting on a launch of its chain; "
                    "launching kernel by kernel from now on")
        else:
            self.persistent = False
            note = (f"{self.device_name}: a persistent decode step timed out at a grid barrier (its groups were not "
                    "all resident); launching kernel by kernel from now on")
        warnings.warn(note)
        self.build_notes.append(note)

    def run_step(self, rows: StepRows) -> np.ndarray:
        """One step of the plan's "step" graph (compiler/ir.py "Step graphs"): its rows checked
        (opencl_step.py), written into the arena as the graph's inputs, the kernels enqueued;
        float32 [r, vocab], the logits of rows.logit_rows in their order."""
        return self.collect_step(self.submit_step(rows, argmax=False))

    def run_step_argmax(self, rows: StepRows) -> np.ndarray:
        """The step with the plan's argmax kernel after the head: int32 [r], 4 bytes a row read
        back instead of the logits (plans without the kernel: the logits' argmax)."""
        return self.collect_step(self.submit_step(rows, argmax=True))

    def submit_step(self, rows: StepRows, argmax: bool) -> tuple[int, str]:
        """The step's inputs written and its launches enqueued; returns at once (what
        collect_step takes), while the device runs it."""
        return self.launch_step(self.prepare_step(rows, argmax))

    def prepare_step(self, rows: StepRows, argmax: bool) -> PreparedStep:
        """Everything of a step the host does before its launch: rows checked, laid out in the
        arena's order and packed into the bytes its input copies take, launch list chosen."""
        g = self.graphs.get("step")
        if g is None:
            raise OpenCLError("this plan has no step graph (many sequences a step); recompile it with one")
        if self._step_shape is None:
            self._step_shape = StepShape.of(g)
        inputs = check_step(rows, self._step_shape)
        n = len(inputs["tokens"])
        lead, order = split_rows(inputs, len(rows.logit_rows))
        copies, tokens_at = self._pack_inputs("step", inputs)
        idle = self._idle_paged_kernels(inputs["row_seq"][:n])
        # the scores kernel runs in a step with a scoring row (its rows say so, not the flag)
        scoring = bool(np.any(inputs["ctx_len"] - 1 >= inputs["score_from"]))
        picked = len(rows.logit_rows)
        # the longest row's entries, rounded up to whole 128-entry splits: few sizes, few launch lists
        longest = -(-int(inputs["ctx_len"][:n].max()) // 128) * 128
        launches = self._step_launches("step", n, idle, lead, scoring, picked, longest)
        # plans without the argmax kernel: the logits read back, their argmax taken here
        read = "argmax" if argmax and "step" in self.greedy else "logits"
        if read == "argmax":
            b = self.greedy["step"]
            launches = launches + [(b.kernel, b.global_size(picked), (b.local, 1))]
        # the argmax's size is the chosen rows', so a recorded launch list is kept per count
        key = ("step", n, ("argmax", picked) if read == "argmax" else "logits", picked, scoring, idle, lead, longest)
        return PreparedStep(key, launches, picked, read if read == "argmax" or not argmax else "logits argmax",
                            np.array([n, 0, 0, n - lead], np.int32), copies, tokens_at, order)

    def launch_step(self, prepared: PreparedStep, tokens: np.ndarray | None = None) -> tuple[int, str]:
        """A prepared step's inputs written and its launches enqueued (what collect_step takes);
        `tokens`: its rows' token ids now, in the step's row order, for the ones it was prepared
        with (a step planned before they were sampled)."""
        if tokens is not None:
            tokens = check_step_tokens(tokens, int(prepared.head[0]), self._step_shape.vocab)
            host, rel = prepared.tokens_at
            ordered = (tokens if prepared.order is None else tokens[prepared.order]).astype(np.int32)
            host[rel:rel + ordered.nbytes] = ordered.view(np.uint8)
        self._put(self.step_buf, 0, prepared.head)
        for buf, off, host in prepared.copies:
            self._put(buf, off, host)
        self._enqueue_launches(prepared.key, prepared.launches)
        return prepared.picked, prepared.read

    def collect_step(self, submitted: tuple[int, str]) -> np.ndarray:
        """The result of the step submit_step enqueued: int32 [r] tokens (argmax) or float32
        [r, vocab] logits, once the device has run it."""
        picked, read = submitted
        if read == "argmax":
            out = self._get(np.empty(picked, np.int32), self.result_buf)
        else:
            out = self.read_value("step", self.graphs["step"].outputs[0], rows=picked).astype(np.float32, copy=False)
            if read == "logits argmax":
                out = np.argmax(out, axis=-1).astype(np.int32)
        self._in_flight.clear()
        return out

    def _pack_inputs(self, phase: str, inputs: dict[str, np.ndarray]) -> tuple[list[tuple[Any, int, np.ndarray]],
                                                                                tuple[np.ndarray, int]]:
        """A step's input arrays as the copies into their arena values take them: inputs that lie
        end to end in one buffer go as one copy (a copy costs the host several microseconds on
        NVIDIA's driver, and the memory plan puts a step graph's row inputs side by side). The
        bytes of a value past its array (rows the step does not have) are zeros; no kernel reads
        them. Returns [(buffer, offset, bytes)] and where the tokens lie: (those bytes, offset)."""
        key = (phase, tuple(inputs))
        runs = self._input_runs.get(key)
        if runs is None:
            runs = self._input_runs[key] = input_runs(
                [(name, *self.locate(phase, name), self.graphs[phase].values[name].nbytes) for name in inputs], ALIGN)
        copies, tokens_at = [], None
        for buf, off, nbytes, members in runs:
            host = np.zeros(nbytes, np.uint8)
            for name, rel in members:
                arr = np.ascontiguousarray(inputs[name]).view(np.uint8).reshape(-1)
                host[rel:rel + arr.nbytes] = arr
                if name == "tokens":
                    tokens_at = (host, rel)
            copies.append((buf, off, host))
        return copies, tokens_at

    def _idle_paged_kernels(self, row_seq: np.ndarray) -> frozenset[str]:
        """The paged attention kernel with no row this step, left out of its launches (a row
        with a neighbour row of its sequence is the tiles kernel's where the plan has one, any
        other the rows kernel's: attention_paged.cl): decode steps skip the tiles kernel, a
        prompt alone the rows kernel. Either would only have returned at once."""
        if self._paged_tiles is None:
            self._paged_tiles = any(b.kernel.function_name == "attention_paged_tiles" for b in self.launches["step"])
        if not self._paged_tiles:
            return frozenset()
        same = row_seq[1:] == row_seq[:-1]
        in_run = np.zeros(len(row_seq), bool)
        in_run[1:] |= same
        in_run[:-1] |= same
        return frozenset(({"attention_paged_tiles"} if not in_run.any() else set())
                         | ({"attention_paged_rows"} if in_run.all() else set()))

    def run_greedy_steps(self, token: int, n_past: int, start_pos: int, n: int) -> np.ndarray:
        """n greedy decode steps enqueued back to back, one read at the end: step i feeds the
        token step i - 1 chose (the first feeds `token`) at n_past + i, start_pos + i; the
        device's argmax writes each next token and the step's scalars itself. int32 [n], the
        chosen tokens, as n calls of run_argmax("decode", ...) would give them (a caller
        stopping at an end-of-sequence token drops what follows it; the cache holds those
        steps' keys past the stop, which the next step's n_past overwrites)."""
        if self.advance is None:
            raise OpenCLError("this plan's decode graph has no one-token device argmax; use run_argmax")
        if not 1 <= n <= GREEDY_MAX_STEPS:
            raise ValueError(f"run_greedy_steps: n = {n}; take 1..{GREEDY_MAX_STEPS} steps per call")
        _, slots, _ = self._step_limits("decode")
        if n_past + n > slots:
            raise IRError(f"KV cache of graph decode holds {slots} tokens; {n_past} + {n} steps do not fit")
        self._write_inputs("decode", np.array([token], np.int32), n_past, start_pos)
        a = self.advance
        step = self._step_launches("decode", 1) + [(a.kernel, a.global_size(1), (a.local, 1))]
        pk = self._enqueue_decode(("greedy", self.scoring), step, repeat=n)
        out = self._get(np.empty(n, np.int32), self.steps_buf)
        if pk is not None and pk.aborted():
            self._persistent_aborted(pk)
            return self.run_greedy_steps(token, n_past, start_pos, n)
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
        tokens = np.asarray(tokens).reshape(-1)
        if phase == "prefill" and len(tokens) <= self._short_T:    # tiled for few rows (compiler/pipeline.py)
            phase = PREFILL_SHORT
        g = self.graphs[phase]
        if want not in ("logits", "argmax"):
            raise ValueError(f"run(want={want!r}): choose 'logits' or 'argmax'")
        if want == "argmax" and phase not in self.greedy:
            raise OpenCLError(f"graph {phase} has no device argmax in this plan; recompile it or use want='logits'")
        self._write_inputs(phase, tokens, n_past, n_past if start_pos is None else start_pos)
        launches = self._step_launches(phase, len(tokens))
        if want == "argmax":
            b = self.greedy[phase]
            launches = launches + [(b.kernel, b.global_size(len(tokens)), (b.local, 1))]
        key = (phase, len(tokens), want, self.scoring)
        pk = None
        if phase == "decode" and len(tokens) == 1:
            pk = self._enqueue_decode(key, launches)
        else:
            self._enqueue_launches(key, launches)
        if want == "argmax":
            out = self._get(np.empty(min(len(tokens), b.rows), np.int32), self.result_buf)
        else:
            out = self.read_value(phase, g.outputs[0], rows=len(tokens)).astype(np.float32, copy=False)
        self._in_flight.clear()
        if pk is not None and pk.aborted():
            self._persistent_aborted(pk)
            return self.run(phase, tokens, n_past, start_pos, want)
        return out


__all__ = ["ALIGN", "GREEDY_MAX_STEPS", "INSTALL_OPENCL", "OpenCLBackend", "OpenCLError", "Region", "build_program",
           "cache_dir", "device_options", "from_split_blocks", "list_devices", "naive_layout", "patch_wgmma_ptx",
           "pick_device", "split_region", "to_split_blocks"]
