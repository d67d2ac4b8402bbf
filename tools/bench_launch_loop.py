#!/usr/bin/env python3
"""Greedy decode on OpenCL with a step's launches sent each way the back end has, in one process:
replayed as a CUDA graph (NVIDIA, the default there: runtime/backends/opencl_cuda.py; and with
programmatic dependent launch, "cuda_pdl": LLMRS_OPENCL_CUDA_PDL's mode, 2 if unset or 0), enqueued by one native loop (the default elsewhere),
and by Python, one ctypes call a launch.

    python tools/bench_launch_loop.py PLAN [PLAN ...] [--rounds R] [--steps S] [--prompt P] [--json FILE]

Per plan, each round decodes S greedy tokens after a P-token prompt with each launcher in turn
(every other round in the reverse order), step by step as the engine does (a step's argmax read
back before the next is enqueued); all must give the same tokens. Reported: the median tok/s of
each, and the medians of the per-round ratios to the Python loop and (where it runs) of CUDA graphs
to the native loop. The launchers share the back end's memory, so switching costs nothing.
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
from llmrs.runtime.backends.opencl_cuda import pdl_default
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
    failed = False
    for path in args.plans:
        be = OpenCLBackend(Plan.open(path))
        cuda = be.cuda_graphs
        loops = {**({"cuda_graphs": be.direct, "cuda_pdl": be.direct} if cuda else {}),
                 "native": be.direct, "python": DirectLaunches(be.queue, native=False)}
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
                be._cuda_live = name.startswith("cuda")
                if cuda:
                    be.cuda.pdl = (pdl_default() or 2) if name == "cuda_pdl" else 0
                tok_s, tokens[name] = decode(be, prompt, args.steps)
                if rnd:
                    speeds[name].append(tok_s)
            differ = [name for name, t in tokens.items() if t != tokens["python"]]
            if differ:
                break
        be._cuda_live = cuda
        if differ:
            for name in differ:
                at = next(i for i, (a, b) in enumerate(zip(tokens[name], tokens["python"])) if a != b)
                print(f"bench_launch_loop: {path}: {name} decoded other tokens than the Python loop from step {at} "
                      f"(round {rnd}); notes: {be.build_notes}", file=sys.stderr)
            failed = True
            continue

        def ratio(a: str, b: str) -> float:
            return round(statistics.median(x / y for x, y in zip(speeds[a], speeds[b])), 4)
        launches = len(be._step_launches("decode", 1))
        row = {"plan": str(path), "device": be.device_name, "launches_per_step": launches,
               **{f"{k}_tok_s": round(statistics.median(v), 2) for k, v in speeds.items()},
               "ratio": ratio("native", "python"),
               **({"cuda_graphs_vs_native": ratio("cuda_graphs", "native"),
                   "cuda_pdl_vs_cuda_graphs": ratio("cuda_pdl", "cuda_graphs")} if cuda else {}),
               **{f"{k}_samples": [round(x, 2) for x in v] for k, v in speeds.items()}}
        rows.append(row)
        print(f"{path}  {be.device_name}  {launches} launches a step: "
              + ", ".join(f"{k} {row[k + '_tok_s']} tok/s" for k in speeds)
              + f"; native / python {row['ratio']:.3f}"
              + (f", CUDA graphs / native {row['cuda_graphs_vs_native']:.3f}, with PDL / without "
                 f"{row['cuda_pdl_vs_cuda_graphs']:.3f}" if cuda else "")
              + f" (medians of {args.rounds} rounds)")
        be.close()
    if args.json:
        write_output(args.json, json.dumps({"rounds": args.rounds, "steps": args.steps, "prompt": args.prompt,
                                            "plans": rows}, indent=1) + "\n", "--json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
