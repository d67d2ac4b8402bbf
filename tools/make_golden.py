#!/usr/bin/env python3
"""Golden logits from Hugging Face transformers for a model folder (LlamaForCausalLM,
Qwen3ForCausalLM, Qwen2ForCausalLM: whatever AutoModelForCausalLM reads), saved as .npz.

Needs torch and transformers (tool-only; the test suite reads the .npz and never imports them):
    pip install torch==2.13.0 transformers
    python tools/make_golden.py tests/data/golden-a --prompt "Once upon a time" -o tests/data/golden-a.npz

The committed Qwen data (tests/data/qwen*) is made by tools/make_qwen_data.sh.

The file holds, in float32 on the CPU:
    prompt_tokens  i32[n]        the prompt as tokenizer.json encodes it (BOS first where it adds one)
    prefill_logits f32[n, V]     logits of every prompt position in one forward pass
    generated      i32[S+1]      greedy tokens: generated[0] from the prefill, then one per step
    decode_logits  f32[S, V]     row i: logits after feeding generated[i] with the KV cache
    transformers_version, torch_version, prompt
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--prompt", default="Once upon a time, in a small town by the sea,")
    ap.add_argument("--steps", type=int, default=8, help="greedy decode steps (default 8)")
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        sys.exit("make_golden.py needs torch and transformers: pip install torch==2.13.0 transformers")
    from tokenizers import Tokenizer

    torch.manual_seed(0)
    ids = Tokenizer.from_file(str(args.model_dir / "tokenizer.json")).encode(args.prompt).ids
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        prefill = out.logits[0].float().numpy()
        past = out.past_key_values
        generated = [int(prefill[-1].argmax())]
        steps = []
        for _ in range(args.steps):
            out = model(torch.tensor([[generated[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float().numpy()
            steps.append(logits)
            generated.append(int(logits.argmax()))
    np.savez_compressed(
        args.output, prompt_tokens=np.array(ids, np.int32), prefill_logits=prefill.astype(np.float32),
        generated=np.array(generated, np.int32), decode_logits=np.stack(steps).astype(np.float32),
        transformers_version=transformers.__version__, torch_version=torch.__version__, prompt=args.prompt)
    print(f"{args.output}: {len(ids)} prompt tokens, {args.steps} decode steps, "
          f"transformers {transformers.__version__}, greedy {generated}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
