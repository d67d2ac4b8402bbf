"""CPU back end: runs a plan's LLVM step functions on a team of threads.

Memory, allocated once at load: the arena (activations, the plan's layout), the KV region, the
per-thread scratch, a barrier word, and a table of weight addresses into the mmapped plan. A step
is one ctypes call per thread (ctypes releases the GIL), so Python does no per-kernel work.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ...compiler.ir import Graph, storage_shape
from ..plan import STEP, STEP_INPUTS, Plan, StepShape, cpu_graphs
from .base import Backend, NonFiniteLogits, StepRows, check_step_rows
from .cpu_native import NativeCode, NativeCodeError, host_triple
from .options import MAX_THREADS

_STEP_ARGS = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
# prompt tokens a CPU prefill step feeds at most (Backend.prefill_rows): a step's activations then
# stay near the cache. Zen 5, 2 threads, prefill 512 against a 128-row graph's speed: SmolLM2's
# 512-row graph ran 0.96x fed 512 tokens a step, 0.99x fed 128; the 1B shape 1.00x either way
# (BENCHMARKS.md round 21)
PREFILL_ROWS = 128


class CpuBackendError(ValueError):
    """Bad input to a step or a plan this machine cannot run; one line, says what to do."""


def physical_cores() -> int:
    """Distinct (package, core) pairs in /proc/cpuinfo; os.cpu_count() where that is unavailable."""
    try:
        cores, phys = set(), "0"
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "physical id":
                    phys = val
                elif key == "core id":
                    cores.add((phys, val))
        return len(cores) or os.cpu_count() or 1
    except OSError:
        return os.cpu_count() or 1


def _weight_names(graphs: dict[str, Graph]) -> list[str]:
    # the order compiler/codegen/llvm.py's weight table uses
    names = set()
    for g in graphs.values():
        for op in g.ops:
            names.update(i for i in op.inputs if g.values[i].kind in ("param", "const"))
    return sorted(names)


def _aligned_zeros(nbytes: int, align: int = 64) -> np.ndarray:
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


HUGE_PAGE = 2 << 20


def _huge_zeros(nbytes: int) -> np.ndarray:
    """Zeroed anonymous memory on 2 MiB boundaries, asking the kernel for transparent huge pages
    (with THP in "madvise" mode it gives none unless asked): decode attention walks every layer's
    KV cache at a stride of n_kv_heads rows, a new 4 KiB page every few slots (Llama-3.2-1B, 2
    threads, 880 cached tokens, same process: 33.9 ms/token against 34.9 on 4 KiB pages).
    Small buffers, or a kernel that refuses, get ordinary pages."""
    if nbytes < HUGE_PAGE:
        return _aligned_zeros(nbytes)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)        # holds `region` alive
    start = (-raw.ctypes.data) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except (AttributeError, OSError, ValueError):
        pass
    return raw[start:start + nbytes]


def load_code(plan) -> NativeCode:
    """The plan's object code for this host, or its LLVM IR JIT-compiled (said on stderr)."""
    missing = plan.missing_code("cpu") if isinstance(plan, Plan) else None
    if missing:   # the compiler left this back end out: say why, not which section is absent
        raise CpuBackendError(f"{plan.path}: {missing}")
    triple = host_triple()
    obj = _section(plan, f"llvm.{triple}")
    if obj is not None:
        return NativeCode(obj=bytes(obj))
    ir_text = _section(plan, "llvm-ir")
    if ir_text is None:
        raise CpuBackendError(f"plan has no CPU code for {triple} and no LLVM IR; "
                              f"recompile it with --triple {triple}")
    text = bytes(ir_text).decode()
    arch = triple.split("-")[0]
    if f'target triple = "{arch}' not in text:
        raise CpuBackendError(f"plan's LLVM IR was generated for another architecture than {triple}; "
                              f"recompile it with --triple {triple}")
    print(f"llmrs: plan has no object code for {triple}; JIT-compiling its LLVM IR", file=sys.stderr)
    return NativeCode(ir_text=text)


def _section(plan, name: str):
    try:
        return plan.section(name)
    except (KeyError, ValueError, LookupError):
        return None


@dataclass(frozen=True)
class _StepIO:
    """What run() needs of a phase's graph, looked up once (a decode step is ~20 ms)."""
    T: int
    vocab: int
    seq: int | None              # KV cache slots; None without state
    tokens_offset: int           # arena byte offset of the i32[T] tokens input
    out_offset: int              # arena byte offset of the f32[rows, vocab] output
    out_rows: int
    out_cols: int
    rows_follow_tokens: bool     # output has one row per token of the step

    @staticmethod
    def of(g: Graph) -> "_StepIO":
        arena = g.meta["layout"]["arena"]
        out = g.values[g.outputs[0]]
        return _StepIO(g.T, next(g.values[op.inputs[0]].shape[0] for op in g.ops if op.kind == "embedding"),
                       g.kv_slots, arena[g.inputs[0]],
                       arena[out.name], out.shape[0], out.shape[1], out.shape[0] == g.T and g.T > 1)


