"""What the fastest possible decode step costs on an OpenCL device, whatever the kernels compute.

    python tools/bench_cl_floor.py --preset llama-3.2-1b --out floor.json

Replays the launch sequence of one decode step (embedding, per layer qkv / attention / o_proj /
gate_up / down, lm_head, argmax) with kernels that only stream each launch's weight bytes from
distinct device memory (16-byte loads, every thread's loads issued before any is used, one word
written per group so nothing is optimised away). Reported, per weights dtype:
    empty_launch_us   back-to-back empty kernels (one group), launched as the runtime launches
                      (no events: runtime/backends/opencl_launch.py), as tools/bench_opencl.py
                      measures it; empty_launch_us_pyopencl: the same through pyopencl
    per_kernel        for each launch kind alone, repeated back to back: wall us per launch and
                      the device's own time (profiling events) per launch
    step_us           the whole sequence, many steps enqueued then drained: wall us per step
    step_with_prologue_us   the same with each matvec group first reading an 8 KiB vector and
                      summing it across the group (a barrier): the cost of an RMS-style prologue
The issue's floor is max(launches x empty_launch_us, bytes / copy bandwidth); step_us says how
close to it a step of real launches can get on this driver.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from llmrs.compiler.outputs import write_output
from llmrs.compiler import ir
from llmrs.compiler.passes.quantize import WEIGHT_DTYPES
from llmrs.runtime.backends.opencl_launch import DirectLaunches

SOURCE = r"""
__kernel void empty(__global int* p) { }

