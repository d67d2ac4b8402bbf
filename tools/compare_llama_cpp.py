"""Side by side with llama.cpp on the same GGUF: greedy tokens for the same prompt ids, and where
they part, whether it was a near-tie.

    python tools/compare_llama_cpp.py MODEL.gguf --plan PLAN [--llama-dir DIR] [-n 32]
                                      [--threads N] [--raw] [--json FILE]

llama.cpp is built outside this tree from the llama-cpp-python sdist (it vendors llama.cpp):
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cmake -S llama_cpp_python-*/vendor/llama.cpp -B llama-build -DCMAKE_BUILD_TYPE=Release \\
          -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF && cmake --build llama-build -j --target llama
--llama-dir names that build folder (its CMakeCache.txt points at the source); tools/llama_greedy.c
is compiled against it once. Both engines get the same token ids (the plan's tokenizer, with the
model's chat template unless --raw), so tokenizers cannot blur the comparison. A prompt agrees
when the first N tokens are equal; where they differ, the logit gap between llama.cpp's top two
choices at that step (and ours) tells a near-tie (both engines right within rounding) from a bug.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llmrs.compiler.outputs import write_output
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.chat import from_manifest
from llmrs.runtime.engine import Engine
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

ROOT = Path(__file__).resolve().parent.parent
NEAR_TIE = 0.5  # logits: a lead smaller than this is within what Q8 activation rounding moves

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Describe a cat to someone who has never seen one.",
    "List the planets of the solar system.",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "What does a CPU do?",
    "How do I make a cup of tea?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is the largest ocean on Earth?",
    "Summarize the story of Cinderella in two sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot.",
    "How many legs does a spider have?",
)


def llama_greedy_binary(llama_dir: Path) -> Path:
    """tools/llama_greedy.c compiled against the llama.cpp build in llama_dir (once)."""
    cache = (llama_dir / "CMakeCache.txt").read_text()
    src = Path(re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", cache, re.M).group(1))
    binary = llama_dir / "llama_greedy"
    c_file = ROOT / "tools" / "llama_greedy.c"
    if binary.is_file() and binary.stat().st_mtime > c_file.stat().st_mtime:
        return binary
    libs = llama_dir / "bin"
    subprocess.run(["cc", "-O2", "-std=c11", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}",
                    str(c_file), "-o", str(binary), f"-L{libs}", "-lllama", "-lggml", "-lggml-base",
                    f"-Wl,-rpath,{libs}"], check=True)
    return binary


def run_llama_cpp(binary: Path, gguf: Path, prompts: list[list[int]], n: int, threads: int,
                  flash_attn: str = "auto") -> list[dict]:
    text = "".join(" ".join(map(str, p)) + "\n" for p in prompts)
    env = {**os.environ, "LLAMA_GREEDY_FLASH_ATTN": {"auto": "", "on": "1", "off": "0"}[flash_attn]}
    done = subprocess.run([str(binary), str(gguf), str(n), str(threads)], input=text,
                          capture_output=True, text=True, check=True, env=env)
    out = []
    for line in done.stdout.strip().splitlines():
        parts = dict(p.strip().split(":", 1) for p in line.split("|"))
        out.append({"ids": [int(x) for x in parts["ids"].split()],
                    "gaps": [float(x) for x in parts["gaps"].split()],
                    "prefill_ms": float(parts["prefill_ms"]), "decode_ms": float(parts["decode_ms"])})
    return out


def top_gap(logits: np.ndarray) -> float:
    two = np.partition(logits, -2)[-2:]
    return float(two[1] - two[0])


def run_llmrs(plan: Plan, prompts: list[list[int]], n: int, threads: int | None,
              backend: str = "cpu") -> list[dict]:
    m = plan.manifest
    if backend == "opencl":
        from llmrs.runtime.backends.opencl import OpenCLBackend
        be = OpenCLBackend(plan)
    else:
        be = CpuBackend(plan, threads=threads)
    engine = Engine(be, int(m["prefill_chunk"]), int(m["max_seq_len"]), tuple(m.get("stop_ids", ())))
    out = []
    for ids in prompts:
        engine.reset()
        t0 = time.perf_counter()
        gen = engine.generate(ids, n, Sampler(SamplerConfig()), keep_logits=True)
        out.append({"ids": gen.tokens, "gaps": [top_gap(row) for row in gen.logits],
                    "seconds": time.perf_counter() - t0})
    return out


def compare(ours: dict, theirs: dict, n: int) -> dict:
    a, b = ours["ids"][:n], theirs["ids"][:n]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))  # one stopped (end of generation) where the other went on
    row = {"agree": first is None, "diverge_at": first}
    if first is not None:
        gap_theirs = theirs["gaps"][first] if first < len(theirs["gaps"]) else None
        gap_ours = ours["gaps"][first] if first < len(ours["gaps"]) else None
        row.update(gap_llama_cpp=gap_theirs, gap_llmrs=gap_ours,
                   near_tie=min(g for g in (gap_theirs, gap_ours) if g is not None) < NEAR_TIE
                   if (gap_theirs, gap_ours) != (None, None) else False)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--plan", type=Path, required=True, help="llmrs plan compiled from the same GGUF")
    ap.add_argument("--llama-dir", type=Path, default=Path(os.environ.get("LLAMA_BUILD", "/work/ext/llama-build")))
    ap.add_argument("-n", type=int, default=32, help="tokens compared per prompt (default 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--raw", action="store_true", help="prompts as plain text, without the chat template")
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto",
                    help="llama.cpp's flash attention (default: its own auto choice)")
    ap.add_argument("--also-opencl", action="store_true",
                    help="also run the plan on OpenCL and count how often llmrs's own two back ends, "
                         "each within 3e-7 of the interpreter kernel by kernel, agree: the baseline "
                         "for what agreement with llama.cpp can be on this model")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from tokenizers import Tokenizer
    plan = Plan.open(args.plan)
    tok = Tokenizer.from_str(bytes(plan.section("tokenizer.json")).decode())
    template = None if args.raw else from_manifest(plan.manifest)
    texts = [template.render([{"role": "user", "content": p}]) if template else p for p in PROMPTS]
    prompts = [tok.encode(t).ids for t in texts]

    theirs = run_llama_cpp(llama_greedy_binary(args.llama_dir), args.gguf, prompts, args.n, args.threads,
                           args.flash_attn)
    ours = run_llmrs(plan, prompts, args.n, args.threads)
    rows = []
    for p, o, t in zip(PROMPTS, ours, theirs):
        row = {"prompt": p, **compare(o, t, args.n), "llmrs": tok.decode(o["ids"][:args.n]),
               "llama_cpp": tok.decode(t["ids"][:args.n])}
        rows.append(row)
        mark = "same" if row["agree"] else (
            f"differ at {row['diverge_at']} (llama.cpp gap {row['gap_llama_cpp']}, ours {row['gap_llmrs']}"
            f"{', near-tie' if row['near_tie'] else ''})")
        print(f"{p[:40]:40s}  {mark}")
    agree = sum(r["agree"] for r in rows)
    ties = sum(1 for r in rows if not r["agree"] and r["near_tie"])
    print(f"\n{agree} of {len(rows)} prompts agree on the first {args.n} tokens; "
          f"{ties} of the {len(rows) - agree} that differ part at a near-tie (gap < {NEAR_TIE})")
    result = {"n": args.n, "agree": agree, "near_ties": ties, "rows": rows}
    if args.also_opencl:
        other = run_llmrs(plan, prompts, args.n, args.threads, "opencl")
        same = [compare(o, c, args.n) for o, c in zip(ours, other)]
        own = sum(r["agree"] for r in same)
        print(f"llmrs CPU vs llmrs OpenCL: {own} of {len(rows)} prompts agree on the first {args.n} tokens; "
              f"first differences at {[r['diverge_at'] for r in same if not r['agree']]}")
        result["cpu_vs_opencl"] = {"agree": own, "rows": same}
    if args.json:
        write_output(args.json, json.dumps(result, indent=1), "--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
