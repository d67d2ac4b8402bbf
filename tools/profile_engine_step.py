#!/usr/bin/env python3
"""Where an engine step's wall time goes: timers around the batcher's step and the back end's
halves of it, for N streams as `llmrs-bench --parallel` runs them (random prompts, greedy,
ignore_eos). Averages a step over the run (its prompt steps included).

    python tools/profile_engine_step.py PLAN [--backend opencl] [--streams 1,8,16] [--prompt 128] [--decode 64]

  batcher step   Batcher.step() whole: on an async back end (OpenCL) it plans and prepares the next
                 step while the device runs this one, so the host's part shows as the gap between
                 this and "wait for tokens"
  prepare        the back end's host work before a launch (checks, packed inputs, launch list)
  launch         writing the inputs and enqueueing the launches
  wait for tokens  collect_step: the device's time the host did not hide, and the read
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np

import llmrs
from llmrs.measure.bench_parallel import run_streams
from llmrs.runtime import batch as batch_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--backend", default="opencl")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--streams", default="1,8,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    args = ap.parse_args()
    model = llmrs.load(args.plan, backend=args.backend, threads=args.threads)
    be = model.backend
    acc: collections.Counter = collections.Counter()

    def timed(name, f):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t
        return call

    for name, attr in (("prepare", "prepare_step"), ("launch", "launch_step"), ("wait for tokens", "collect_step")):
        setattr(be, attr, timed(name, getattr(be, attr)))
    step = batch_module.Batcher.step

    def counted(self):
        acc["steps"] += 1
        return timed("batcher step", step)(self)
    batch_module.Batcher.step = counted
    rng = np.random.default_rng(0)
    run_streams(model, 2, 16, 2, rng)                       # warm: weights, kernels
    for n in (int(s) for s in args.streams.split(",")):
        run_streams(model, n, args.prompt, 8, rng)          # this count's launch lists recorded
        acc.clear()
        r = run_streams(model, n, args.prompt, args.decode, rng)
        steps = acc.pop("steps")
        parts = ", ".join(f"{k} {v / steps * 1e6:.0f} us" for k, v in acc.items())
        print(f"{n:3d} streams  {r['decode_tok_s']:8.1f} tok/s  a step: {parts}")
    model.close()


if __name__ == "__main__":
    main()
