#!/usr/bin/env python3
"""Speeds of several plans of one model (e.g. --weights q4_0 and q4_1) on one back end in one
process, their runs interleaved round by round so that a shared, noisy machine slows them alike.

    python tools/bench_compare.py PLAN [PLAN ...] [--backend cpu|opencl] [--threads N] [--rounds R]
                                  [--steps S] [--prompt P] [--prefill-tokens F] [--json FILE]

Every round runs, for each plan in turn (every other round in reverse order): a prefill of F random
tokens (in the steps the engine feeds: the plan's chunk, or the back end's prefill_rows where fewer;
from an empty cache; F = 0 skips it), then S decode steps after a P-token prompt (the cache rewound to P
each round, so every round does the same work). Reported per plan: the median over rounds of
decode tok/s, the weight bytes one decode step reads, bytes x tok/s (GB/s), prefill tok/s, and
each speed relative to the first plan as the median of the per-round ratios (a round's plans ran
back to back, so that is the least noisy figure).
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
from llmrs.compiler.summary import decode_weight_bytes
from llmrs.runtime.backends.base import Backend
from llmrs.runtime.backends.cpu import CpuBackend, physical_cores
from llmrs.runtime.plan import Plan


def prefill(be: Backend, tokens: np.ndarray) -> None:
    T = be.graphs["prefill"].T
    chunk = min(T, be.prefill_rows or T)
    for s in range(0, len(tokens), chunk):
        be.run_argmax("prefill", tokens[s:s + chunk], s, s)


def open_backend(plan: Plan, backend: str, threads: int) -> Backend:
    if backend == "opencl":
        from llmrs.runtime.backends.opencl import OpenCLBackend
        return OpenCLBackend(plan)
    return CpuBackend(plan, threads=threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plans", nargs="+", type=Path)
    ap.add_argument("--backend", choices=("cpu", "opencl"), default="cpu")
    ap.add_argument("--threads", type=int, default=physical_cores())
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per plan per round (default 32)")
    ap.add_argument("--prompt", type=int, default=16, help="tokens in the cache when decoding (default 16)")
    ap.add_argument("--prefill-tokens", type=int, default=128, help="prefill timed per round (default 128; 0: none)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args(argv)

    plans = [Plan.open(p) for p in args.plans]
    vocab = {p.graphs()["decode"].values["logits"].shape[1] for p in plans}
    if len(vocab) != 1:
        sys.exit("bench_compare: the plans are of different models (their vocabularies differ)")
    backends = [open_backend(p, args.backend, args.threads) for p in plans]
    rng = np.random.default_rng(0)
    n_vocab = vocab.pop()
    prompt, steps = rng.integers(0, n_vocab, args.prompt), rng.integers(0, n_vocab, args.steps)
    long_prompt = rng.integers(0, n_vocab, args.prefill_tokens)
    for be in backends:   # warm: pages, caches, threads
        prefill(be, long_prompt if args.prefill_tokens else prompt)
        be.run("decode", steps[:1], len(prompt), len(prompt))

    decode = [[] for _ in backends]
    pre = [[] for _ in backends]
    for rnd in range(args.rounds):
        order = list(enumerate(backends))   # every other round backwards: no plan always follows
        for i, be in (order if rnd % 2 == 0 else order[::-1]):   # the same one (what it left in cache)
            if args.prefill_tokens:
                t0 = time.perf_counter()
                prefill(be, long_prompt)
                pre[i].append(args.prefill_tokens / (time.perf_counter() - t0))
            prefill(be, prompt)
            t0 = time.perf_counter()
            for k, tok in enumerate(steps):
                be.run_argmax("decode", np.array([tok]), len(prompt) + k, len(prompt) + k)
            decode[i].append(args.steps / (time.perf_counter() - t0))

    def ratio(xs: list[float], ref: list[float]) -> float | None:
        return round(statistics.median(a / b for a, b in zip(xs, ref)), 4) if xs else None

    rows = []
    for path, plan, d, p in zip(args.plans, plans, decode, pre):
        nbytes, _ = decode_weight_bytes(plan.graphs()["decode"])
        tok_s = statistics.median(d)
        rows.append({"plan": str(path), "decode_tok_s": round(tok_s, 2), "weight_bytes_per_token": nbytes,
                     "weight_gb_s": round(nbytes * tok_s / 1e9, 2), "decode_ratio": ratio(d, decode[0]),
                     "prefill_tok_s": round(statistics.median(p), 2) if p else None,
                     "prefill_ratio": ratio(p, pre[0]), "decode_samples": [round(x, 2) for x in d],
                     "prefill_samples": [round(x, 2) for x in p]})
    where = "opencl" if args.backend == "opencl" else f"threads {args.threads}"
    print(f"{where}, {args.rounds} rounds: {args.steps} decode steps after {args.prompt} tokens, "
          f"prefill of {args.prefill_tokens}; x first = median of per-round ratios")
    print(f"{'plan':<40} {'decode tok/s':>12} {'MB/token':>9} {'GB/s':>6} {'x first':>8} "
          f"{'prefill tok/s':>13} {'x first':>8}")
    for r in rows:
        pf = f"{r['prefill_tok_s']:>13.1f} {r['prefill_ratio']:>8.3f}" if r["prefill_tok_s"] else ""
        print(f"{r['plan']:<40} {r['decode_tok_s']:>12.1f} {r['weight_bytes_per_token'] / 1e6:>9.2f} "
              f"{r['weight_gb_s']:>6.2f} {r['decode_ratio']:>8.3f} {pf}")
    if args.json:
        write_output(args.json, json.dumps({"backend": args.backend, "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
                                         "prompt": args.prompt, "prefill_tokens": args.prefill_tokens,
                                         "plans": rows}, indent=1) + "\n", "--json")
    for be in backends:
        be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
