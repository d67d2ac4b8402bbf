"""llmrs against Hugging Face `transformers` on the same GGUF file: logits of a plan compiled with
`--weights f32` (every tensor dequantized once, as transformers does when it loads a GGUF)
against `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` in float32.

    python tools/compare_hf_gguf.py MODEL.gguf --plan PLAN_F32 [--backend cpu|reference] [--json FILE]

Needs torch and transformers (tool only; the test suite never imports them):
    pip install torch==2.13.0 transformers accelerate
For each prompt, the last-position logits after prefill and after each of --steps greedy decode
steps (fed the same tokens on both sides) are compared with the suite's one error measure,
max |ours - hf| / max |hf|.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from llmrs.compiler.outputs import write_output
from llmrs.runtime.plan import Plan

PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
           "Once upon a time, in a small village by the sea,")


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / np.max(np.abs(ref)))


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--plan", type=Path, required=True, help="plan compiled from the GGUF with --weights f32")
    ap.add_argument("--backend", choices=("cpu", "reference"), default="cpu")
    ap.add_argument("--steps", type=int, default=8, help="greedy decode steps compared after each prompt")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name,
                                              torch_dtype=torch.float32).eval()
    plan = Plan.open(args.plan)
    m = plan.manifest
    tok = Tokenizer.from_str(bytes(plan.section("tokenizer.json")).decode())
    if args.backend == "cpu":
        from llmrs.runtime.backends.cpu import CpuBackend
        backend = CpuBackend(plan)
    else:
        from llmrs.runtime.backends.reference import ReferenceBackend
        backend = ReferenceBackend(plan.graphs())
    chunk = int(m["prefill_chunk"])

    rows, worst = [], 0.0
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        backend.reset()
        for s in range(0, len(ids), chunk):
            ours = backend.run("prefill", np.asarray(ids[s:s + chunk], np.int32), s, s)[-1]
        errs = []
        seq = list(ids)
        for step in range(args.steps + 1):
            ref = hf_logits(hf, seq)[-1]
            errs.append(rel_err(ours, ref))
            nxt = int(np.argmax(ref))
            if step == args.steps:
                break
            ours = backend.run("decode", np.array([nxt], np.int32), len(seq), len(seq))[-1]
            seq.append(nxt)
        worst = max(worst, max(errs))
        rows.append({"prompt": prompt, "tokens": len(ids), "max_rel_err": max(errs),
                     "continuation": tok.decode(seq[len(ids):])})
        print(f"{prompt[:40]!r:44s} {len(ids):3d} tokens  max rel err {max(errs):.2e}  -> {rows[-1]['continuation']!r}")
    print(f"worst relative error over {len(PROMPTS)} prompts x {args.steps + 1} positions: {worst:.2e}")
    if args.json:
        write_output(args.json, json.dumps({"worst": worst, "rows": rows}, indent=1), "--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
