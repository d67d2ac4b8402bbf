"""Decode through a plan's step graph: one sequence (the identity block table) against the
decode graph, and the aggregate tok/s of several sequences decoding together. Medians of
interleaved repeats (each repeat runs every plan and mode once), after a 64-token prompt per
sequence (fed through the step graph, one sequence a step). Greedy, as the engine runs it: where the
back end takes the argmax on the device, a step reads back a token a row, not the logits.

    python tools/bench_step_graph.py PLAN [PLAN ...] [--backend cpu|opencl] [--threads 2]
        [--repeats 9] [--steps 32] [--streams 1,4,8] [--profile]

--profile: each mode once more, microseconds a step summed by kernel: on OpenCL the device's
(a profiling queue), so a step's device time can be told from its host time; on the CPU the
clock stamps measure/profile.py compiles in after every kernel.
"""
from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict

import numpy as np

from llmrs.runtime.backends import BackendOptions, open_backend
from llmrs.runtime.backends.base import StepRows
from llmrs.runtime.plan import Plan, StepShape

PROMPT = 64


def decode_graph(be, shape: StepShape, steps: int, rng: np.random.Generator, after_prompt=None) -> float:
    """Seconds a token: the prompt through the prefill graph, then `steps` decode-graph steps."""
    be.reset()
    be.run("prefill", rng.integers(0, shape.vocab, PROMPT).astype(np.int32), 0, 0)
    if after_prompt:
        after_prompt()
    run = be.run_argmax if getattr(be, "device_argmax", False) else be.run   # greedy, as the engine
    t0 = time.perf_counter()
    for i in range(steps):
        run("decode", np.array([1], np.int32), PROMPT + i, PROMPT + i)
    return (time.perf_counter() - t0) / steps


def step_graph(be, shape: StepShape, n: int, steps: int, rng: np.random.Generator, after_prompt=None) -> float:
    """Seconds a step of one decode row per sequence; sequence s owns an equal run of blocks (one
    sequence: the identity table)."""
    be.reset()
    per, bs = shape.n_blocks // n, shape.block_size
    tables = np.zeros((n, shape.blocks_per_seq), np.int32)
    for s in range(n):
        tables[s, :per] = np.arange(s * per, (s + 1) * per)
    pos = np.arange(PROMPT)
    for s in range(n):
        be.run_step(StepRows(rng.integers(0, shape.vocab, PROMPT), pos, tables[s, pos // bs] * bs + pos % bs,
                             np.full(PROMPT, s), pos + 1, tables, np.array([PROMPT - 1])))
    if after_prompt:
        after_prompt()
    seqs = np.arange(n)
    # the rows as a scheduler hands them over, made before the clock starts: what is timed is
    # the back end's step (its checks, its inputs, its kernels), as the decode graph's is
    steps_rows = []
    for i in range(steps):
        p = np.full(n, PROMPT + i)
        steps_rows.append(StepRows(np.ones(n, np.int32), p, tables[seqs, p // bs] * bs + p % bs, seqs, p + 1,
                                   tables, seqs, generated=np.ones(n, np.int32)))
    # greedy, as the engine runs it: the device's argmax, 4 bytes a row read back (the logits of
    # 16 rows of a 128k vocabulary would add 8 MB of reading to every step)
    run = be.run_step_argmax if getattr(be, "device_argmax", False) else be.run_step
    t0 = time.perf_counter()
    for rows in steps_rows:
        run(rows)
    return (time.perf_counter() - t0) / steps


def kernel_profile(plan: Plan, shape: StepShape, streams: list[int], rng: np.random.Generator, backend: str,
                   threads: int) -> None:
    """us a step by kernel for the decode graph and each stream count: OpenCL's profiling events,
    or the CPU's clock stamps."""
    from llmrs.measure.profile import profiled_cpu, profiled_opencl

    steps = 8
    if backend == "opencl":
        be = profiled_opencl(plan, None)
        drop = lambda: be.kernel_slices("profile", 0)   # noqa: E731  the prompt's events
    else:
        be = profiled_cpu(plan, threads)
        drop = None
        slices_of = {"decode graph": "decode"}
    modes = [("decode graph", lambda: decode_graph(be, shape, steps, rng, drop))]
    modes += [(f"step graph, {n} rows", lambda n=n: step_graph(be, shape, n, steps, rng, drop)) for n in streams]
    for label, run in modes:
        per: dict[str, float] = defaultdict(float)
        by_op: dict[str, float] = defaultdict(float)   # the op (every layer's together) and kernel
        if backend == "opencl":
            run()
            slices = be.kernel_slices("profile", 0)
            for name, s, e, args in slices:
                per[args["cl_kernel"]] += (e - s) / 1e3 / steps
                op = be._ops.get("decode" if label == "decode graph" else "step", {}).get(args.get("op"))
                # named by what it writes (its output value), every layer's together
                what = re.sub(r"^l\d+\.", "", op.outputs[0] if op is not None else name)
                by_op[f"{what} {args['cl_kernel']}"] += (e - s) / 1e3 / steps
            launches = len(slices) // steps
        else:   # the stamps hold the last step run: run the mode, then one more step's worth
            run()
            slices = be.kernel_slices(slices_of.get(label, "step"))
            for name, s, e, args in slices:
                per[args["kernel"]] += (e - s) / 1e3
            launches = len(slices)
        total = sum(per.values())
        print(f"  {label}: {launches} kernels a step, {total:.0f} us a step; by kernel:")
        for fn, us in sorted(per.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {fn:28s} {us:9.1f} us ({us / total:.0%})")
        if by_op:
            print("    by op (all layers):")
        for key, us in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]:
            print(f"      {key:40s} {us:9.1f} us ({us / total:.0%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "opencl"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--streams", default="1,4,8", help="comma-separated sequence counts (default 1,4,8)")
    ap.add_argument("--profile", action="store_true", help="time by kernel, once per mode")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    rng = np.random.default_rng(0)
    runs = []
    for path in args.plans:
        plan = Plan.open(path)
        be = open_backend(plan, args.backend, BackendOptions(threads=args.threads))
        runs.append((path, plan, be, plan.step_shape()))
    times: dict[tuple[str, object], list[float]] = {}
    for _ in range(args.repeats):
        for path, _, be, shape in runs:
            times.setdefault((path, "decode"), []).append(decode_graph(be, shape, args.steps, rng))
            for n in streams:
                times.setdefault((path, n), []).append(step_graph(be, shape, n, args.steps, rng))
    where = f"{args.threads} threads" if args.backend == "cpu" else f"opencl ({runs[0][2].device_name})"
    print(f"{where}, medians of {args.repeats} interleaved repeats of {args.steps} steps "
          f"after a {PROMPT}-token prompt")
    for path, plan, be, shape in runs:
        dec = statistics.median(times[path, "decode"])
        one = statistics.median(times[path, streams[0]]) / streams[0]
        print(f"{path}: decode graph {1 / dec:.1f} tok/s ({dec * 1e3:.2f} ms a token)")
        for n in streams:
            t = statistics.median(times[path, n])
            vs = f"{dec / t:.3f}x the decode graph" if n == 1 else f"{one * n / t:.2f}x one sequence"
            print(f"  step graph, {n} sequence{'s' * (n > 1)}: {n / t:.1f} tok/s ({t * 1e3:.2f} ms a step), {vs}")
        be.close()
        if args.profile:
            kernel_profile(plan, shape, streams, rng, args.backend, args.threads)


if __name__ == "__main__":
    main()