// Every thread issues its LOADS loads before using any; one word per group is written only
// if the xor of everything read has a value the data never gives, so the loads stay.
uint stream_xor(__global const uint4* w, ulong n) {
    size_t gid = get_global_id(0), gs = get_global_size(0);
    uint acc = 0;
    for (size_t i = gid; i < n; i += LOADS * gs) {
        uint4 v[LOADS];
        for (int u = 0; u < LOADS; u++) {
            size_t j = i + u * gs;
            v[u] = j < n ? w[j] : (uint4)(0);
        }
        for (int u = 0; u < LOADS; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    return acc;
}

__kernel void stream(__global const uint4* w, ulong off, ulong n, __global uint* out) {
    w += off;
    uint acc = stream_xor(w, n);
    if (acc == 0x9e3779b9u) out[get_group_id(0)] = acc;
}

__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void stream_prologue(__global const uint4* w, ulong off, ulong n, __global uint* out, __global const float4* x) {
    w += off;
    __local float red[256];
    int lid = get_local_id(0);
    float s = 0.0f;
    for (int i = lid; i < 512; i += 256) { float4 v = x[i]; s += dot(v, v); }
    red[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = 128; k > 0; k >>= 1) {
        if (lid < k) red[lid] += red[lid + k];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float rms = red[0];
    uint acc = stream_xor(w, n);
    if (acc == 0x9e3779b9u || rms < 0.0f) out[get_group_id(0)] = acc;
}
"""

SHAPES = {
    # hidden, intermediate, heads, kv heads, head dim, vocab, layers
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256, 16),
}


def weight_bytes(rows: int, k: int, dtype: str) -> int:
    return ir.nbytes((rows, k), dtype)


def launch_sequence(preset: str, dtype: str, context: int) -> list[tuple[str, int, bool]]:
    """(kind, bytes read, has an RMS prologue) per launch of one decode step."""
    h, inter, nh, nkv, hd, vocab, layers = SHAPES[preset]
    seq = [("embedding", weight_bytes(1, h, dtype), False)]
    for _ in range(layers):
        seq += [("qkv", weight_bytes((nh + 2 * nkv) * hd, h, dtype), True),
                ("attention", 2 * context * nkv * hd * 2, False),
                ("o_proj", weight_bytes(h, nh * hd, dtype), False),
                ("gate_up", weight_bytes(2 * inter, h, dtype), True),
                ("down", weight_bytes(h, inter, dtype), False)]
    seq += [("lm_head", weight_bytes(vocab, h, dtype), True), ("argmax", vocab * 4, False)]
    return seq


def median_wall_us(queue, enqueue_all, reps: int) -> float:
    times = []
    for _ in range(reps):
        queue.finish()
        t = time.perf_counter()
        n = enqueue_all()
        queue.finish()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--weights", default="q4_0,f16",
                    help=f"comma-separated weight formats, each of {', '.join(WEIGHT_DTYPES)} (default q4_0,f16)")
    ap.add_argument("--context", type=int, default=600, help="KV entries attention reads")
    ap.add_argument("--loads", type=int, default=4, help="16-byte loads in flight per thread")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default=None, help="device name substring (default: first GPU, else first)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    bad = [w for w in args.weights.split(",") if w not in WEIGHT_DTYPES]
    if bad:
        ap.error(f"--weights {','.join(bad)}: choose from {', '.join(WEIGHT_DTYPES)}")
    import pyopencl as cl

    devices = [d for p in cl.get_platforms() for d in p.get_devices()]
    if args.device:
        devices = [d for d in devices if args.device.lower() in d.name.lower()]
    gpus = [d for d in devices if d.type & cl.device_type.GPU]
    if not devices:
        print("bench_cl_floor: no OpenCL device" + (f" matching {args.device!r}" if args.device else ""),
              file=sys.stderr)
        return 2
    dev = (gpus or devices)[0]
    ctx = cl.Context([dev])
    queue = cl.CommandQueue(ctx)
    pqueue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    prg = cl.Program(ctx, SOURCE).build(options=[f"-DLOADS={args.loads}"])
    sms = dev.max_compute_units
    out = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 1 << 20)
    x = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                  hostbuf=np.random.default_rng(0).standard_normal(2048).astype(np.float32))

    direct = DirectLaunches(queue)
    empty = cl.Kernel(prg, "empty")
    empty.set_args(out)
    empties = direct.prepare([(empty, (64, 1), (64, 1))] * 2000)
    direct.enqueue(empties[:100])
    empty_us = median_wall_us(queue, lambda: direct.enqueue(empties) or len(empties), 5)
    empty_py_us = median_wall_us(queue, lambda: [cl.enqueue_nd_range_kernel(queue, empty, (64,), (64,))
                                                for _ in range(2000)] and 2000, 5)
    result: dict = {"device": dev.name, "compute_units": sms, "loads_in_flight": args.loads,
                    "empty_launch_us": round(empty_us, 2), "empty_launch_us_pyopencl": round(empty_py_us, 2),
                    "weights": {}}
    print(f"{dev.name}: empty launch {empty_us:.2f} us ({empty_py_us:.2f} us through pyopencl)", flush=True)

    for dtype in args.weights.split(","):
        seq = launch_sequence(args.preset, dtype, args.context)
        total = sum(-(-b // 256) * 256 for _, b, _ in seq)
        wbuf = cl.Buffer(ctx, cl.mem_flags.READ_ONLY, total + 4096)
        cl.enqueue_fill_buffer(queue, wbuf, np.uint32(0x01234567), 0, total)
        launches = []       # (kind, kernel, kernel with prologue, global size)
        off = 0
        for kind, nbytes, _ in seq:
            n16 = (nbytes + 15) // 16
            threads = min(-(-n16 // args.loads), sms * 2048)
            gsize = max(256, -(-threads // 256) * 256)
            k = cl.Kernel(prg, "stream")
            k.set_args(wbuf, np.uint64(off // 16), np.uint64(n16), out)
            kp = cl.Kernel(prg, "stream_prologue")
            kp.set_args(wbuf, np.uint64(off // 16), np.uint64(n16), out, x)
            launches.append((kind, k, kp, gsize))
            off += -(-n16 * 16 // 256) * 256     # each launch's bytes start 256-byte aligned
        queue.finish()

        steps = {p: direct.prepare([(kp if p and rms else k, (g, 1), (256, 1))
                                    for (kind, k, kp, g), (_, _, rms) in zip(launches, seq)])
                 for p in (False, True)}

        def step(with_prologue: bool, n: int) -> int:
            for _ in range(n):
                direct.enqueue(steps[with_prologue])
            return n

        step(False, 5)
        step_us = median_wall_us(queue, lambda: step(False, args.steps), 5)
        step_p_us = median_wall_us(queue, lambda: step(True, args.steps), 5)

        per_kernel = {}
        for kind in dict.fromkeys(k for k, _, _ in seq):
            kind_launches = [(k, g) for kk, k, _, g in launches if kk == kind]
            reps = direct.prepare([(k, (g, 1), (256, 1)) for i in range(200)
                                   for k, g in [kind_launches[i % len(kind_launches)]]])
            wall = median_wall_us(queue, lambda: direct.enqueue(reps) or len(reps), 3)
            evs = [cl.enqueue_nd_range_kernel(pqueue, k, (g,), (256,)) for k, g in kind_launches * 4]
            pqueue.finish()
            dev_us = statistics.median((e.profile.end - e.profile.start) / 1e3 for e in evs)
            nbytes = next(b for kk, b, _ in seq if kk == kind)
            per_kernel[kind] = {"bytes": nbytes, "wall_us": round(wall, 2), "device_us": round(dev_us, 2),
                                "device_gbps": round(nbytes / dev_us / 1e3, 1)}
        floor_us = len(seq) * empty_us
        r = {"launches": len(seq), "bytes_per_step": total, "step_us": round(step_us, 1),
             "step_with_prologue_us": round(step_p_us, 1),
             "launch_floor_us": round(floor_us, 1), "step_over_launch_floor": round(step_us / floor_us, 2),
             "per_kernel": per_kernel}
        result["weights"][dtype] = r
        print(dtype, json.dumps(r), flush=True)
        wbuf.release()
    if args.out:
        write_output(args.out, json.dumps(result, indent=1) + "\n", "--out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
