"""The machine's ceilings, measured where the speeds are measured (the machine may be shared and
noisy, so a figure is only compared with ceilings of the same run).

    read_bandwidth   GB/s of every thread streaming its share of a buffer through a generated,
                     vectorised read kernel (4 independent accumulators, widest integer vectors)
    gemm_gflops      numpy's f32 matmul, n x n x n
    device_copy_gbps an OpenCL device's buffer-to-buffer copy, (read + written bytes) / time
    launch_us        one empty OpenCL launch as the runtime launches (no events), back to back

llmrs-bench runs the host probes (probe_host) in a child process, so the probe's buffer stays out
of the benchmark's peak memory.
"""
from __future__ import annotations

import ctypes
import json
import subprocess
import threading
import time
from typing import Any, Callable

import numpy as np

from ..runtime.backends.cpu import physical_cores


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits: a ratio of a tiny model is as exact as a large one's."""
    return float(f"{x:.{digits}g}")


def _read_kernel() -> tuple[Any, Callable[[int, int], int]]:
    """i64 read_sum(ptr p, i64 nbytes): sums nbytes (a multiple of 4 vectors) as wide vectors,
    4 independent accumulators so the loads are not serialised."""
    import llvmlite.ir as ir

    from ..compiler.codegen.llvm_target import host_target
    from ..runtime.backends.cpu_native import NativeCode

    target = host_target()
    lanes = 8 if target.has("avx512f") else 4            # i64 lanes of a 512/256-bit vector
    i64, vty, unroll = ir.IntType(64), ir.VectorType(ir.IntType(64), lanes), 4
    module = ir.Module("read_probe")
    module.triple = target.triple
    fn = ir.Function(module, ir.FunctionType(i64, [ir.PointerType(), i64]), "read_sum")
    p, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    entry, loop, done = b.block, fn.append_basic_block("loop"), fn.append_basic_block("done")
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), entry)
    accs = [b.phi(vty) for _ in range(unroll)]        # phis first: LLVM wants them at the top
    news = []
    for u, acc in enumerate(accs):
        acc.add_incoming(ir.Constant(vty, None), entry)
        off = b.add(i, ir.Constant(i64, u * lanes * 8))
        news.append(b.add(acc, b.load(b.gep(p, [off], source_etype=ir.IntType(8)), typ=vty, align=64)))
    nxt = b.add(i, ir.Constant(i64, unroll * lanes * 8))
    i.add_incoming(nxt, loop)
    for acc, new in zip(accs, news):
        acc.add_incoming(new, loop)
    b.cbranch(b.icmp_unsigned("<", nxt, n), loop, done)
    b.position_at_end(done)
    total = news[0]
    for new in news[1:]:
        total = b.add(total, new)
    b.ret(b.extract_element(total, ir.Constant(ir.IntType(32), 0)))
    code = NativeCode(str(module))
    return code, ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)(code.address("read_sum"))


def read_bandwidth(base: int, nbytes: int, threads: int, passes: int = 5) -> float:
    """GB/s of `threads` threads each streaming its slice of [base, base + nbytes); best pass."""
    _code, read_sum = _read_kernel()
    share = nbytes // threads // 4096 * 4096
    if share == 0:
        raise ValueError(f"read probe: {nbytes} bytes is less than a page per thread")
    best = 0.0
    for _ in range(passes):
        team = [threading.Thread(target=read_sum, args=(base + k * share, share)) for k in range(threads)]
        t0 = time.perf_counter()
        for t in team:
            t.start()
        for t in team:
            t.join()
        best = max(best, share * threads / (time.perf_counter() - t0) / 1e9)
    return best


def gemm_gflops(n: int = 2048, passes: int = 5) -> float:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def host_ceilings(threads: int, read_bytes: int, gemm_n: int, weights: np.ndarray | None = None) -> dict[str, float]:
    """{read_gbs, weights_read_gbs (the probe over the plan's mmapped weights, when given), gemm_gflops}."""
    buf = np.ones(read_bytes // 8, np.int64)                   # touched: every page is resident
    out = {"read_gbs": read_bandwidth(buf.ctypes.data, buf.nbytes, threads)}
    del buf
    if weights is not None and len(weights) >= 16 << 20:   # smaller: page faults, not bandwidth
        out["weights_read_gbs"] = read_bandwidth(weights.ctypes.data, len(weights), threads)
    out["gemm_gflops"] = gemm_gflops(gemm_n)
    return out


def probe_host(threads: int, read_bytes: int, gemm_n: int, plan: str | None = None) -> dict[str, float]:
    """host_ceilings, reading the plan's mmapped weights too when a plan is given."""
    weights = None
    if plan:
        from ..runtime.plan import Plan
        weights = Plan.open(plan, verify="never").weights_region()
    return host_ceilings(threads, read_bytes, gemm_n, weights)


def measure_host(threads: int, read_bytes: int, gemm_n: int, plan: str | None = None) -> dict[str, float]:
    """probe_host in a fresh Python: its probe buffer never counts in this process's peak memory."""
    from llmrs.child import python_argv

    code = ("import json; from llmrs.measure.ceilings import probe_host; "
            "json.dump(probe_host(*json.loads(sys.argv[1])), sys.stdout)")
    proc = subprocess.run(python_argv(code, json.dumps([threads, read_bytes, gemm_n, plan])),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeError(f"the ceiling probe failed: {last}")
    return json.loads(proc.stdout)


# -- OpenCL -----------------------------------------------------------------------------------

EMPTY_KERNEL = "__kernel void empty(__global int* p) { }"


def launch_us(be: Any, n: int = 2000, pyopencl: bool = False) -> float:
    """One empty launch, back to back: as the back end launches kernel by kernel (with no
    event, where it can: what a step pays) or through pyopencl's enqueue, which makes an event
    per launch."""
    import pyopencl as cl
    prg = cl.Program(be.ctx, EMPTY_KERNEL).build()
    k = cl.Kernel(prg, "empty")
    k.set_args(be.step_buf)
    if be.direct is not None and not pyopencl:
        prepared = be.direct.prepare([(k, (64, 1), (64, 1))] * n)
        enqueue = lambda m: be.direct.enqueue(prepared[:m])   # noqa: E731
    else:
        def enqueue(m: int) -> None:
            for _ in range(m):
                cl.enqueue_nd_range_kernel(be.queue, k, (64,), (64,))
    enqueue(min(100, n))
    be.queue.finish()
    t = time.perf_counter()
    enqueue(n)
    be.queue.finish()
    return (time.perf_counter() - t) / n * 1e6


def device_copy_gbps(be: Any, nbytes: int = 1 << 30, reps: int = 10) -> float:
    import pyopencl as cl
    nbytes = min(nbytes, be.device.max_mem_alloc_size // 2)
    a = cl.Buffer(be.ctx, cl.mem_flags.READ_WRITE, nbytes)
    b = cl.Buffer(be.ctx, cl.mem_flags.READ_WRITE, nbytes)
    cl.enqueue_fill_buffer(be.queue, a, np.uint8(1), 0, nbytes)
    cl.enqueue_copy(be.queue, b, a)
    be.queue.finish()
    t = time.perf_counter()
    for _ in range(reps):
        cl.enqueue_copy(be.queue, b, a)
    be.queue.finish()
    dt = time.perf_counter() - t
    a.release()
    b.release()
    return 2 * nbytes * reps / dt / 1e9


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {physical_cores()} cores"
