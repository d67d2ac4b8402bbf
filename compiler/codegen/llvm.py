"""CPU code for a plan: one LLVM function per phase runs the whole step.

    void llmrs_<phase>(ptr arena,          // activations, graph.meta["layout"]["arena"] offsets
                       ptr weight_table,   // ptr[len(weight_names(graphs))]: each weight's address
                       ptr kv,             // KV caches, layout["kv"] offsets
                       ptr scratch,        // u8[nth, llmrs_scratch_bytes()]: per-thread scratch
                       ptr barrier,        // u32[64], zeroed once; shared by the thread team
                       i64 n_tokens, i64 n_past, i64 start_pos, i64 tid, i64 nth)

A step graph (compiler/ir.py "Step graphs") has no n_past or start_pos: its function takes the
number of logit rows r in n_past's place, and the gather of those rows and every kernel after it
(final norm, head) run on r rows instead of n_tokens.

Each of nth threads calls it with its id; every kernel does its share of rows, and the threads
meet at a spinning barrier between kernels, so a step is one foreign call per thread. A matmul's
last eighth of rows is handed out a few at a time from a counter shared by the team (the
barrier's last arrival zeroes it, and a barrier ends the step), so a thread that falls behind is
covered by the others. Kernels are shared between ops (and phases) with the same shapes, dtypes
and attributes.
"""
from __future__ import annotations

import json
from typing import Mapping, Sequence

import llvmlite.ir as ir

from ..ir import Graph, Op
from .llvm_builder import I32, I64, PTR, SCRATCH_BASE_OFFSET, VOID, WORK_OFFSET
from .llvm_kernels import CodegenError, emit_op, op_scratch_bytes
from .llvm_target import Target, emit

PHASES = ("prefill", "decode", "step")
ALIGN = 64


def _graphs(graphs: Mapping[str, Graph] | Sequence[Graph]) -> list[Graph]:
    return list(graphs.values()) if isinstance(graphs, Mapping) else list(graphs)


def weight_names(graphs: Mapping[str, Graph] | Sequence[Graph]) -> list[str]:
    """Order of the weight table: every param/const an op of any phase reads, sorted by name."""
    names = set()
    for g in _graphs(graphs):
        for op in g.ops:
            names.update(i for i in op.inputs if g.values[i].kind in ("param", "const"))
    return sorted(names)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def scratch_bytes(graphs: Mapping[str, Graph] | Sequence[Graph]) -> int:
    return _align(max([op_scratch_bytes(g, op) for g in _graphs(graphs) for op in g.ops] + [ALIGN]))


def _kernel_key(g: Graph, op: Op) -> str:
    def val(n: str) -> tuple:
        v = g.values[n]
        alias_dtype = g.values[v.alias].dtype if v.alias else None
        return (v.shape, v.dtype, alias_dtype, v.kind in ("param", "const"))
    return json.dumps([op.kind, g.T, [val(i) for i in op.inputs], [val(o) for o in op.outputs],
                       sorted((k, repr(a)) for k, a in op.attrs.items())])


def logit_row_ops(g: Graph) -> set[int]:
    """Indices of the ops that work on a step graph's gathered logit rows: the gather and every
    op reading what it (or such an op) made. Empty in other graphs (a step graph's one op alone,
    as llmrs-check runs it, takes n_tokens, which its kernel caps at its rows)."""
    if "logit_rows" not in g.inputs:
        return set()
    gathered: set[str] = set()
    found = set()
    for i, op in enumerate(g.ops):
        if op.kind == "gather" or gathered.intersection(op.inputs):
            found.add(i)
            gathered.update(op.outputs)
    return found


SPINS = 2000             # pause-spins before a waiting thread sleeps on the futex
FUTEX_SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129
BARRIER_BYTES = 256


