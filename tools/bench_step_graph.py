"""Decode through a plan's step graph on the CPU back end: one sequence (the identity block table)
against the decode graph, and the aggregate tok/s of 1, 4 and 8 sequences decoding together.
Medians of interleaved repeats (each repeat runs every plan and mode once), after a 64-token
prompt per sequence (fed through the step graph, one sequence a step).

    python tools/bench_step_graph.py PLAN [PLAN ...] [--threads 2] [--repeats 9] [--steps 32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from llmrs.runtime.backends.base import StepRows
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.plan import Plan, StepShape

PROMPT = 64
STREAMS = (1, 4, 8)


def decode_graph(be: CpuBackend, shape: StepShape, steps: int, rng: np.random.Generator) -> float:
    """Seconds a token: the prompt through the prefill graph, then `steps` decode-graph steps."""
    be.reset()
    be.run("prefill", rng.integers(0, shape.vocab, PROMPT).astype(np.int32), 0, 0)
    t0 = time.perf_counter()
    for i in range(steps):
        be.run("decode", np.array([1], np.int32), PROMPT + i, PROMPT + i)
    return (time.perf_counter() - t0) / steps


def step_graph(be: CpuBackend, shape: StepShape, n: int, steps: int, rng: np.random.Generator) -> float:
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
    seqs = np.arange(n)
    t0 = time.perf_counter()
    for i in range(steps):
        p = np.full(n, PROMPT + i)
        be.run_step(StepRows(np.ones(n, np.int32), p, tables[seqs, p // bs] * bs + p % bs, seqs, p + 1, tables,
                             seqs))
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    runs = []
    for path in args.plans:
        plan = Plan.open(path)
        runs.append((path, CpuBackend(plan, threads=args.threads), plan.step_shape()))
    times: dict[tuple[str, object], list[float]] = {}
    for _ in range(args.repeats):
        for path, be, shape in runs:
            times.setdefault((path, "decode"), []).append(decode_graph(be, shape, args.steps, rng))
            for n in STREAMS:
                times.setdefault((path, n), []).append(step_graph(be, shape, n, args.steps, rng))
    print(f"{args.threads} threads, medians of {args.repeats} interleaved repeats of {args.steps} steps "
          f"after a {PROMPT}-token prompt")
    for path, be, _ in runs:
        dec, one = statistics.median(times[path, "decode"]), statistics.median(times[path, 1])
        print(f"{path}: decode graph {1 / dec:.1f} tok/s ({dec * 1e3:.2f} ms a token)")
        for n in STREAMS:
            t = statistics.median(times[path, n])
            vs = f"{dec / t:.3f}x the decode graph" if n == 1 else f"{one * n / t:.2f}x one sequence"
            print(f"  step graph, {n} sequence{'s' * (n > 1)}: {n / t:.1f} tok/s ({t * 1e3:.2f} ms a step), {vs}")
        be.close()


if __name__ == "__main__":
    main()