def _start_team(threads: int) -> ThreadPoolExecutor | None:
    """The helper threads of a team of `threads`, all started now. The pool would start them
    on a step's first submit, where one that cannot start (too many threads for the system)
    leaves those already in the step waiting at its barrier for a thread that never comes."""
    if threads == 1:
        return None
    pool = ThreadPoolExecutor(max_workers=threads - 1)
    gate = threading.Barrier(threads)   # each task holds its thread, so every submit starts one
    try:
        for _ in range(threads - 1):
            pool.submit(gate.wait)
        gate.wait()
    except RuntimeError as e:           # "can't start new thread"
        gate.abort()                    # the started ones return (BrokenBarrierError) and exit
        pool.shutdown()
        raise CpuBackendError(f"--threads {threads}: the system would not start that many threads ({e}); "
                              f"use fewer (this machine has {os.cpu_count()} CPUs)") from None
    return pool


class CpuBackend(Backend):
    """run(phase, tokens, n_past, start_pos) -> float32 logits [rows, vocab]; reset() clears the KV cache."""
    name = "cpu"
    device_name = ""
    # run_argmax reads each row's argmax straight off the arena: no copy of the logits, no
    # sampler (SmolLM2, 8 streams: ~60 us a row of the batcher's host time)
    device_argmax = True
    prefill_rows = PREFILL_ROWS

    def __init__(self, plan, threads: int | None = None, code: NativeCode | None = None):
        threads = physical_cores() if threads is None else threads
        if not 1 <= threads <= MAX_THREADS:
            raise CpuBackendError(f"--threads {threads}: need 1 to {MAX_THREADS} "
                                  f"(this machine has {os.cpu_count()} CPUs)")
        self.plan = plan
        self.threads = threads
        self.graphs: dict[str, Graph] = cpu_graphs(plan.graphs())
        self.code = code or load_code(plan)
        self.layouts = {name: g.meta["layout"] for name, g in self.graphs.items()}
        self.arena = _huge_zeros(max(l["arena_bytes"] for l in self.layouts.values()))
        self.kv = _huge_zeros(max(max(l["kv_bytes"] for l in self.layouts.values()), 64))
        scratch_fn = ctypes.CFUNCTYPE(ctypes.c_int64)(self.code.address("llmrs_scratch_bytes"))
        self.scratch = _huge_zeros(scratch_fn() * threads)
        self.barrier = _aligned_zeros(256)   # compiler/codegen/llvm.py: BARRIER_BYTES
        self._weights = [plan.weight(n) for n in _weight_names(self.graphs)]  # keeps the maps alive
        self.weight_table = np.array([w.ctypes.data for w in self._weights] or [0], dtype=np.uint64)
        self._steps = {name: ctypes.CFUNCTYPE(None, *_STEP_ARGS)(self.code.address(f"llmrs_{name}"))
                       for name in self.graphs}
        self._pool = _start_team(threads)
        self._closed = False
        self._bases = [a.ctypes.data for a in (self.arena, self.weight_table, self.kv, self.scratch,
                                               self.barrier)]
        self._io: dict[str, _StepIO] = {}   # filled on a phase's first run: not every graph has logits
        step = self.graphs.get(STEP)
        self._step_shape = StepShape.of(step) if step is not None else None
        if step is not None:    # where run_step writes each input and reads the logits, in elements
            arena = self.layouts[STEP]["arena"]
            self._arena_i32, self._arena_f32 = self.arena.view(np.int32), self.arena.view(np.float32)
            self._step_inputs = [(name, arena[name] // 4) for name in STEP_INPUTS]
            self._step_logits = (arena[step.outputs[0]] // 4, step.values[step.outputs[0]].shape[1])

    def reset(self) -> None:
        self.kv[:] = 0

    def run_argmax(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        return _argmax_rows(self._run(phase, tokens, n_past, start_pos))

    def run_step_argmax(self, rows: StepRows) -> np.ndarray:
        return _argmax_rows(self._run_step(rows))

    def report_lines(self) -> list[str]:
        return []

    def kv_region(self) -> np.ndarray:
        """The KV region: uint8 [kv bytes], each state at the plan's layout["kv"] offset. Another
        back end may make its KV buffers over it, or copy rows in and out between steps
        (runtime/backends/hybrid.py)."""
        return self.kv

    def kv_store(self):
        """The caches for eviction (runtime/kv): numpy views of the KV region, at the plan's
        layout["kv"] offsets, which the step functions read and write."""
        from ..kv.store import HostKV
        g = self.graphs["decode"]
        offsets = self.layouts["decode"]["kv"]
        views = {}
        for name in g.state:
            shape, np_dtype = storage_shape(g.values[name].shape, g.values[name].dtype)
            off = offsets[name]
            views[name] = self.kv[off:off + g.values[name].nbytes].view(np_dtype).reshape(shape)
        return HostKV(g, views)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._closed = True

    def run_step(self, rows: StepRows) -> np.ndarray:
        return self._run_step(rows).copy()

    def _run_step(self, rows: StepRows) -> np.ndarray:
        """The step graph on rows: every input written at its arena offset (checked first), the
        logit row count passed where a step graph has no n_past (compiler/codegen/llvm.py). The
        logits as a view of the arena, which the next step writes over."""
        if self._closed:
            raise CpuBackendError("the CPU back end is closed; load the plan again")
        if self._step_shape is None:
            raise CpuBackendError(f"{getattr(self.plan, 'path', 'the plan')}: no step graph (compiled with "
                                  "max_num_seqs 0, or by an older llmrs); recompile it to run many sequences")
        rows = check_step_rows(rows, self._step_shape)
        for name, at in self._step_inputs:
            data = getattr(rows, name).reshape(-1)
            self._arena_i32[at:at + len(data)] = data
        r = len(rows.logit_rows)
        self._team_call(self._steps[STEP], len(rows.tokens), r, 0)
        at, vocab = self._step_logits
        return self._arena_f32[at:at + r * vocab].reshape(r, vocab)

    def _team_call(self, step, n_tokens: int, n_past: int, start_pos: int) -> None:
        """One step function run by the whole team: thread 0 here, the others in the pool."""
        args = (*self._bases, n_tokens, n_past, start_pos)
        futures = [self._pool.submit(step, *args, t, self.threads) for t in range(1, self.threads)] \
            if self._pool else []
        step(*args, 0, self.threads)
        for f in futures:
            f.result()

    def run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        return self._run(phase, tokens, n_past, start_pos).copy()

    def _run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        """run's logits as a view of the arena, which the next step writes over."""
        if self._closed:    # the team is gone: thread 0 would wait at its first barrier forever
            raise CpuBackendError("the CPU back end is closed; load the plan again")
        if phase == STEP:   # its rows' positions, slots and tables come only through run_step's checks
            raise CpuBackendError("graph 'step' runs through run_step (each row needs its position, KV slot and "
                                  "block table)")
        io = self._io.get(phase)
        if io is None:
            g = self.graphs.get(phase)
            if g is None:
                raise CpuBackendError(f"plan has no {phase!r} graph (has {', '.join(self.graphs)})")
            io = self._io[phase] = _StepIO.of(g)
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = len(tokens)
        if not 1 <= n <= io.T:
            raise CpuBackendError(f"{phase} takes 1..{io.T} tokens per step, got {n}")
        if tokens.min() < 0 or tokens.max() >= io.vocab:
            raise CpuBackendError(f"token id out of range 0..{io.vocab - 1}")
        if io.seq is not None and n_past + n > io.seq:
            raise CpuBackendError(f"KV cache holds {io.seq} tokens; {n_past} + {n} do not fit")
        self.arena[io.tokens_offset:io.tokens_offset + 4 * n].view(np.int32)[:] = tokens
        self._team_call(self._steps[phase], n, n_past, start_pos)
        rows = n if io.rows_follow_tokens else io.out_rows
        off = io.out_offset
        return self.arena[off:off + rows * io.out_cols * 4].view(np.float32).reshape(rows, -1)


def _argmax_rows(logits: np.ndarray) -> np.ndarray:
    """Each row's argmax (the first of equal maxima), refusing a row with NaN or +inf, as the
    host's sampler would (runtime/engine.py check_finite): numpy's argmax lands on a row's first
    NaN, so the chosen value alone tells. A -inf beside finite values is a token never chosen."""
    chosen = np.argmax(logits, axis=-1)
    if not np.isfinite(logits[np.arange(len(chosen)), chosen]).all():
        raise NonFiniteLogits("a row's largest logit is NaN/inf")
    return chosen.astype(np.int32)


__all__ = ["MAX_THREADS", "CpuBackend", "CpuBackendError", "NativeCodeError", "physical_cores", "load_code"]
