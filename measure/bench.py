"""llmrs-bench PLAN: how fast a plan runs here, beside this machine's ceilings measured in the
same run (a shared machine is noisy: compare figures of one run only)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..cliutil import OneLineParser
from ..compiler.outputs import check_output_file, write_output
from ..compiler.summary import decode_weight_bytes
from . import ceilings
from .ceilings import sig
from ..runtime.backends import Backend, BackendOptions, open_backend
from ..runtime.backends.cpu import physical_cores
from ..runtime.engine import Engine, Stats
from ..runtime.plan import Plan, PlanError

SCHEMA = "llmrs-bench/1"
BACKENDS = ("cpu", "opencl")

EPILOG = """\
what it measures (medians of --repeats runs, each from an empty cache):
  prefill N     tok/s of an N-token prompt (random ids), and the time to the first token:
                prefill plus choosing the token (greedy)
  decode        tok/s of --decode greedy tokens after a 1-token prompt ("empty", as llama-bench's
                tg128) and after a prompt of the largest --prefill size, or of --depth tokens ("deep")
  peak memory   the process's peak resident memory after the speeds (the probes run apart)
ceilings, measured before and after the speeds (the best of both counts):
  read GB/s     a generated vectorised read kernel on --threads threads over --read-mib MiB, in a
                child process (and over the plan's mmapped weights)
  numpy GEMM    f32 matmul of --gemm x --gemm matrices, GFLOP/s
  opencl        the device's buffer copy GB/s and one empty launch's us, after the speeds
decode is also shown as weight bytes per token x tok/s against the bandwidth (read GB/s on cpu,
device copy on opencl); prefill as 2 x matmul params x tok/s against numpy's GEMM.

--kernels times every distinct kernel of the plan alone (measure/bench_kernels.py) with GB/s and
GFLOP/s against those ceilings. --llama-bench runs llama.cpp's llama-bench on --gguf (the same
weights) once after each of our repeats, so both engines share each stretch of a shared machine's
time (-r 2, its first repetition dropped: on CUDA it still pays set-up), and adds its tok/s and the
ratios llmrs / llama.cpp (medians of the repeats' ratios).

examples:
  llmrs-bench plan.bin
  llmrs-bench plan.bin --backend opencl --json bench.json
  llmrs-bench plan.bin --prefill 64 --decode 32 --repeats 1 --kernels
  llmrs-bench plan.bin --threads 2 --llama-bench build/bin/llama-bench --gguf model.gguf
  llmrs-bench plan.bin --threads 2 --depth 4096 --llama-bench build/bin/llama-bench --gguf model.gguf
exit status: 0 measured, 2 bad arguments or a plan this back end cannot run.
"""


class BenchError(ValueError):
    """Bad input: one line, exit 2."""


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="llmrs-bench", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Benchmark a plan end to end (prefill, decode, time to first token, peak "
                                   "memory) and optionally kernel by kernel, beside the machine's ceilings "
                                   "measured in the same run.", epilog=EPILOG)
    ap.add_argument("plan", type=Path, help="a plan.bin written by llmrs-compile")
    ap.add_argument("--backend", default="cpu", choices=BACKENDS, help="cpu (default) or opencl")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    ap.add_argument("--device", default=None, help="OpenCL device index or name (default: as llmrs-run)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement; medians (default 3)")
    ap.add_argument("--prefill", default="128,512", metavar="N,N", help="prompt sizes in tokens (default 128,512)")
    ap.add_argument("--decode", type=int, default=128, metavar="N", help="decoded tokens per run (default 128)")
    ap.add_argument("--depth", type=int, default=None, metavar="N",
                    help="decode also after N tokens of context (default: after the largest --prefill); with "
                         "--llama-bench, llama.cpp's decode at that depth (-d N) too")
    ap.add_argument("--kernels", action="store_true", help="also time every distinct kernel alone")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON here")
    ap.add_argument("--llama-bench", metavar="BIN", help="llama.cpp's llama-bench binary, run in the same run")
    ap.add_argument("--gguf", metavar="FILE", help="the GGUF for --llama-bench (the plan's weights)")
    ap.add_argument("--parallel", metavar="N,N", help="instead: N streams at once through the plan's step graph, "
                    "for each N (e.g. 1,4,8,16): aggregate decode tok/s and time to first token; prompts of the "
                    "first --prefill size")
    ap.add_argument("--llama-batched-bench", metavar="BIN", help="with --parallel: llama.cpp's llama-batched-bench "
                    "on --gguf, in the same run")
    ap.add_argument("--ngl", type=int, default=None, metavar="N",
                    help="llama.cpp's -ngl for --llama-batched-bench, --llama-lookup, --llama-speculative (layers on "
                         "the GPU; default: its own)")
    ap.add_argument("--speculative", choices=("lookup", "draft"), help="instead: decode with and without "
                    "speculative decoding on each prompt type (code, quote, list, chat), greedy, interleaved; "
                    "--decode tokens each")
    ap.add_argument("--draft", metavar="PLAN", help="with --speculative draft: the draft plan")
    ap.add_argument("--draft-backend", choices=BACKENDS, help="the draft plan's back end (default: --backend)")
    ap.add_argument("--num-speculative-tokens", type=int, metavar="K",
                    help="with --speculative: drafts per verify step (default adaptive); llama.cpp gets "
                         "--spec-draft-n-max K (default 8)")
    ap.add_argument("--llama-lookup", metavar="BIN", help="with --speculative lookup: llama.cpp's llama-lookup on "
                    "--gguf, same prompts (its speed without speculation: --llama-bench at the prompt's depth)")
    ap.add_argument("--llama-speculative", metavar="BIN", help="with --speculative draft: llama.cpp's "
                    "llama-speculative on --gguf with --gguf-draft")
    ap.add_argument("--gguf-draft", metavar="FILE", help="the draft GGUF for --llama-speculative")
    ap.add_argument("--read-mib", type=int, default=1024, help="read probe buffer, MiB (default 1024)")
    ap.add_argument("--gemm", type=int, default=2048, help="GEMM probe size n (n x n x n; default 2048)")
    return ap


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise BenchError(f"--prefill {text!r}: give token counts separated by commas, e.g. 128,512") from None
    if not sizes or sizes[0] < 1:
        raise BenchError(f"--prefill {text!r}: token counts must be at least 1")
    return sizes


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- llama.cpp --------------------------------------------------------------------------------

def run_llama_bench(binary: str, gguf: str, threads: int, repeats: int, prompt: int, decode: int,
                    dropped: int = 0, depth: int = 0) -> dict:
    """llama.cpp's own benchmark on the same machine and thread count; its JSON has one record per
    test: n_prompt > 0 is prefill, n_gen > 0 decode; samples_ts are per-repetition tok/s. `dropped`
    more repetitions run first and are left out of the samples: on CUDA the first repetition of a
    fresh llama-bench process still pays lazy set-up its own warm-up run does not (H200, 1B q4_0
    pp512: 17-26k tok/s against 52k for the next ones). depth > 0: its tests run after that many
    tokens of context (-d); prompt 0: decode only (the prefill fields are None)."""
    cmd = [binary, "-m", gguf, "-p", str(prompt), "-n", str(decode), "-t", str(threads), "-r", str(repeats + dropped),
           "-o", "json"] + (["-d", str(depth)] if depth else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise BenchError(f"--llama-bench {binary}: cannot run it ({e.strerror}); pass llama.cpp's llama-bench binary")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise BenchError(f"--llama-bench {binary} failed on --gguf {gguf}: {last}")
    try:
        records = json.loads(proc.stdout)
        pp = next(r for r in records if r["n_prompt"] > 0) if prompt else None
        tg = next(r for r in records if r["n_gen"] > 0)
    except (ValueError, StopIteration, KeyError, TypeError):
        raise BenchError(f"--llama-bench {binary} printed no prefill and decode records; is it llama.cpp's llama-bench?")
    dec = tg["samples_ts"][dropped:]
    pre = pp["samples_ts"][dropped:] if pp else None
    return {"command": " ".join(cmd) + (f"  (its first {dropped} repetition(s) dropped)" if dropped else ""),
            "build_commit": str((pp or tg).get("build_commit", "")),
            "model_bytes": int((pp or tg).get("model_size", 0)), "prefill_tokens": prompt, "depth": depth,
            "prefill_tok_s": (round(statistics.mean(pre) if dropped else pp["avg_ts"], 2)) if pp else None,
            "decode_tok_s": round(statistics.mean(dec) if dropped else tg["avg_ts"], 2),
            "prefill_samples": [round(x, 2) for x in pre] if pre is not None else None,
            "decode_samples": [round(x, 2) for x in dec]}


def merge_llama_runs(runs: list[dict]) -> dict:
    """llama-bench run once after each of our repeats (-r 2, the first dropped): its figures as
    medians of those runs, so both engines' numbers come from the same stretch of a shared
    machine's time."""
    first, med = runs[0], statistics.median
    pre = [x for r in runs for x in r["prefill_samples"]] if first["prefill_samples"] is not None else None
    dec = [x for r in runs for x in r["decode_samples"]]
    return {**first, "command": first["command"] + f"  (once after each of {len(runs)} llmrs repeats)",
            "prefill_tok_s": round(med(pre), 2) if pre else None, "decode_tok_s": round(med(dec), 2),
            "prefill_samples": pre, "decode_samples": dec}


# -- speeds -----------------------------------------------------------------------------------

def _greedy(engine: Engine) -> Callable[[Any], int]:
    on_device = engine.backend.device_argmax
    return (lambda out: int(out)) if on_device else (lambda out: int(np.argmax(out)))


def time_prefill(engine: Engine, n: int, rng: np.random.Generator, vocab: int) -> tuple[float, float]:
    """(tok/s of the prompt, seconds to the first token: prefill + the greedy choice)."""
    engine.reset()
    prompt = rng.integers(0, vocab, n).tolist()
    pick, argmax = _greedy(engine), engine.backend.device_argmax
    t0 = time.perf_counter()
    out = engine.prefill(prompt, argmax)
    t1 = time.perf_counter()
    pick(out)
    return n / (t1 - t0), time.perf_counter() - t0


def time_decode(engine: Engine, prompt_len: int, n: int, rng: np.random.Generator, vocab: int) -> float:
    engine.reset()
    argmax = engine.backend.device_argmax
    pick = _greedy(engine)
    out = engine.prefill(rng.integers(0, vocab, prompt_len).tolist(), argmax)
    t0 = time.perf_counter()
    for _ in range(n):
        out = engine.decode_one_token(pick(out), argmax)
    return n / (time.perf_counter() - t0)


def make_backend(name: str, plan: Plan, threads: int, device: Any) -> Backend:
    missing = plan.missing_code(name)
    if missing:
        raise BenchError(f"{plan.path}: {missing}")
    from ..runtime.backends.opencl_device import OpenCLError
    try:
        return open_backend(plan, name, BackendOptions(threads=threads, device=device))
    except OpenCLError as e:
        raise BenchError(str(e)) from None


def bench(a: argparse.Namespace) -> dict[str, Any]:
    prefills = _sizes(a.prefill)
    threads = a.threads or physical_cores()
    try:
        plan = Plan.open(a.plan)
    except PlanError as e:
        raise BenchError(str(e)) from None
    missing = plan.missing_code(a.backend)
    if missing:   # before any measuring: the one line is all the user sees
        raise BenchError(f"{a.plan}: {missing}")
    m = plan.manifest
    max_seq, deep = int(m["max_seq_len"]), a.depth or max(prefills)
    if max_seq < max(prefills) + a.decode or max_seq < deep + a.decode:
        what = f"--depth {deep}" if a.depth else f"--prefill {deep}"
        need = max(deep, max(prefills)) + a.decode
        raise BenchError(f"{a.plan} holds {max_seq} tokens; {what} + --decode {a.decode} need "
                         f"{need}: recompile with --max-seq-len {need} or give smaller sizes")
    graphs = plan.graphs()
    decode_g = graphs["decode"]
    vocab = next(decode_g.values[op.inputs[0]].shape[0] for op in decode_g.ops if op.kind == "embedding")
    wbytes, params = decode_weight_bytes(decode_g)
    read_bytes = a.read_mib << 20

    say(f"llmrs-bench: ceilings ({threads} threads, {a.read_mib} MiB read probe, GEMM {a.gemm})")
    host = [ceilings.measure_host(threads, read_bytes, a.gemm, str(a.plan))]
    say(f"llmrs-bench: loading {a.plan} on {a.backend}")
    backend = make_backend(a.backend, plan, threads, a.device)
    engine = Engine(backend, int(m["prefill_chunk"]), max_seq)
    rng = np.random.default_rng(0)
    time_prefill(engine, min(16, deep), rng, vocab)       # warm: page in weights, build lazily built code
    pre = {n: [] for n in prefills}
    ttft = {n: [] for n in prefills}
    dec_empty, dec_deep = [], []
    lcpp_runs: list[dict] = []
    lcpp_deep: list[dict] = []
    for r in range(a.repeats):
        say(f"llmrs-bench: repeat {r + 1}/{a.repeats}: prefill {','.join(map(str, prefills))}, decode {a.decode} "
            f"from empty and after {deep}")
        for n in prefills:
            tok_s, first = time_prefill(engine, n, rng, vocab)
            pre[n].append(tok_s)
            ttft[n].append(first)
        dec_empty.append(time_decode(engine, 1, a.decode, rng, vocab))
        dec_deep.append(time_decode(engine, deep, a.decode, rng, vocab))
        if a.llama_bench:   # interleaved: each engine's repeat beside the other's, not minutes apart
            say(f"llmrs-bench: llama-bench on {a.gguf}, repeat {r + 1}/{a.repeats}")
            lcpp_runs.append(run_llama_bench(a.llama_bench, a.gguf, threads, 1, max(prefills), a.decode, dropped=1))
            if a.depth:
                lcpp_deep.append(run_llama_bench(a.llama_bench, a.gguf, threads, 1, 0, a.decode, dropped=1,
                                                 depth=a.depth))
    peak = Stats.peak_rss_bytes()
    lcpp = merge_llama_runs(lcpp_runs) if lcpp_runs else None
    if lcpp and lcpp_deep:
        at = merge_llama_runs(lcpp_deep)
        lcpp["deep"] = {"depth": a.depth, "decode_tok_s": at["decode_tok_s"], "decode_samples": at["decode_samples"],
                        "command": at["command"]}
    say("llmrs-bench: ceilings again")
    host.append(ceilings.measure_host(threads, read_bytes, a.gemm, str(a.plan)))
    # best of before and after: the machine may be shared, and a low ceiling would flatter us
    ceil = {k: round(max(h.get(k, 0.0) for h in host), 2) for k in host[0]}
    device = None
    if a.backend == "opencl":
        device = backend.device_name
        ceil["device_copy_gbps"] = round(ceilings.device_copy_gbps(backend, read_bytes), 2)
        ceil["launch_us"] = round(ceilings.launch_us(backend), 2)
    bw = ceil["device_copy_gbps"] if a.backend == "opencl" else ceil["read_gbs"]

    med = statistics.median
    d_deep, d_empty = med(dec_deep), med(dec_empty)
    widest = max(prefills)
    gops = 2 * params * med(pre[widest]) / 1e9
    result: dict[str, Any] = {
        "schema": SCHEMA, "plan": str(a.plan), "backend": a.backend, "device": device, "threads": threads,
        "repeats": a.repeats, "machine": ceilings.machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "ceilings": ceil,
        "model": {"weight_bytes_per_token": wbytes, "matmul_params": params,
                  "decode_kernels": decode_g.kernel_count(), "prefill_kernels": graphs["prefill"].kernel_count(),
                  "prefill_chunk": int(m["prefill_chunk"]), "max_seq_len": max_seq},
        "prefill": [{"tokens": n, "tok_s": round(med(pre[n]), 2), "ttft_ms": sig(med(ttft[n]) * 1e3),
                     "samples_tok_s": [round(x, 2) for x in pre[n]]} for n in prefills],
        "decode": {
            "tokens": a.decode,
            "empty": {"context": 1, "tok_s": round(d_empty, 2), "ms_per_token": round(1e3 / d_empty, 4),
                      "samples_tok_s": [round(x, 2) for x in dec_empty]},
            "deep": {"context": deep, "tok_s": round(d_deep, 2), "ms_per_token": round(1e3 / d_deep, 4),
                     "samples_tok_s": [round(x, 2) for x in dec_deep]},
        },
        "decode_weight_gbs": sig(wbytes * d_deep / 1e9),
        "decode_of_bandwidth": sig(wbytes * d_deep / 1e9 / bw),
        "prefill_gops": sig(gops),
        "prefill_of_gemm": sig(gops / ceil["gemm_gflops"]),
        "peak_memory_bytes": peak,
        "llama_cpp": lcpp,
        "kernels": None,
    }
    if lcpp:   # medians of the per-repeat ratios: each pair ran back to back
        ratios = lambda ours, theirs: round(med(o / t for o, t in zip(ours, theirs)), 3)  # noqa: E731
        result["llama_cpp_ratios"] = {"decode_deep": ratios(dec_deep, lcpp["decode_samples"]),
                                      "decode_empty": ratios(dec_empty, lcpp["decode_samples"]),
                                      "prefill": ratios(pre[widest], lcpp["prefill_samples"])}
        if "deep" in lcpp:   # both after the same context
            result["llama_cpp_ratios"]["decode_at_depth"] = ratios(dec_deep, lcpp["deep"]["decode_samples"])
    if a.kernels:
        from .bench_kernels import time_kernels
        dev = a.device
        if a.backend == "opencl":   # the device found above, by index: no second search and notice
            from ..runtime.backends.opencl import list_devices
            dev = [d for _, d in list_devices()].index(backend.device)
        backend.close()
        rows = time_kernels(plan, a.backend, ceil, widest, threads, dev, max(a.repeats, 3), say)
        result["kernels"] = [asdict(r) for r in rows]
    return result


def bench_streams(a: argparse.Namespace) -> dict[str, Any]:
    """--parallel: measure/bench_parallel.py's figures for each stream count."""
    from ..runtime.batch import BatchOptions
    from ..runtime.model import Model
    from .bench_parallel import bench_parallel, run_batched_bench

    counts, prompt = _sizes(a.parallel), _sizes(a.prefill)[0]
    threads = a.threads or physical_cores()
    try:
        plan = Plan.open(a.plan)
    except PlanError as e:
        raise BenchError(str(e)) from None
    shape = plan.step_shape()
    if shape is None:
        raise BenchError(f"{a.plan} has no step graph (it runs one sequence at a time); recompile it with "
                         "llmrs-compile --max-num-seqs N")
    seats = shape.seqs
    if max(counts) > seats:
        raise BenchError(f"--parallel {max(counts)}: {a.plan} runs at most {seats} sequences a step; recompile "
                         f"with --max-num-seqs {max(counts)}")
    need, slots = max(counts) * (prompt + a.decode), int(plan.manifest["max_seq_len"])
    if need > slots:
        raise BenchError(f"--parallel {max(counts)} x (prompt {prompt} + --decode {a.decode}) = {need} tokens, more "
                         f"than the plan's {slots}-slot cache: recompile with --max-seq-len {need} or give smaller sizes")
    missing = plan.missing_code(a.backend)
    if missing:
        raise BenchError(f"{a.plan}: {missing}")
    say(f"llmrs-bench: loading {a.plan} on {a.backend}")
    model = Model.bind(plan, make_backend(a.backend, plan, threads, a.device), batch=BatchOptions(no_prefix_cache=True))
    with model:
        rows = bench_parallel(model, counts, prompt, a.decode, a.repeats, say)
        device = model.backend.device_name or None
    lcpp, command = None, None
    if a.llama_batched_bench:
        say(f"llmrs-bench: llama-batched-bench on {a.gguf}")
        command, lcpp = run_batched_bench(a.llama_batched_bench, a.gguf, threads, counts, prompt, a.decode, a.ngl)
    return {"schema": SCHEMA + "/parallel", "plan": str(a.plan), "backend": a.backend, "device": device,
            "threads": threads, "repeats": a.repeats, "machine": ceilings.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "parallel": rows, "peak_memory_bytes": Stats.peak_rss_bytes(),
            "llama_cpp": {"command": command, "rows": lcpp} if lcpp else None}


def bench_spec(a: argparse.Namespace) -> dict[str, Any]:
    """--speculative: measure/bench_speculative.py's figures for each prompt type."""
    from ..runtime.speculative import SpeculativeOptions
    from .bench_speculative import bench_speculative, llama_plain_decode, run_llama_spec

    threads = a.threads or physical_cores()
    options = BackendOptions(threads=threads, device=a.device)
    spec = SpeculativeOptions(a.speculative, a.draft, a.draft_backend, a.num_speculative_tokens).check()
    say(f"llmrs-bench: {a.plan} on {a.backend}, {a.speculative} speculative decoding")
    rows, device, texts = bench_speculative(str(a.plan), a.backend, options, spec, a.decode, a.repeats, say)
    lcpp = None
    binary = a.llama_lookup or a.llama_speculative
    if binary:
        lcpp = []
        for r in rows:
            say(f"llmrs-bench: llama.cpp on {r['prompt']}")
            run = run_llama_spec(binary, a.gguf, a.gguf_draft, texts[r["prompt"]], threads, a.decode,
                                 a.num_speculative_tokens or 8, a.repeats, a.ngl)
            run["plain_tok_s"] = llama_plain_decode(a.llama_bench, a.gguf, threads, r["prompt_tokens"], a.decode,
                                                    a.repeats, a.ngl)
            lcpp.append(run)
    return {"schema": SCHEMA + "/speculative", "plan": str(a.plan), "backend": a.backend, "threads": threads,
            "device": device, "draft_backend": a.draft_backend or a.backend,
            "speculative": a.speculative, "draft": a.draft, "num_speculative_tokens": a.num_speculative_tokens,
            "decode": a.decode, "repeats": a.repeats, "machine": ceilings.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows, "llama_cpp": lcpp}


def report_spec(r: dict[str, Any]) -> str:
    from .bench_speculative import report_speculative
    where = f"{r['backend']} ({r['device']})" if r["device"] else f"{r['backend']}, {r['threads']} threads"
    lines = [f"plan {r['plan']}  backend {where}  {r['speculative']}"
             + (f" (draft {r['draft']} on {r['draft_backend']})" if r["draft"] else "") + f"  K {r['num_speculative_tokens'] or 'adaptive'}"
             + f"  repeats {r['repeats']}  ({r['machine']}, {r['date']})",
             f"{r['decode']} greedy tokens after each prompt"]
    lines += report_speculative(r["rows"], r["llama_cpp"])
    if r["llama_cpp"]:
        lines.append(f"llama.cpp: {r['llama_cpp'][0]['command']}; without speculation: llama-bench -p 0 -n "
                     f"{r['decode']} -d <prompt tokens>")
    return "\n".join(lines)


def report_streams(r: dict[str, Any]) -> str:
    from .bench_parallel import report_parallel
    where = f"{r['backend']}" + (f" ({r['device']})" if r["device"] else f", {r['threads']} threads")
    lines = [f"plan {r['plan']}  backend {where}  repeats {r['repeats']}  ({r['machine']}, {r['date']})",
             f"{r['parallel'][0]['prompt']}-token prompts, {r['parallel'][0]['decode']} tokens each; medians"]
    lines += report_parallel(r["parallel"], r["llama_cpp"]["rows"] if r["llama_cpp"] else None)
    if r["llama_cpp"]:
        lines.append(f"llama.cpp: {r['llama_cpp']['command']}")
    return "\n".join(lines)


def report(r: dict[str, Any]) -> str:
    c, mdl = r["ceilings"], r["model"]
    where = f"{r['backend']}" + (f" ({r['device']})" if r["device"] else f", {r['threads']} threads")
    lines = [f"plan {r['plan']}  backend {where}  repeats {r['repeats']}  ({r['machine']}, {r['date']})",
             f"ceilings    read {c['read_gbs']:.1f} GB/s"
             + (f" (plan weights mmapped: {c['weights_read_gbs']:.1f} GB/s)" if "weights_read_gbs" in c else "")
             + f", numpy f32 GEMM {c['gemm_gflops']:.1f} GFLOP/s"
             + (f", device copy {c['device_copy_gbps']:.1f} GB/s, empty launch {c['launch_us']:.2f} us"
                if "device_copy_gbps" in c else "")]
    for p in r["prefill"]:
        lines.append(f"prefill {p['tokens']:<5} {p['tok_s']:9.2f} tok/s   time to first token {p['ttft_ms']:.1f} ms")
    last = r["prefill"][-1]
    lines.append(f"            {r['prefill_gops']:.1f} G op/s at {last['tokens']} tokens = {r['prefill_of_gemm']:.2f} x "
                 "numpy f32 GEMM")
    d = r["decode"]
    bw_name = "device copy" if r["backend"] == "opencl" else "read bandwidth"
    lines += [f"decode      {d['empty']['tok_s']:9.2f} tok/s   {d['tokens']} tokens from an empty cache "
              f"({d['empty']['ms_per_token']:.3f} ms/token)",
              f"decode      {d['deep']['tok_s']:9.2f} tok/s   after {d['deep']['context']} tokens "
              f"({d['deep']['ms_per_token']:.3f} ms/token) x {mdl['weight_bytes_per_token'] / 1e6:.1f} MB/token = "
              f"{r['decode_weight_gbs']:.1f} GB/s = {r['decode_of_bandwidth']:.2f} of {bw_name}",
              f"peak memory {r['peak_memory_bytes'] / 2**20:9.0f} MiB (resident)"]
    lc = r.get("llama_cpp")
    if lc:
        ratio = r["llama_cpp_ratios"]
        lines += [f"llama.cpp   decode {lc['decode_tok_s']:.2f} tok/s (from an empty cache): llmrs / llama.cpp "
                  f"{ratio['decode_empty']:.2f} from empty, {ratio['decode_deep']:.2f} (ours after "
                  f"{d['deep']['context']} tokens)",
                  f"llama.cpp   prefill {lc['prefill_tokens']} {lc['prefill_tok_s']:.2f} tok/s: llmrs / llama.cpp "
                  f"{ratio['prefill']:.2f}  ({lc['command']})"]
        if "deep" in lc:
            lines.append(f"llama.cpp   decode {lc['deep']['decode_tok_s']:.2f} tok/s after {lc['deep']['depth']} "
                         f"tokens: llmrs / llama.cpp {ratio['decode_at_depth']:.2f} at the same depth  "
                         f"({lc['deep']['command']})")
    if r.get("kernels"):
        from .bench_kernels import KernelTime, format_kernels
        lines += ["", "kernels, each alone (prefill: a whole chunk from an empty cache; decode: one token after "
                  f"{d['deep']['context']}; of BW: of {bw_name}):",
                  format_kernels([KernelTime(**k) for k in r["kernels"]])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    try:
        if a.threads is not None and a.threads < 1 or a.repeats < 1 or a.decode < 1:
            raise BenchError("--threads, --repeats and --decode must be at least 1")
        if a.depth is not None and a.depth < 1:
            raise BenchError("--depth must be at least 1")
        if a.read_mib < 1 or a.gemm < 1:
            raise BenchError("--read-mib and --gemm must be at least 1")
        if a.speculative is None and any((a.draft, a.llama_lookup, a.llama_speculative, a.gguf_draft,
                                          a.num_speculative_tokens)):
            raise BenchError("--draft, --num-speculative-tokens, --llama-lookup, --llama-speculative and "
                             "--gguf-draft go with --speculative")
        if a.speculative and (a.llama_lookup or a.llama_speculative) and not (a.llama_bench and a.gguf):
            raise BenchError("--llama-lookup / --llama-speculative need --gguf and --llama-bench (llama.cpp's "
                             "speed without speculation)")
        if a.llama_speculative and not a.gguf_draft:
            raise BenchError("--llama-speculative needs --gguf-draft (the draft's GGUF)")
        if ((a.llama_bench or a.llama_batched_bench) is None) != (a.gguf is None):
            raise BenchError("--llama-bench (or --llama-batched-bench) and --gguf go together: pass both or neither")
        if a.llama_batched_bench and not a.parallel:
            raise BenchError("--llama-batched-bench goes with --parallel")
        if not a.plan.is_file():
            raise BenchError(f"plan {a.plan}: no such file")
        if a.json:
            check_output_file(a.json, "--json", [p for p in (a.plan, a.gguf, a.llama_bench) if p])
        result = bench_streams(a) if a.parallel else bench_spec(a) if a.speculative else bench(a)
    except (BenchError, PlanError, ValueError, OSError, RuntimeError) as e:
        print(f"llmrs-bench: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(report_streams(result) if a.parallel else report_spec(result) if a.speculative else report(result))
    if a.json:
        write_output(a.json, json.dumps(result, indent=1) + "\n", "--json", [a.plan])
    return 0


if __name__ == "__main__":
    sys.exit(main())
