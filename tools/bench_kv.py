"""What KV-cache eviction costs in time, per back end, in one process (medians of repeats):

  events    one eviction (the policy's choice, scores read back, compaction, scores cleared) of a
            full cache of S slots: S -> S-1 (what sliding and h2o do after every decode step once
            over budget) and S -> S/2 (a budget or memory-pressure eviction), per policy
  scores    decode steps at S/2 cached tokens with the attention's score writing off and on (h2o
            needs it every step, snapkv only in the cache's last window, sliding never): the
            median of per-round tok/s, and of per-round ratios on/off (rounds interleaved)
  generate  decode tok/s of a generation under each policy with budget S/2 (4 sinks): a prompt
            of S/2 + 16 tokens, then --tokens greedy tokens; sliding and h2o evict a slot every
            step, snapkv compresses once after the prompt

    python tools/bench_kv.py smol512.plan.bin --backends cpu,opencl --threads 2 -o bench/kv_cost.json

The plan needs a KV cache of S = its --max-seq-len slots and code for each back end named.
Progress on stderr, tables on stdout, JSON with -o.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from llmrs.cliutil import OneLineParser
from llmrs.compiler.outputs import write_output
from llmrs.runtime.backends import BackendOptions, open_backend
from llmrs.runtime.backends.opencl import OpenCLBackend
from llmrs.runtime.engine import Engine, EngineError
from llmrs.runtime.kv import CacheManager, make_policy
from llmrs.runtime.plan import Plan, PlanError
from llmrs.runtime.sampler import Sampler, SamplerConfig

POLICIES = ("sliding", "snapkv", "h2o")
SINKS = 4


def log(msg: str) -> None:
    print(f"bench_kv: {msg}", file=sys.stderr, flush=True)


class State:
    """Every KV state value (K, V, scores, score control) of a back end, saved and put back."""

    def __init__(self, be):
        g = be.graphs["decode"]
        self.be, self.names = be, list(g.state)
        self.saved = {n: self._read(n) for n in self.names}

    def _read(self, n):
        if isinstance(self.be, OpenCLBackend):   # device memory; the others' stores hold numpy arrays
            return self.be.read_value("decode", n)
        return self.be.kv_store().arrays[n].copy()

    def restore(self):
        if isinstance(self.be, OpenCLBackend):
            for n in self.names:
                self.be.write_value("decode", n, self.saved[n])
            self.be.scoring = False
        else:
            arrays = self.be.kv_store().arrays
            for n in self.names:
                arrays[n][...] = self.saved[n]


def fill(be, tokens: np.ndarray, chunk: int, scoring: bool) -> None:
    """Prefill tokens from an empty cache, every row adding to the scores when `scoring`."""
    be.reset()
    be.kv_store().set_score_from(0 if scoring else None)
    for s in range(0, len(tokens), chunk):
        be.run("prefill", tokens[s:s + chunk], s, s)
    be.kv_store().set_score_from(None)


def bench_events(be, label: str, slots: int, chunk: int, tokens: np.ndarray, repeats: int) -> list[dict]:
    fill(be, tokens[:slots], chunk, scoring=True)
    state = State(be)
    rows = []
    for policy in POLICIES:
        for keep in (slots - 1, slots // 2):
            ms = []
            for _ in range(repeats):
                state.restore()
                cache = CacheManager(make_policy(policy, keep - SINKS, SINKS, snapkv_window=32), be.kv_store())
                cache.record_step(0, 0, slots)
                assert cache.make_room(slots, 1) == keep
                ms.append(cache.events[-1].seconds * 1e3)
            rows.append({"policy": policy, "before": slots, "after": keep, "ms": statistics.median(ms),
                         "ms_all": [round(m, 3) for m in ms]})
            log(f"{label}: evict {policy} {slots} -> {keep}: {rows[-1]['ms']:.2f} ms (median of {repeats})")
    return rows


def bench_scores(be, label: str, slots: int, chunk: int, tokens: np.ndarray, steps: int, rounds: int) -> dict:
    n0 = slots // 2
    fill(be, tokens[:n0], chunk, scoring=False)
    state = State(be)
    store = be.kv_store()
    speed = {"off": [], "on": []}
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            state.restore()
            store.set_score_from(0 if mode == "on" else None)
            t0 = time.perf_counter()
            for i in range(steps):
                be.run("decode", tokens[n0 + i:n0 + i + 1], n0 + i, n0 + i)
            speed[mode].append(steps / (time.perf_counter() - t0))
            store.set_score_from(None)
    ratios = [on / off for on, off in zip(speed["on"], speed["off"])]
    out = {"n_past": n0, "steps": steps, "rounds": rounds,
           "off_tok_s": statistics.median(speed["off"]), "on_tok_s": statistics.median(speed["on"]),
           "on_over_off": statistics.median(ratios)}
    log(f"{label}: decode at {n0} cached: scores off {out['off_tok_s']:.1f} tok/s, on {out['on_tok_s']:.1f} tok/s "
        f"(on/off {out['on_over_off']:.3f})")
    return out


def bench_generate(be, label: str, slots: int, chunk: int, tokens: np.ndarray, n_new: int, rounds: int) -> list[dict]:
    budget = slots // 2
    prompt = [int(t) for t in tokens[:budget + 16]]
    speed: dict[str, list[float]] = {p: [] for p in ("none", *POLICIES)}
    events: dict[str, int] = {}
    for r in range(rounds):
        order = list(speed) if r % 2 == 0 else list(speed)[::-1]
        for policy in order:
            be.reset()
            cache = None if policy == "none" else CacheManager(
                make_policy(policy, budget - SINKS, SINKS, snapkv_window=32), be.kv_store())
            engine = Engine(be, chunk, slots, (), cache=cache)
            gen = engine.generate(prompt, n_new, Sampler(SamplerConfig()))
            speed[policy].append(gen.stats.decode_tok_s)
            events[policy] = len(gen.stats.evictions)
    base = speed["none"]
    rows = [{"policy": p, "tok_s": statistics.median(v), "vs_none": statistics.median(a / b for a, b in zip(v, base)),
             "evictions": events[p]} for p, v in speed.items()]
    for row in rows:
        log(f"{label}: generate {row['policy']}: {row['tok_s']:.1f} tok/s ({row['vs_none']:.3f} of none), "
            f"{row['evictions']} evictions")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="bench_kv.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("plan", type=Path)
    ap.add_argument("--backends", default="cpu,opencl", help="comma-separated: cpu, opencl, reference (default cpu,opencl)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    ap.add_argument("--device", default=None, help="OpenCL device index or name")
    ap.add_argument("--repeats", type=int, default=7, help="evictions timed per case (default 7)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the speed runs (default 5)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round, scores off/on (default 32)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per policy and round (default 64)")
    ap.add_argument("-o", "--output", type=Path, help="JSON file to write")
    args = ap.parse_args(argv)
    backends = args.backends.split(",")
    if any(b not in ("cpu", "opencl", "reference") for b in backends):
        ap.error(f"--backends {args.backends!r}: choose from cpu, opencl, reference")
    plan = Plan.open(args.plan)
    m = plan.manifest
    slots, chunk = int(m["max_seq_len"]), int(m["prefill_chunk"])
    vocab = int(m["model"]["vocab_size"])
    tokens = np.random.default_rng(0).integers(3, vocab, slots + max(args.steps, args.tokens) + 1).astype(np.int32)
    result = {"plan": str(args.plan), "compile_command": m.get("compile_command"), "slots": slots,
              "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "backends": {}}
    for name in backends:
        be = open_backend(plan, name, BackendOptions(threads=args.threads, device=args.device))
        label = f"{name} ({be.device_name})" if be.device_name else name
        log(f"{label}: S = {slots} slots")
        result["backends"][name] = {
            "device": label,
            "events": bench_events(be, label, slots, chunk, tokens, args.repeats),
            "scores": bench_scores(be, label, slots, chunk, tokens, args.steps, args.rounds),
            "generate": bench_generate(be, label, slots, chunk, tokens, args.tokens, args.rounds),
        }
        be.close()
    print_tables(result)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_output(args.output, json.dumps(result, indent=1) + "\n", "-o")
        log(f"wrote {args.output}")
    return 0


def print_tables(result: dict) -> None:
    s = result["slots"]
    print(f"eviction cost per event (ms, median), cache of {s} slots")
    print("| back end | policy | " + " | ".join(f"{s} -> {k}" for k in (s - 1, s // 2)) + " |")
    print("|---|---|---:|---:|")
    for name, b in result["backends"].items():
        for p in POLICIES:
            ev = {e["after"]: e["ms"] for e in b["events"] if e["policy"] == p}
            print(f"| {b['device']} | {p} | {ev[s - 1]:.2f} | {ev[s // 2]:.2f} |")
    print("\ndecode with the attention's score writing off and on")
    print("| back end | cached tokens | scores off (tok/s) | scores on (tok/s) | on / off |")
    print("|---|---:|---:|---:|---:|")
    for name, b in result["backends"].items():
        sc = b["scores"]
        print(f"| {b['device']} | {sc['n_past']} | {sc['off_tok_s']:.1f} | {sc['on_tok_s']:.1f} | {sc['on_over_off']:.3f} |")
    print(f"\ngeneration under each policy, budget {s // 2} (decode tok/s, median; vs none: median of per-round ratios)")
    print("| back end | none | sliding | snapkv | h2o |")
    print("|---|---:|---:|---:|---:|")
    for name, b in result["backends"].items():
        g = {r["policy"]: r for r in b["generate"]}
        print(f"| {b['device']} | " + " | ".join(
            f"{g[p]['tok_s']:.1f}" + ("" if p == "none" else f" ({g[p]['vs_none']:.2f}x)") for p in ("none", *POLICIES)) + " |")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (PlanError, EngineError, ValueError, OSError) as e:   # bad input: one line, exit 2
        print(f"bench_kv.py: error: {e}", file=sys.stderr)
        sys.exit(2)
