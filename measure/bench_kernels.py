"""llmrs-bench --kernels: every distinct kernel of a plan timed alone (llama.cpp's
test-backend-ops perf mode, for one plan), with the bytes it moves and the arithmetic it does,
so each gets GB/s and GFLOP/s against the machine's ceilings.

Kernels are llmrs-check's (measure/kernels.py: deduplicated by kind, shapes, dtypes and attributes;
layer 0's stands for every layer's), on random non-zero inputs with the plan's own weights. A
prefill kernel runs a whole chunk (T tokens) at the start of a prompt; a decode kernel one token
after `context` cached tokens. Eviction scores are off, as in a step without a policy.

  cpu     the kernel is compiled alone (JIT) into two step functions that call it 1 and 4
          times, each call followed by the team's barrier as in a plan's step; its time is
          (t4 - t1) / 3, median of rounds, so the foreign call and thread handoff cancel out
  opencl  the plan's own launches for the op, bound alone (as llmrs-check binds them), timed
          by a profiling queue's events: device time, summed over the op's launches
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..compiler.interpret import Step
from ..compiler.ir import Graph, Op, storage_shape
from .kernels import Kernel, make_case, plan_kernels, with_layout
from .ceilings import sig

REPEATS_HI = 4   # kernel calls in the longer CPU step function (the shorter one makes 1)


@dataclass
class KernelTime:
    label: str           # kind(fusion) and input types (llmrs-check's label)
    phase: str
    op: str              # the first op with this kernel
    ops: int             # ops of the phase that share it
    backend: str
    tokens: int          # rows the timed call computes
    context: int         # cached tokens before them
    us: float            # median time of one call
    bytes: int           # bytes read and written by one call (cost model below)
    flops: int           # arithmetic of one call
    gbs: float
    gflops: float
    of_bandwidth: float | None    # gbs / the bandwidth ceiling
    of_gemm: float | None         # gflops / numpy's GEMM (CPU only)


def kernel_cost(g: Graph, op: Op, step: Step) -> tuple[int, int]:
    """(bytes moved, flops) of one call at `step`. Bytes: weights whole (an embedding reads
    its rows only), activations the step's rows, a KV cache the slots attention reads or a
    store writes; the scores state and i32 controls are left out. Flops: 2 N K per token for a
    matmul, 4 x heads x head_dim per (query, visible key) pair for attention, one per output
    element for the rest."""
    n, ctx = step.n_tokens, step.n_past
    moved = 0.0
    for name in op.inputs + op.outputs:
        v = g.values[name]
        if v.dtype == "i32" and v.kind == "state":
            continue
        if v.kind in ("param", "const"):
            moved += v.nbytes * (n / v.shape[0] if op.kind == "embedding" else 1)
        elif v.kind == "state" or v.alias:
            if len(v.shape) != 3:     # eviction scores: off in a timed step
                continue
            slots = ctx + n if op.kind == "attention" else n
            moved += v.nbytes * min(slots, v.shape[0]) / v.shape[0]
        else:
            moved += v.nbytes * (min(n, v.shape[0]) / v.shape[0] if v.shape and v.shape[0] == g.T else 1)
    if op.kind in ("matmul", "fused_matmul"):
        x, w = g.values[op.inputs[0]], g.values[op.inputs[1]]
        rows = min(n, x.shape[0]) if x.shape[0] == g.T else x.shape[0]   # a [1, K] x: the last row only
        flops = 2 * rows * w.shape[0] * w.shape[1]
    elif op.kind == "attention":
        q = g.values[op.inputs[0]]
        per_key = 4 * int(np.prod(q.shape[1:]))
        flops = per_key * sum(ctx + i + 1 for i in range(n))
    else:
        out = g.values[op.outputs[0]]
        flops = int(np.prod(out.shape[1:])) * (n if out.shape and out.shape[0] == g.T else 1)
    return int(moved), int(flops)


def timing_step(kernel: Kernel, context: int) -> Step:
    g = kernel.graph
    seq = g.kv_slots
    if kernel.phase == "decode" or g.T == 1:
        past = min(context, seq - 1) if seq else context   # (a kernel without a cache ignores it)
        return Step(1, past, past)
    n = min(g.T, seq) if seq else g.T
    return Step(n, 0, 0)


def _inputs(kernel: Kernel, rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = make_case(kernel, rng).arrays
    for name, arr in arrays.items():
        v = kernel.graph.values[name]
        if v.kind == "state" and v.dtype == "i32":
            arrays[name] = np.zeros_like(arr)     # the score control: off
    return arrays


def _repeated(g: Graph, name: str, times: int) -> Graph:
    out = g.copy()
    out.name = name
    out.ops = [g.ops[0]] * times
    return out


class _Plan:
    """What CpuBackend reads from a plan, for the timing graphs: weights from the real plan."""

    def __init__(self, graphs: dict[str, Graph], plan: Any):
        self._graphs, self._plan = graphs, plan

    def graphs(self) -> dict[str, Graph]:
        return self._graphs

    def weight(self, name: str) -> np.ndarray:
        return self._plan.weight(name)


def time_cpu(kernel: Kernel, plan: Any, step: Step, threads: int, rounds: int,
             rng: np.random.Generator) -> float:
    from ..compiler.codegen.llvm import build_module
    from ..compiler.codegen.llvm_target import host_target
    from ..runtime.backends.cpu import CpuBackend
    from ..runtime.backends.cpu_native import NativeCode

    g = with_layout(kernel)
    lo, hi = _repeated(g, "t_lo", 1), _repeated(g, "t_hi", REPEATS_HI)
    code = NativeCode(ir_text=str(build_module([lo, hi], host_target())))
    be = CpuBackend(_Plan({"t_lo": lo, "t_hi": hi}, plan), threads=threads, code=code)
    try:
        lay = g.meta["layout"]
        for name, arr in _inputs(kernel, rng).items():
            v = g.values[name]
            shape, np_dtype = storage_shape(v.shape, v.dtype)
            region, off = (be.kv, lay["kv"][v.alias or name]) if v.kind == "state" or v.alias \
                else (be.arena, lay["arena"][name])
            region[off:off + v.nbytes].view(np_dtype).reshape(shape)[...] = arr
        args = (*be._bases, step.n_tokens, step.n_past, step.start_pos)

        def call(fn: Callable) -> float:
            t0 = time.perf_counter()
            futures = [be._pool.submit(fn, *args, t, threads) for t in range(1, threads)] if be._pool else []
            fn(*args, 0, threads)
            for f in futures:
                f.result()
            return time.perf_counter() - t0

        f_lo, f_hi = be._steps["t_lo"], be._steps["t_hi"]
        call(f_hi)                                    # warm: pages, caches
        budget = max(rounds, min(50, int(0.3 / max(call(f_hi), 1e-6))))
        diffs = [call(f_hi) - call(f_lo) for _ in range(budget)]
        return max(statistics.median(diffs) / (REPEATS_HI - 1), 1e-9)
    finally:
        be.close()


def time_opencl(kernel: Kernel, plan: Any, step: Step, device: Any, rounds: int,
                rng: np.random.Generator, program: dict) -> float:
    import pyopencl as cl

    from ..runtime.backends.opencl import OpenCLBackend

    g = with_layout(kernel)
    names = {o.name for o in kernel.all_ops}   # a deferred QKV pair's two ops (kernels.deferred_pair)
    launches = [e for e in program["graphs"].get(kernel.phase, []) if e["op"] in names]
    be = OpenCLBackend.from_graphs({g.name: g}, {**program, "graphs": {g.name: launches}}, device=device)
    for name, arr in _inputs(kernel, rng).items():
        be.write_value(g.name, name, arr)
    be.enqueue(g.name, np.zeros(step.n_tokens, np.int32), step.n_past, step.start_pos, kernels=False)
    be.queue.finish()
    queue = cl.CommandQueue(be.ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    sized = be._step_launches(g.name, step.n_tokens)

    def once() -> float:
        events = [cl.enqueue_nd_range_kernel(queue, k, gs, ls) for k, gs, ls in sized]
        queue.finish()
        return sum(ev.profile.end - ev.profile.start for ev in events) / 1e9

    once()
    first = once()
    budget = max(rounds, min(50, int(0.3 / max(first, 1e-6))))
    return statistics.median([once() for _ in range(budget)])


def time_kernels(plan: Any, backend: str, ceilings: dict[str, float], context: int, threads: int = 1,
                 device: Any = None, rounds: int = 3, say: Callable[[str], None] = lambda s: None) -> list[KernelTime]:
    """Every distinct kernel of the plan on `backend`, with GB/s and GFLOP/s against `ceilings`
    (read_gbs or device_copy_gbps, gemm_gflops)."""
    import json

    from ..runtime.plan import OPENCL_ONLY

    kernels = plan_kernels(plan.graphs())
    program = json.loads(bytes(plan.section("opencl")).decode()) if backend == "opencl" else None
    if program is not None:     # the graphs its code holds (a step graph's kernels may be CPU-only)
        kernels = [k for k in kernels if k.phase in program["graphs"]]
    else:                       # and the CPU's
        kernels = [k for k in kernels if k.phase not in OPENCL_ONLY]
    bw = ceilings.get("device_copy_gbps" if backend == "opencl" else "read_gbs")
    gemm = ceilings.get("gemm_gflops") if backend == "cpu" else None
    out = []
    for i, k in enumerate(kernels):
        say(f"llmrs-bench: kernel {i + 1}/{len(kernels)}: {k.phase} {k.label}")
        step = timing_step(k, context)
        rng = np.random.default_rng([7, i])
        if backend == "cpu":
            s = time_cpu(k, plan, step, threads, rounds, rng)
        else:
            s = time_opencl(k, plan, step, device, rounds, rng, program)
        costs = [kernel_cost(k.graph, o, step) for o in k.all_ops]
        nbytes, flops = sum(c[0] for c in costs), sum(c[1] for c in costs)
        gbs, gfl = nbytes / s / 1e9, flops / s / 1e9
        out.append(KernelTime(k.label, k.phase, k.op.name, k.ops, backend, step.n_tokens, step.n_past,
                              sig(s * 1e6), nbytes, flops, sig(gbs), sig(gfl),
                              sig(gbs / bw) if bw else None, sig(gfl / gemm) if gemm else None))
    return out


def format_kernels(rows: list[KernelTime]) -> str:
    head = ("phase", "kernel", "ops", "tokens@ctx", "us", "MB", "GB/s", "of BW", "GFLOP/s", "of GEMM")
    body = [(r.phase, r.label, str(r.ops), f"{r.tokens}@{r.context}", f"{r.us:.2f}" if r.us < 10 else f"{r.us:.1f}", f"{r.bytes / 1e6:.2f}",
             f"{r.gbs:.1f}", "-" if r.of_bandwidth is None else f"{r.of_bandwidth:.2f}", f"{r.gflops:.1f}",
             "-" if r.of_gemm is None else f"{r.of_gemm:.2f}") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths)))
                     for row in [head, *body])
