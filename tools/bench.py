"""Benchmark a plan: prefill and decode speed, each beside this machine's ceiling measured in the
same process (the machine may be shared and noisy: compare figures within one run only).

    python tools/bench.py PLAN [--backend cpu] [--threads N] [--repeats R] [--json FILE]
                               [--llama-bench BIN --gguf FILE]
    python tools/bench.py PLAN --backend opencl [--steps N] [--json FILE]

Ceilings, measured before and after the speeds (the best of both counts): memory read bandwidth (a
generated, vectorised streaming-read kernel run by all threads over a 1 GiB buffer, best of several
passes) and numpy's f32 GEMM GFLOP/s. Speeds: prefill tok/s
for 128- and 512-token prompts, decode tok/s over 128 tokens after a 512-token prompt and after a
1-token prompt (as llama-bench's tg128, from an empty cache); medians of --repeats runs. Decode is
shown as weight bytes per token x tok/s against the bandwidth; prefill as 2 x matmul params x
tok/s against the GEMM rate. A new back end is one `make_<name>` function
in BACKENDS.

--backend opencl measures the device instead (tools/bench_opencl.py's measure_plan): kernels per
decode step, one empty launch's cost, weight bytes per step, device copy bandwidth, decode tok/s,
the floor max(launches x launch cost, bytes / bandwidth) and our time over it, and prefill tok/s
of one chunk (the plan's --prefill-chunk, at most 512 tokens).

With --llama-bench, llama.cpp's `llama-bench -p 512 -n 128 -t THREADS -r R -o json` runs on the GGUF
(same weights, made from the same model folder) between the ceiling probes, and its tok/s are
reported beside ours with the ratio llmrs / llama.cpp. It decodes from an empty cache while ours
decodes after a 512-token prompt, so its attention reads a little less.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import llvmlite.ir as ir
import numpy as np

from llmrs.compiler.codegen.llvm_target import host_target
from llmrs.compiler.summary import decode_weight_bytes
from llmrs.runtime.backends.cpu import CpuBackend, physical_cores
from llmrs.runtime.backends.cpu_native import NativeCode
from llmrs.runtime.engine import Engine
from llmrs.runtime.plan import Plan

PROMPTS = (128, 512)
DECODE_TOKENS = 128
READ_BYTES = 1 << 30


@dataclass
class Result:
    plan: str
    backend: str
    threads: int
    repeats: int
    bandwidth_gbs: float            # streaming read, all threads, 1 GiB anonymous buffer
    weights_read_gbs: float         # the same kernel over the plan's mmapped weights
    gemm_gflops: float              # numpy f32 matmul
    weight_bytes_per_token: int     # bytes a decode step reads from the weights
    matmul_params: int              # weights of all matmuls (2 x this = ops per prefill token)
    prefill_tok_s_128: float
    prefill_tok_s_512: float
    decode_tok_s: float
    decode_tok_s_empty_cache: float          # 128 tokens after a 1-token prompt, as llama-bench's tg128
    decode_fraction_of_bandwidth: float
    decode_fraction_of_weights_read: float   # of the probe over the mmapped weights
    prefill_512_gops: float
    prefill_512_over_gemm: float
    machine: str
    date: str
    llama_cpp: "LlamaCpp | None" = None      # llama-bench on the same weights, same run
    llama_cpp_decode_ratio: float | None = None    # llmrs decode (after 512) tok/s / llama.cpp's tg128
    llama_cpp_decode_ratio_empty_cache: float | None = None  # both from an empty cache
    llama_cpp_prefill_ratio: float | None = None   # llmrs prefill-512 tok/s / llama.cpp's


@dataclass
class LlamaCpp:
    command: str
    build_commit: str
    model_bytes: int                # the GGUF's tensor bytes, as llama-bench reports them
    prefill_tok_s_512: float        # mean of -r repetitions, as llama-bench reports it
    decode_tok_s: float             # 128 tokens from an empty cache
    prefill_samples: list[float]
    decode_samples: list[float]


# -- ceilings ---------------------------------------------------------------------------------

def _read_kernel() -> tuple[NativeCode, Callable[[int, int], int]]:
    """i64 read_sum(ptr p, i64 nbytes): sums nbytes (a multiple of 4 vectors) as wide vectors,
    4 independent accumulators so the loads are not serialised."""
    target = host_target()
    lanes = 8 if target.has("avx512f") else 4            # i64 lanes of a 512/256-bit vector
    i64, vty, unroll = ir.IntType(64), ir.VectorType(ir.IntType(64), lanes), 4
    module = ir.Module("read_probe")
    module.triple = target.triple
    fn = ir.Function(module, ir.FunctionType(i64, [ir.PointerType(), i64]), "read_sum")
    p, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    entry, loop, done = b.block, fn.append_basic_block("loop"), fn.append_basic_block("done")
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), entry)
    accs = [b.phi(vty) for _ in range(unroll)]        # phis first: LLVM wants them at the top
    news = []
    for u, acc in enumerate(accs):
        acc.add_incoming(ir.Constant(vty, None), entry)
        off = b.add(i, ir.Constant(i64, u * lanes * 8))
        news.append(b.add(acc, b.load(b.gep(p, [off], source_etype=ir.IntType(8)), typ=vty, align=64)))
    nxt = b.add(i, ir.Constant(i64, unroll * lanes * 8))
    i.add_incoming(nxt, loop)
    for acc, new in zip(accs, news):
        acc.add_incoming(new, loop)
    b.cbranch(b.icmp_unsigned("<", nxt, n), loop, done)
    b.position_at_end(done)
    total = news[0]
    for new in news[1:]:
        total = b.add(total, new)
    b.ret(b.extract_element(total, ir.Constant(ir.IntType(32), 0)))
    code = NativeCode(str(module))
    return code, ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)(code.address("read_sum"))


def read_bandwidth(base: int, nbytes: int, threads: int, passes: int = 5) -> float:
    """GB/s of `threads` threads each streaming its slice of [base, base + nbytes); best pass."""
    _code, read_sum = _read_kernel()
    share = nbytes // threads // 4096 * 4096
    best = 0.0
    for _ in range(passes):
        team = [threading.Thread(target=read_sum, args=(base + k * share, share)) for k in range(threads)]
        t0 = time.perf_counter()
        for t in team:
            t.start()
        for t in team:
            t.join()
        best = max(best, share * threads / (time.perf_counter() - t0) / 1e9)
    return best


def gemm_gflops(n: int = 2048, passes: int = 5) -> float:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


# -- the plan ---------------------------------------------------------------------------------

def measure_ceilings(weights: np.ndarray, threads: int, say: Callable[[str], None]) -> tuple[float, float, float]:
    """(read GB/s over 1 GiB of anonymous memory, read GB/s over the mmapped weights, GEMM GFLOP/s)."""
    say(f"bench: ceilings ({threads} threads)")
    buf = np.ones(READ_BYTES // 8, np.int64)                   # touched: every page is resident
    bw = read_bandwidth(buf.ctypes.data, buf.nbytes, threads)
    del buf
    return bw, read_bandwidth(weights.ctypes.data, len(weights), threads), gemm_gflops()


def run_llama_bench(binary: str, gguf: str, threads: int, repeats: int) -> LlamaCpp:
    """llama.cpp's own benchmark on the same machine and thread count; its JSON has one record per
    test: n_prompt > 0 is prefill, n_gen > 0 decode; samples_ts are per-repetition tok/s."""
    cmd = [binary, "-m", gguf, "-p", str(max(PROMPTS)), "-n", str(DECODE_TOKENS), "-t", str(threads),
           "-r", str(repeats), "-o", "json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"bench: --llama-bench {binary}: cannot run it ({e.strerror}); pass llama.cpp's llama-bench binary")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        sys.exit(f"bench: --llama-bench {binary} failed on --gguf {gguf}: {last}")
    try:
        records = json.loads(proc.stdout)
        pp = next(r for r in records if r["n_prompt"] > 0)
        tg = next(r for r in records if r["n_gen"] > 0)
    except (ValueError, StopIteration, KeyError, TypeError):
        sys.exit(f"bench: --llama-bench {binary} printed no prefill and decode records; is it llama.cpp's llama-bench?")
    return LlamaCpp(" ".join(cmd), str(pp.get("build_commit", "")), int(pp.get("model_size", 0)),
                    round(pp["avg_ts"], 2), round(tg["avg_ts"], 2),
                    [round(x, 2) for x in pp["samples_ts"]], [round(x, 2) for x in tg["samples_ts"]])


def make_cpu(plan: Plan, threads: int):
    return CpuBackend(plan, threads=threads)


BACKENDS: dict[str, Callable] = {"cpu": make_cpu}


def time_prefill(engine: Engine, n: int, rng: np.random.Generator, vocab: int) -> float:
    engine.reset()
    prompt = rng.integers(0, vocab, n).tolist()
    t0 = time.perf_counter()
    engine.prefill(prompt)
    return n / (time.perf_counter() - t0)


def time_decode(engine: Engine, prompt_len: int, n: int, rng: np.random.Generator, vocab: int) -> float:
    engine.reset()
    logits = engine.prefill(rng.integers(0, vocab, prompt_len).tolist())
    t0 = time.perf_counter()
    for _ in range(n):
        logits = engine.decode_one_token(int(np.argmax(logits)))
    return n / (time.perf_counter() - t0)


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {physical_cores()} cores"


def bench(plan_path: str, backend: str, threads: int, repeats: int,
          llama: tuple[str, str] | None = None) -> Result:
    plan = Plan.open(plan_path)
    m = plan.manifest
    prefill_T, max_seq = int(m["prefill_chunk"]), int(m["max_seq_len"])
    if max_seq < max(PROMPTS) + DECODE_TOKENS:
        sys.exit(f"bench: {plan_path} holds {max_seq} tokens; recompile with --max-seq-len "
                 f"{max(PROMPTS) + DECODE_TOKENS} or more")
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    weights = plan.weights_region()
    ceil = [measure_ceilings(weights, threads, say)]
    wbytes, params = decode_weight_bytes(plan.graphs()["decode"])
    engine = Engine(BACKENDS[backend](plan, threads), prefill_T, max_seq)
    vocab = next(plan.graphs()["decode"].values[op.inputs[0]].shape[0]
                 for op in plan.graphs()["decode"].ops if op.kind == "embedding")
    rng = np.random.default_rng(0)
    time_prefill(engine, 16, rng, vocab)                          # warm: page in weights, code
    pre = {n: [] for n in PROMPTS}
    dec, dec0 = [], []
    for r in range(repeats):
        say(f"bench: repeat {r + 1}/{repeats}")
        for n in PROMPTS:
            pre[n].append(time_prefill(engine, n, rng, vocab))
        dec.append(time_decode(engine, max(PROMPTS), DECODE_TOKENS, rng, vocab))
        dec0.append(time_decode(engine, 1, DECODE_TOKENS, rng, vocab))
    lcpp = None
    if llama is not None:
        say(f"bench: llama-bench on {llama[1]}")
        lcpp = run_llama_bench(llama[0], llama[1], threads, repeats)
    ceil.append(measure_ceilings(weights, threads, say))
    # best of before and after: the machine may be shared, and a low ceiling would flatter us
    bw, wbw, gemm = (max(c[i] for c in ceil) for i in range(3))
    p128, p512, d = (statistics.median(pre[128]), statistics.median(pre[512]), statistics.median(dec))
    d0 = statistics.median(dec0)
    gops = 2 * params * p512 / 1e9
    return Result(plan_path, backend, threads, repeats, round(bw, 2), round(wbw, 2), round(gemm, 1), wbytes,
                  params, round(p128, 2), round(p512, 2), round(d, 2), round(d0, 2),
                  round(wbytes * d / 1e9 / bw, 3), round(wbytes * d / 1e9 / wbw, 3), round(gops, 1),
                  round(gops / gemm, 3), machine(), time.strftime("%Y-%m-%d %H:%M"), lcpp,
                  round(d / lcpp.decode_tok_s, 3) if lcpp else None,
                  round(d0 / lcpp.decode_tok_s, 3) if lcpp else None,
                  round(p512 / lcpp.prefill_tok_s_512, 3) if lcpp else None)


def report(r: Result) -> str:
    lines = [
        f"plan {r.plan}  backend {r.backend}  threads {r.threads}  repeats {r.repeats}  ({r.machine})",
        f"ceilings: read bandwidth {r.bandwidth_gbs:.1f} GB/s (plan weights mmapped: "
        f"{r.weights_read_gbs:.1f} GB/s), numpy f32 GEMM {r.gemm_gflops:.1f} GFLOP/s",
        f"decode      {r.decode_tok_s:7.2f} tok/s  x {r.weight_bytes_per_token / 1e6:.1f} MB/token = "
        f"{r.decode_tok_s * r.weight_bytes_per_token / 1e9:.1f} GB/s = "
        f"{r.decode_fraction_of_bandwidth:.2f} of read bandwidth ({r.decode_fraction_of_weights_read:.2f} of the "
        "weights probe)",
        f"decode      {r.decode_tok_s_empty_cache:7.2f} tok/s from an empty cache",
        f"prefill 128 {r.prefill_tok_s_128:7.2f} tok/s",
        f"prefill 512 {r.prefill_tok_s_512:7.2f} tok/s  = {r.prefill_512_gops:.1f} G op/s = "
        f"{r.prefill_512_over_gemm:.2f} x numpy f32 GEMM",
    ]
    if r.llama_cpp is not None:
        c = r.llama_cpp
        lines += [
            f"llama.cpp   decode {c.decode_tok_s:7.2f} tok/s  x {c.model_bytes / 1e6:.1f} MB = "
            f"{c.decode_tok_s * c.model_bytes / 1e9:.1f} GB/s (from an empty cache); llmrs / llama.cpp = "
            f"{r.llama_cpp_decode_ratio:.2f} (ours after 512 tokens), {r.llama_cpp_decode_ratio_empty_cache:.2f} "
            "(both from an empty cache)",
            f"llama.cpp   prefill 512 {c.prefill_tok_s_512:7.2f} tok/s; llmrs / llama.cpp = "
            f"{r.llama_cpp_prefill_ratio:.2f}  ({c.command})",
        ]
    return "\n".join(lines)


def bench_opencl(plan_path: str, steps: int, json_path: str | None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ scripts share code, unpackaged
    from bench_opencl import measure_plan

    plan = Plan.open(plan_path)
    if "opencl" not in plan.sections:
        sys.exit(f"bench: {plan_path} has no OpenCL code; compile it with --target opencl")
    prefill = min(512, int(plan.manifest["prefill_chunk"]))
    if int(plan.manifest["max_seq_len"]) < prefill + 4 * steps + 8:
        sys.exit(f"bench: {plan_path} holds {plan.manifest['max_seq_len']} tokens; recompile with "
                 f"--max-seq-len {prefill + 4 * steps + 8} or more")
    r = measure_plan(Path(plan_path), prefill, steps)
    dec = r["decode"]
    print(f"device {r['device']}: empty launch {r['launch_us']:.2f} us, copy bandwidth {r['copy_gbps']:.0f} GB/s\n"
          f"decode  {dec['tok_s']:.1f} tok/s ({dec['ms_per_token']:.3f} ms/token), {dec['kernels_per_step']} kernels, "
          f"{dec['weight_bytes'] / 1e6:.1f} MB of weights = {dec['weight_read_of_copy_bw']:.1%} of copy bandwidth; "
          f"floor {dec['floor_ms']:.3f} ms, {dec['over_floor']:.2f}x over it\n"
          f"prefill {r['prefill']['tok_s']:.1f} tok/s ({prefill} tokens in one chunk)", file=sys.stderr)
    text = json.dumps(r, indent=1)
    if json_path:
        Path(json_path).write_text(text + "\n")
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--backend", choices=sorted(BACKENDS) + ["opencl"], default="cpu")
    ap.add_argument("--threads", type=int, default=physical_cores())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON here (default: stdout)")
    ap.add_argument("--llama-bench", metavar="BIN", help="llama.cpp's llama-bench binary: run it in the same run")
    ap.add_argument("--gguf", metavar="FILE", help="the GGUF for --llama-bench (same weights as the plan)")
    ap.add_argument("--steps", type=int, default=64, help="opencl: timed decode steps (default 64)")
    a = ap.parse_args(argv)
    if a.backend == "opencl":
        return bench_opencl(a.plan, a.steps, a.json)
    if a.threads < 1 or a.repeats < 1:
        ap.error("--threads and --repeats must be at least 1")
    if (a.llama_bench is None) != (a.gguf is None):
        ap.error("--llama-bench and --gguf go together: pass both or neither")
    r = bench(a.plan, a.backend, a.threads, a.repeats,
              (a.llama_bench, a.gguf) if a.llama_bench else None)
    print(report(r), file=sys.stderr if a.json is None else sys.stdout)
    text = json.dumps(asdict(r), indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
