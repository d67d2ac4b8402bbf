"""llmrs-bench --parallel N,N: many streams at once through the plan's step graph (runtime/batch.py),
beside llama.cpp's llama-batched-bench on the same weights in the same run.

For each stream count N, N requests of --prefill tokens (random ids, no shared prefix: the prefix
cache is off so every prompt is computed) each generate --decode greedy tokens, submitted at once.
Stop tokens do not end a stream (ignore_eos, as llama-batched-bench and vLLM's throughput bench run):
a stream that stopped early would leave the later steps with fewer rows than N.

  decode tok/s   aggregate: the tokens all streams generate after every stream has its first one,
                 over that time (llama-batched-bench's S_TG: N x ntg / T_TG)
  ttft           submit to a stream's first token, p50 and p95 over the N streams (prompt chunks
                 are interleaved, so later streams wait for earlier chunks)
  total tok/s    (prompt + generated tokens of all streams) / the whole run (its S)
"""
from __future__ import annotations

import json
import statistics
import subprocess
import time
from typing import Any, Callable

import numpy as np

from ..runtime.engine import Stats


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_streams(model, n: int, prompt: int, decode: int, rng: np.random.Generator) -> dict[str, float]:
    """One run of n streams: their figures (see the module docstring)."""
    vocab = model.vocab_size
    t0 = time.perf_counter()
    reqs = [model.add_request(rng.integers(0, vocab, prompt).tolist(), max_tokens=decode, ignore_eos=True)
            for _ in range(n)]
    first: float | None = None
    done_tokens_at_first = 0
    while model.step():
        if first is None and all(r.tokens or r.done for r in reqs):
            first = time.perf_counter()
            done_tokens_at_first = sum(len(r.tokens) for r in reqs)
    end = time.perf_counter()
    first = first or end
    generated = sum(len(r.tokens) for r in reqs)
    ttft = [r.ttft_s for r in reqs if r.ttft_s is not None]
    return {"decode_tok_s": (generated - done_tokens_at_first) / max(end - first, 1e-9),
            "ttft_p50_ms": _pct(ttft, 0.5) * 1e3, "ttft_p95_ms": _pct(ttft, 0.95) * 1e3,
            "total_tok_s": n * (prompt + decode) / (end - t0), "generated": generated}


def bench_parallel(model, counts: list[int], prompt: int, decode: int, repeats: int,
                   say: Callable[[str], None]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    run_streams(model, 1, min(prompt, 16), 2, rng)          # warm: page in the weights
    rows = []
    for n in counts:
        runs = []
        for r in range(repeats):
            say(f"llmrs-bench: {n} streams, repeat {r + 1}/{repeats}")
            runs.append(run_streams(model, n, prompt, decode, rng))
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        rows.append({"streams": n, "prompt": prompt, "decode": decode,
                     "decode_tok_s": round(med["decode_tok_s"], 2), "total_tok_s": round(med["total_tok_s"], 2),
                     "ttft_p50_ms": round(med["ttft_p50_ms"], 1), "ttft_p95_ms": round(med["ttft_p95_ms"], 1),
                     "samples_decode_tok_s": [round(x["decode_tok_s"], 2) for x in runs]})
    base = rows[0]["decode_tok_s"] if rows and rows[0]["streams"] == 1 else None
    for row in rows:
        row["x_one_stream"] = round(row["decode_tok_s"] / base, 2) if base else None
    return rows


def run_batched_bench(binary: str, gguf: str, threads: int, counts: list[int], prompt: int, decode: int,
                      ngl: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """llama.cpp's llama-batched-bench on the same weights: (command, its jsonl records per stream count)."""
    ctx = max(counts) * (prompt + decode) + 64
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(decode),
           "-npl", ",".join(map(str, counts)), "-t", str(threads), "--output-format", "jsonl"]
    if ngl is not None:
        cmd += ["-ngl", str(ngl)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ValueError(f"--llama-batched-bench {binary}: cannot run it ({e.strerror})") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(f"--llama-batched-bench {binary} failed on --gguf {gguf}: {last}")
    rows = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            rows.append({"streams": int(r["pl"]), "decode_tok_s": round(float(r["speed_tg"]), 2),
                         "prefill_tok_s": round(float(r["speed_pp"]), 2), "total_tok_s": round(float(r["speed"]), 2)})
    if not rows:
        raise ValueError(f"--llama-batched-bench {binary} printed no jsonl records; is it llama.cpp's llama-batched-bench?")
    return " ".join(cmd), rows


def report_parallel(rows: list[dict[str, Any]], lcpp: list[dict[str, Any]] | None) -> list[str]:
    by = {r["streams"]: r for r in lcpp or []}
    lines = ["streams  decode tok/s (x 1 stream)  total tok/s  ttft p50 / p95 ms"
             + ("   llama.cpp decode tok/s  llmrs / llama.cpp" if lcpp else "")]
    for r in rows:
        x = f" ({r['x_one_stream']:.2f}x)" if r["x_one_stream"] else ""
        line = (f"{r['streams']:>7}  {r['decode_tok_s']:12.2f}{x:<12}  {r['total_tok_s']:11.2f}  "
                f"{r['ttft_p50_ms']:8.1f} / {r['ttft_p95_ms']:.1f}")
        o = by.get(r["streams"])
        if o:
            line += f"   {o['decode_tok_s']:22.2f}  {r['decode_tok_s'] / o['decode_tok_s']:.2f}"
        lines.append(line)
    lines.append(f"peak memory {Stats.peak_rss_bytes() / 2**20:.0f} MiB (resident)")
    return lines
