#!/usr/bin/env python3
"""Where a greedy decode step's time goes on an OpenCL device: the host's enqueue, the device's
kernels, and the gaps between them, measured in one process.

    python tools/profile_decode_gpu.py PLAN [PLAN ...] [--steps S] [--rounds R] [--prompt P] [--json FILE]

Per plan, after a P-token prompt:
  step by step    tok/s of S greedy steps as the engine runs them (each step's argmax read back
                  before the next is enqueued)
  enqueued        tok/s of S greedy steps enqueued back to back (run_greedy_steps), one read
  host enqueue    microseconds of host time a step's launches take to enqueue (the native loop),
                  on a second queue held back by a user event so that it only fills
  device          microseconds a step takes on the device once released: the queued steps'
                  time from release to finish, over their count; no host in the way
  kernels         a profiled step (events on a second, profiling queue, held back likewise):
                  each kernel's device time summed by kernel name, and the gaps between one
                  kernel's end and the next one's start
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from llmrs.compiler.outputs import write_output
from llmrs.runtime.backends.opencl import OpenCLBackend
from llmrs.runtime.backends.opencl_device import _cl
from llmrs.runtime.backends.opencl_launch import DirectLaunches
from llmrs.runtime.plan import Plan

from bench_launch_loop import decode   # tools/: greedy steps as the engine runs them


def step_by_step(be: OpenCLBackend, prompt: np.ndarray, steps: int) -> float:
    return decode(be, prompt, steps)[0]


def enqueued(be: OpenCLBackend, prompt: np.ndarray, steps: int) -> float:
    be.reset()
    tok = int(be.run_argmax("prefill", prompt, 0, 0)[-1])
    t0 = time.perf_counter()
    be.run_greedy_steps(tok, len(prompt), len(prompt), steps)
    return steps / (time.perf_counter() - t0)


def held(queue, release_after: float = 2.0):
    """A user event the queue waits on (a marker behind it), and a timer that releases it
    anyway: a driver that blocks an enqueue behind a full queue must not hang the probe."""
    cl = _cl()
    gate = cl.UserEvent(queue.context)
    cl.enqueue_marker(queue, wait_for=[gate])
    timer = threading.Timer(release_after, lambda: gate.set_status(cl.command_execution_status.COMPLETE))
    timer.start()
    return gate, timer


def release(gate, timer) -> bool:
    """Release the gate; False if the timer had already done so (the host timing is void)."""
    cl = _cl()
    timer.cancel()
    if gate.command_execution_status == cl.command_execution_status.COMPLETE:
        return False
    gate.set_status(cl.command_execution_status.COMPLETE)
    return True


def side_queue(be: OpenCLBackend):
    """A second in-order queue on the back end's context, with its own native launch loop: the
    probes hold it behind user events, never the engine's queue (on NVIDIA a queue that has
    waited on one, the step-by-step decode measured after it ran 1.7x below llmrs-bench's in the
    same call: round 22)."""
    cl = _cl()
    q = cl.CommandQueue(be.ctx)
    return q, (DirectLaunches(q) if be.direct is not None else None)


def host_and_device(be: OpenCLBackend, prompt: np.ndarray, steps: int, side) -> tuple[float, float, bool]:
    """(host us a step to enqueue, device us a step, whether the gate held throughout)."""
    cl = _cl()
    q, direct = side
    be.reset()
    tok = int(be.run_argmax("prefill", prompt, 0, 0)[-1])
    be.enqueue("decode", np.array([tok], np.int32), len(prompt), len(prompt), kernels=False)
    a = be.advance
    launches = be._step_launches("decode", 1) + [(a.kernel, a.global_size(1), (a.local, 1))]
    prepared = direct.prepare(launches) if direct is not None else None
    be.queue.finish()
    gate, timer = held(q)
    t0 = time.perf_counter()
    if prepared is not None:
        direct.enqueue(prepared, steps)
    else:
        for _ in range(steps):
            for k, g, l in launches:
                cl.enqueue_nd_range_kernel(q, k, g, l)
    t1 = time.perf_counter()
    ok = release(gate, timer)
    t2 = time.perf_counter()
    q.finish()
    t3 = time.perf_counter()
    return (t1 - t0) / steps * 1e6, (t3 - t2) / steps * 1e6, ok


def floor_us(be: OpenCLBackend, side, n: int = 400) -> dict:
    """Device microseconds an empty one-group kernel takes back to back in the in-order queue
    (the price of a launch boundary on the device, with no host in the way)."""
    cl = _cl()
    prg = cl.Program(be.ctx, "__kernel void nop(__global int *p) { if (get_global_id(0) == 1u << 30) p[0] = 1; }").build()
    k = prg.nop
    k.set_arg(0, be.step_buf)
    q, direct = side
    out = {}
    for groups in (1, 264):
        launches = [(k, (64 * groups, 1), (64, 1))] * n
        prepared = direct.prepare(launches) if direct is not None else None
        be.queue.finish()
        gate, timer = held(q)
        if prepared is not None:
            direct.enqueue(prepared)
        else:
            for kk, g, l in launches:
                cl.enqueue_nd_range_kernel(q, kk, g, l)
        release(gate, timer)
        t0 = time.perf_counter()
        q.finish()
        out[f"{groups}_groups"] = round((time.perf_counter() - t0) / n * 1e6, 2)
    return out


def kernels(be: OpenCLBackend, prompt: np.ndarray) -> dict:
    """One decode step's launches on a profiling queue, released at once: device us by kernel."""
    cl = _cl()
    be.reset()
    tok = be.run_argmax("prefill", prompt, 0, 0)[-1:]
    # the step's scalars and token in place (later kernels of a step reuse the token's arena slot)
    be.enqueue("decode", tok, len(prompt), len(prompt), kernels=False)
    be.queue.finish()
    q = cl.CommandQueue(be.ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    launches = be._step_launches("decode", 1)
    gate, timer = held(q)
    events = [(k.function_name, cl.enqueue_nd_range_kernel(q, k, g, l)) for k, g, l in launches]
    ok = release(gate, timer)
    q.finish()
    by = defaultdict(lambda: [0, 0.0])
    gaps = []
    prev_end = None
    for name, ev in events:
        s, e = ev.profile.start, ev.profile.end
        by[name][0] += 1
        by[name][1] += (e - s) / 1e3
        if prev_end is not None:
            gaps.append((s - prev_end) / 1e3)
        prev_end = e
    each = [(name, round((ev.profile.end - ev.profile.start) / 1e3, 2)) for name, ev in events]
    span = (events[-1][1].profile.end - events[0][1].profile.start) / 1e3
    return {"gate_held": ok, "launches": len(events), "span_us": round(span, 1),
            "kernel_us": round(sum(v[1] for v in by.values()), 1), "gap_us": round(sum(gaps), 1),
            "gap_median_us": round(statistics.median(gaps), 2) if gaps else 0.0,
            "by_kernel": {k: {"count": v[0], "us": round(v[1], 1)}
                          for k, v in sorted(by.items(), key=lambda kv: -kv[1][1])},
            "each": [(name, g, l, us) for (name, us), (_, g, l) in zip(each, launches)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plans", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for path in args.plans:
        be = OpenCLBackend(Plan.open(path))
        vocab = be.graphs["decode"].values[be.graphs["decode"].outputs[0]].shape[-1]
        prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).astype(np.int32)
        side = side_queue(be)
        s, e, h, d, held_ok = [], [], [], [], True
        for rnd in range(args.rounds + 1):
            r = (step_by_step(be, prompt, args.steps), enqueued(be, prompt, args.steps),
                 *host_and_device(be, prompt, min(args.steps, 8), side))
            if rnd:     # round 0 warms
                s.append(r[0]), e.append(r[1]), h.append(r[2]), d.append(r[3])
                held_ok &= r[4]
        prof = kernels(be, prompt)
        floor = floor_us(be, side)
        row = {"plan": str(path), "device": be.device_name, "native_loop": bool(be.direct and be.direct.native),
               "step_by_step_tok_s": round(statistics.median(s), 1), "enqueued_tok_s": round(statistics.median(e), 1),
               "host_enqueue_us": round(statistics.median(h), 1), "device_step_us": round(statistics.median(d), 1),
               "gate_held": held_ok, "empty_kernel_us": floor, "profiled_step": prof}
        rows.append(row)
        print(f"{path}  {be.device_name}  {prof['launches']} launches: step by step {row['step_by_step_tok_s']} tok/s "
              f"({1e6 / row['step_by_step_tok_s']:.0f} us), enqueued {row['enqueued_tok_s']} tok/s "
              f"({1e6 / row['enqueued_tok_s']:.0f} us); host enqueue {row['host_enqueue_us']} us a step, device "
              f"{row['device_step_us']} us a step (gate held: {held_ok})")
        print(f"  profiled step: span {prof['span_us']} us = kernels {prof['kernel_us']} + gaps {prof['gap_us']} "
              f"(median gap {prof['gap_median_us']} us)")
        print(f"  an empty kernel back to back on the device: {floor} us")
        for name, v in list(prof["by_kernel"].items())[:12]:
            print(f"    {name:40s} x{v['count']:<4d} {v['us']:8.1f} us")
        be.close()
    if args.json:
        write_output(args.json, json.dumps({"steps": args.steps, "rounds": args.rounds, "plans": rows}, indent=1)
                     + "\n", "--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
