"""Benchmark --backend hybrid: CPU prefill + OpenCL decode and OpenCL prefill + CPU decode, with
the CPU alone and OpenCL alone as baselines, on a random model of a preset's exact shape.

    python tools/bench_hybrid.py --preset llama-3.2-1b --work /tmp/bh --out hybrid.json
    python tools/bench_hybrid.py --preset tiny --work /tmp/bh-tiny --prompt-tokens 64 --new-tokens 16

Makes the model (tools/make_tiny_model.py's presets) and compiles it for cpu,opencl into --work
(both kept there and reused by a later run with the same options), loads the plan once on both
back ends (runtime/backends/hybrid.py) and, round by round so that drift hits every
configuration alike, runs each configuration once per round: a prompt of --prompt-tokens random
ids, then --new-tokens greedy tokens (never stopping early). Per configuration it reports medians
over the rounds of
    prefill_tok_s, decode_tok_s   the engine's phase speeds (what llmrs-run --stats shows)
    phases                        tok/s of each phase on each back end (the hybrid's own timing)
    switch                        the KV hand-over: ms, K/V bytes moved, live slots, copy or map
and whether its tokens equal the CPU's alone. JSON with --out; progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from llmrs.compiler.outputs import write_output
from llmrs.compiler.cli import main as compile_main
from llmrs.models.tiny import PRESETS, make_model
from llmrs.runtime.backends.hybrid import KV_MODES, HybridBackend, Schedule
from llmrs.runtime.engine import Engine
from llmrs.runtime.kv.store import NEVER
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

CONFIGS = {
    "cpu": Schedule("cpu", NEVER),
    "opencl": Schedule("opencl", NEVER),
    "cpu prefill + opencl decode": Schedule("cpu"),
    "opencl prefill + cpu decode": Schedule("opencl"),
}


def log(msg: str) -> None:
    print(f"bench_hybrid: {msg}", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS),
                    help="model shape (default llama-3.2-1b; tiny for a quick check)")
    ap.add_argument("--work", type=Path, required=True, help="folder for the model and the plan (reused)")
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    ap.add_argument("--weights", default="q4_0", help="compile --weights (default q4_0)")
    ap.add_argument("--kv-type", default="f16", help="compile --kv-type (default f16)")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="compile --prefill-chunk (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every configuration (default 3; medians)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    ap.add_argument("--device", default=None, help="OpenCL device index or name")
    ap.add_argument("--hybrid-kv", choices=KV_MODES, default="auto",
                    help="KV hand-over: map, copy or auto (map where the device shares host memory)")
    return ap


def prepare(args: argparse.Namespace) -> Path:
    """The plan for the preset and compile options, made (and the model) unless --work has it."""
    model = args.work / f"model-{args.preset}"
    if not (model / "config.json").is_file():
        log(f"making the random {args.preset} model in {model}")
        make_model(model, args.preset)
    slots = args.prompt_tokens + args.new_tokens
    plan = args.work / (f"{args.preset}-{args.weights}-kv{args.kv_type}-s{slots}-c{args.prefill_chunk}.plan.bin")
    if not plan.is_file():
        log(f"compiling {plan} (cpu,opencl)")
        t0 = time.perf_counter()
        rc = compile_main([str(model), "-o", str(plan), "--target", "cpu,opencl", "--weights", args.weights,
                           "--kv-type", args.kv_type, "--max-seq-len", str(slots),
                           "--prefill-chunk", str(args.prefill_chunk), "-q"])
        if rc:
            raise SystemExit(f"bench_hybrid: compiling failed (exit {rc})")
        log(f"compiled in {time.perf_counter() - t0:.0f} s")
    return plan


def one_run(hybrid: HybridBackend, plan: Plan, schedule: Schedule, prompt: list[int], n_new: int) -> dict:
    hybrid.schedule = schedule
    hybrid.reset()
    hybrid.clear_report()
    m = plan.manifest
    engine = Engine(hybrid, int(m["prefill_chunk"]), int(m["max_seq_len"]), ())   # no stop token: n_new tokens
    gen = engine.generate(prompt, n_new, Sampler(SamplerConfig()))
    phases = {f"{phase} on {side}": ph.tokens / ph.seconds for (phase, side), ph in hybrid.phases.items() if ph.seconds}
    switches = [dict(src=e.src, dst=e.dst, position=e.position, live_slots=e.live_slots, kv_bytes=e.kv_bytes,
                     score_bytes=e.score_bytes, ms=e.seconds * 1e3, mode=e.mode) for e in hybrid.switches]
    return dict(tokens=gen.tokens, prefill_tok_s=gen.stats.prefill_tok_s, decode_tok_s=gen.stats.decode_tok_s,
                phases=phases, switches=switches)


def summarize(runs: list[dict], cpu_tokens: list[int]) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    out = dict(prefill_tok_s=med([r["prefill_tok_s"] for r in runs]),
               decode_tok_s=med([r["decode_tok_s"] for r in runs]),
               phases={k: med([r["phases"][k] for r in runs if k in r["phases"]])
                       for k in sorted({k for r in runs for k in r["phases"]})},
               tokens_match_cpu=all(r["tokens"] == cpu_tokens for r in runs))
    sw = [r["switches"] for r in runs]
    if sw and sw[0]:
        first = sw[0][0]
        out["switch"] = dict(direction=f"{first['src']} -> {first['dst']}", position=first["position"],
                             live_slots=first["live_slots"], kv_bytes=first["kv_bytes"],
                             score_bytes=first["score_bytes"], mode=first["mode"],
                             ms=med([s[0]["ms"] for s in sw]), ms_all=[s[0]["ms"] for s in sw])
    else:
        out["switch"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("prompt_tokens", "new_tokens", "rounds", "prefill_chunk"):
        if getattr(args, name) < 1:
            print(f"bench_hybrid: error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    args.work.mkdir(parents=True, exist_ok=True)
    plan_path = prepare(args)
    plan = Plan.open(plan_path)
    log("loading the plan on cpu and opencl")
    t0 = time.perf_counter()
    hybrid = HybridBackend.load(plan, CONFIGS["cpu"], args.hybrid_kv, args.threads, args.device,
                                notice=lambda line: log(line))
    log(f"loaded in {time.perf_counter() - t0:.1f} s: {hybrid.opencl.device_name}, KV {hybrid.kv_mode}, "
        f"{hybrid.cpu.threads} CPU threads")
    vocab = int(plan.manifest["model"]["vocab_size"])
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, vocab, args.prompt_tokens)]
    log("warm-up: one short run of each configuration")
    for schedule in CONFIGS.values():
        one_run(hybrid, plan, schedule, prompt[:min(len(prompt), 8)], 2)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        for name, schedule in CONFIGS.items():
            log(f"round {r + 1}/{args.rounds}: {name}")
            runs[name].append(one_run(hybrid, plan, schedule, prompt, args.new_tokens))
    cpu_tokens = runs["cpu"][0]["tokens"]
    results = {name: summarize(rs, cpu_tokens) for name, rs in runs.items()}
    report = dict(preset=args.preset, plan=str(plan_path), weights=args.weights, kv_type=args.kv_type,
                  device=hybrid.opencl.device_name, cpu=platform.processor() or platform.machine(),
                  threads=hybrid.cpu.threads, kv_mode=hybrid.kv_mode, prompt_tokens=args.prompt_tokens,
                  new_tokens=args.new_tokens, rounds=args.rounds, configs=results)
    hybrid.close()
    print(f"{'configuration':<28} {'prefill tok/s':>13} {'decode tok/s':>12}  switch")
    for name, res in results.items():
        sw = res["switch"]
        switch = (f"{sw['direction']} at {sw['position']}: {sw['kv_bytes'] / 2**20:.2f} MiB {sw['mode']} "
                  f"in {sw['ms']:.2f} ms" if sw else "-")
        print(f"{name:<28} {res['prefill_tok_s']:>13.1f} {res['decode_tok_s']:>12.2f}  {switch}"
              + ("" if res["tokens_match_cpu"] else "  (tokens differ from the CPU's)"))
    if args.out:
        write_output(args.out, json.dumps(report, indent=1), "--out")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