def _barrier(module: ir.Module, target: Target) -> ir.Function:
    """Centralised barrier: count arrivals; the last one resets the count and bumps the generation.
    Waiters spin a little (kernels are a few microseconds apart), then sleep on a futex, so a peer
    that the OS has descheduled gets the core back instead of racing a spinning thread.

    barrier u32[64]: count at byte 0, generation at byte 64, sleepers at byte 96, and the kernels'
    work counter (i64) at byte WORK_OFFSET, zeroed here while no thread is in a kernel."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64]), "llmrs_barrier")
    fn.linkage = "internal"
    bar, nth = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    at = lambda off: b.gep(bar, [ir.Constant(I64, off)], source_etype=ir.IntType(8))  # noqa: E731
    count, gen_ptr, sleepers = bar, at(64), at(96)
    futex_nr = FUTEX_SYSCALL.get(target.arch)
    syscall = ir.Function(module, ir.FunctionType(I64, [I64], var_arg=True), "syscall") if futex_nr else None
    gen = b.load_atomic(gen_ptr, "acquire", 4, typ=I32)
    old = b.atomic_rmw("add", count, ir.Constant(I32, 1), "acq_rel")
    last = b.icmp_unsigned("==", b.zext(old, I64), b.sub(nth, ir.Constant(I64, 1)))
    entry = b.block
    spin = fn.append_basic_block("spin")
    pause = fn.append_basic_block("pause")
    sleep = fn.append_basic_block("sleep")
    done = fn.append_basic_block("done")
    release = fn.append_basic_block("release")
    b.cbranch(last, release, spin)

    b.position_at_end(release)
    b.atomic_rmw("xchg", count, ir.Constant(I32, 0), "monotonic")
    b.atomic_rmw("xchg", at(WORK_OFFSET), ir.Constant(I64, 0), "monotonic")
    b.atomic_rmw("add", gen_ptr, ir.Constant(I32, 1), "seq_cst")
    if syscall is not None:
        n_sleep = b.load_atomic(sleepers, "seq_cst", 4, typ=I32)
        with b.if_then(b.icmp_unsigned("!=", n_sleep, ir.Constant(I32, 0))):
            b.call(syscall, [ir.Constant(I64, futex_nr), gen_ptr, ir.Constant(I32, FUTEX_WAKE_PRIVATE),
                             ir.Constant(I32, 0x7FFFFFFF)])
    b.branch(done)

    b.position_at_end(spin)
    i = b.phi(I32)
    i.add_incoming(ir.Constant(I32, 0), entry)
    now = b.load_atomic(gen_ptr, "acquire", 4, typ=I32)
    moved = b.icmp_unsigned("!=", now, gen)
    b.cbranch(moved, done, pause)

    b.position_at_end(pause)
    if target.is_x86:
        b.call(ir.Function(module, ir.FunctionType(VOID, []), "llvm.x86.sse2.pause"), [])
    elif target.is_aarch64:
        b.call(ir.Function(module, ir.FunctionType(VOID, [I32]), "llvm.aarch64.hint"), [ir.Constant(I32, 1)])
    nxt = b.add(i, ir.Constant(I32, 1))
    i.add_incoming(nxt, pause)
    if syscall is None:
        b.branch(spin)
    else:
        b.cbranch(b.icmp_unsigned("<", i, ir.Constant(I32, SPINS)), spin, sleep)
        b.position_at_end(sleep)
        # announce the sleep before the last look at gen (seq_cst, as release's order is): a bump
        # after that look finds sleepers > 0 and wakes us; one before it ends the wait at once
        b.atomic_rmw("add", sleepers, ir.Constant(I32, 1), "seq_cst")
        still = b.icmp_unsigned("==", b.load_atomic(gen_ptr, "seq_cst", 4, typ=I32), gen)
        with b.if_then(still):
            b.call(syscall, [ir.Constant(I64, futex_nr), gen_ptr, ir.Constant(I32, FUTEX_WAIT_PRIVATE),
                             gen, ir.Constant(PTR, None)])
        b.atomic_rmw("sub", sleepers, ir.Constant(I32, 1), "seq_cst")
        i.add_incoming(ir.Constant(I32, 0), b.block)
        b.branch(spin)

    b.position_at_end(done)
    b.ret_void()
    return fn


CLOCK_MONOTONIC = 1     # Linux's id: the clock Python's time.monotonic_ns and perf_counter_ns read


def _profile_clock(module: ir.Module) -> tuple[ir.GlobalVariable, ir.Function]:
    """For build_module(profile=True): a global i64 buffer pointer, set by the exported
    llmrs_profile_set(ptr), and stamp(i64 slot): CLOCK_MONOTONIC in ns into buffer[slot]."""
    buf = ir.GlobalVariable(module, PTR, "llmrs_profile_buf")
    buf.initializer = ir.Constant(PTR, None)
    buf.linkage = "internal"
    setter = ir.Function(module, ir.FunctionType(VOID, [PTR]), "llmrs_profile_set")
    b = ir.IRBuilder(setter.append_basic_block("entry"))
    b.store(setter.args[0], buf)
    b.ret_void()
    clock = ir.Function(module, ir.FunctionType(I32, [I32, PTR]), "clock_gettime")
    stamp = ir.Function(module, ir.FunctionType(VOID, [I64]), "llmrs_profile_stamp")
    stamp.linkage = "internal"
    b = ir.IRBuilder(stamp.append_basic_block("entry"))
    ts = b.alloca(ir.ArrayType(I64, 2))   # struct timespec {tv_sec, tv_nsec} on 64-bit Linux
    b.call(clock, [ir.Constant(I32, CLOCK_MONOTONIC), ts])
    sec = b.load(b.gep(ts, [ir.Constant(I64, 0), ir.Constant(I64, 0)], source_etype=ts.allocated_type), typ=I64)
    nsec = b.load(b.gep(ts, [ir.Constant(I64, 0), ir.Constant(I64, 1)], source_etype=ts.allocated_type), typ=I64)
    base = b.load(buf, typ=PTR)
    slot = b.gep(base, [stamp.args[0]], source_etype=I64)
    b.store(b.add(b.mul(sec, ir.Constant(I64, 1_000_000_000)), nsec), slot)
    b.ret_void()
    return buf, stamp


def build_module(graphs: Mapping[str, Graph] | Sequence[Graph], target: Target, profile: bool = False) -> ir.Module:
    """profile=True: thread 0 also stamps the clock at a step's start and after every kernel's
    barrier into the buffer given to llmrs_profile_set (i64[len(ops) + 1]), for llmrs-run
    --profile; plans never hold this code, so a normal step pays nothing for it."""
    gs = _graphs(graphs)
    for g in gs:
        if "layout" not in g.meta:
            raise CodegenError(f"graph {g.name} has no memory layout; run plan_memory "
                               "(compiler/pipeline.py) before LLVM codegen")
    module = ir.Module("llmrs")
    module.triple = target.triple
    wnames = {n: i for i, n in enumerate(weight_names(gs))}
    stride = scratch_bytes(gs)
    barrier = _barrier(module, target)
    stamp = _profile_clock(module)[1] if profile else None
    kernels: dict[str, ir.Function] = {}
    for g in gs:
        lay = g.meta["layout"]
        fn = ir.Function(module, ir.FunctionType(VOID, [PTR] * 5 + [I64] * 5), f"llmrs_{g.name}")
        arena, wtab, kv, scratch, bar, n_tokens, n_past, start_pos, tid, nth = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        my_scratch = b.gep(scratch, [b.mul(tid, ir.Constant(I64, stride))], source_etype=ir.IntType(8))
        work = b.gep(bar, [ir.Constant(I64, WORK_OFFSET)], source_etype=ir.IntType(8))
        # every thread stores the same pointer before its first kernel reads it
        b.store(scratch, b.gep(bar, [ir.Constant(I64, SCRATCH_BASE_OFFSET)], source_etype=ir.IntType(8)))

        def stamp_at(slot: int) -> None:
            if stamp is not None:
                with b.if_then(b.icmp_unsigned("==", tid, ir.Constant(I64, 0))):
                    b.call(stamp, [ir.Constant(I64, slot)])

        if stamp is not None:
            # the team meets first, so the first kernel's slice does not hold the threads' start
            # (the step's slice around it shows that hand-off as time outside every kernel)
            b.call(barrier, [bar, nth])
        stamp_at(0)

        def ptr(name: str) -> ir.Value:
            v = g.values[name]
            if v.kind in ("param", "const"):
                slot = b.gep(wtab, [ir.Constant(I64, wnames[name] * 8)], source_etype=ir.IntType(8))
                return b.load(slot, typ=PTR)
            if v.kind == "state" or v.alias:
                off, base = lay["kv"][v.alias or name], kv
            else:
                off, base = lay["arena"][name], arena
            return b.gep(base, [ir.Constant(I64, off)], source_etype=ir.IntType(8))

        on_logit_rows = logit_row_ops(g)
        for i, op in enumerate(g.ops):
            key = _kernel_key(g, op)
            if key not in kernels:
                kernels[key] = emit_op(module, target, g, op, f"k{len(kernels)}.{op.kind}", internal=True,
                                       shared_work=True)
            args = [ptr(n) for n in op.inputs + op.outputs]
            rows = n_past if i in on_logit_rows else n_tokens
            b.call(kernels[key], args + [rows, n_past, start_pos, tid, nth, my_scratch, work])
            b.call(barrier, [bar, nth])   # after the last kernel too: it zeroes work for the next step
            stamp_at(i + 1)
        b.ret_void()
    # self-description the runtime reads through the JIT: per-thread scratch size
    sfn = ir.Function(module, ir.FunctionType(I64, []), "llmrs_scratch_bytes")
    ir.IRBuilder(sfn.append_basic_block("entry")).ret(ir.Constant(I64, stride))
    return module


def generate(graphs: Mapping[str, Graph] | Sequence[Graph], target: Target) -> tuple[str, bytes]:
    """(LLVM IR text, object code for target) holding llmrs_prefill / llmrs_decode."""
    ir_text = str(build_module(graphs, target))
    return ir_text, emit(ir_text, target)
