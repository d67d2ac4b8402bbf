#!/usr/bin/env python3
"""Greedy decode on OpenCL with a step's launches enqueued by one native loop (the default) and
by Python, one ctypes call a launch: the host time the loop saves, measured in one process.

    python tools/bench_launch_loop.py PLAN [PLAN ...] [--rounds R] [--steps S] [--prompt P] [--json FILE]

Per plan, each round decodes S greedy tokens after a P-token prompt with each loop in turn (every
other round in the other order), step by step as the engine does (a step's argmax read back
before the next is enqueued); both loops must give the same tokens. Reported: the median tok/s of
each and the median of the per-round ratios native / Python.
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
from llmrs.runtime.backends.opencl import OpenCLBackend
from llmrs.runtime.backends.opencl_launch import DirectLaunches
from llmrs.runtime.plan import Plan


def decode(be: OpenCLBackend, prompt: np.ndarray, steps: int) -> tuple[float, list[int]]:
    """(tok/s, tokens) of `steps` greedy steps after `prompt`, from an empty cache."""
    be.reset()
    tok = be.run_argmax("prefill", prompt, 0, 0)[-1:]
    n = len(prompt)
    out = []
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = be.run_argmax("decode", tok, n, n)
        out.append(int(tok[0]))
        n += 1
    return steps / (time.perf_counter() - t0), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plans", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for path in args.plans:
        be = OpenCLBackend(Plan.open(path))
        loops = {"native": be.direct, "python": DirectLaunches(be.queue, native=False)}
        if be.direct is None or not be.direct.native:
            sys.exit(f"bench_launch_loop: {path}: the back end does not launch through the native loop here")
        vocab = be.graphs["decode"].values[be.graphs["decode"].outputs[0]].shape[-1]
        prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).astype(np.int32)
        speeds: dict[str, list[float]] = {name: [] for name in loops}
        tokens = {}
        for rnd in range(args.rounds + 1):     # round 0 warms both (built launch lists, clocks)
            order = list(loops) if rnd % 2 else list(loops)[::-1]
            for name in order:
                be.direct = loops[name]     # the prepared launch lists serve either loop
                tok_s, tokens[name] = decode(be, prompt, args.steps)
                if rnd:
                    speeds[name].append(tok_s)
            if tokens["native"] != tokens["python"]:
                sys.exit(f"bench_launch_loop: {path}: the two loops decoded different tokens")
        ratio = statistics.median(a / b for a, b in zip(speeds["native"], speeds["python"]))
        launches = len(be._step_launches("decode", 1))
        row = {"plan": str(path), "device": be.device_name, "launches_per_step": launches,
               "native_tok_s": round(statistics.median(speeds["native"]), 2),
               "python_tok_s": round(statistics.median(speeds["python"]), 2), "ratio": round(ratio, 4),
               "native_samples": [round(x, 2) for x in speeds["native"]],
               "python_samples": [round(x, 2) for x in speeds["python"]]}
        rows.append(row)
        print(f"{path}  {be.device_name}  {launches} launches a step: native loop {row['native_tok_s']} tok/s, "
              f"python {row['python_tok_s']} tok/s, native / python {row['ratio']:.3f} (median of {args.rounds} rounds)")
        be.close()
    if args.json:
        write_output(args.json, json.dumps({"rounds": args.rounds, "steps": args.steps, "prompt": args.prompt,
                                            "plans": rows}, indent=1) + "\n", "--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
