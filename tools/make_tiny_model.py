#!/usr/bin/env python3
"""Write a random Hugging Face-format model folder (config.json, model.safetensors, tokenizer.json)
of the Llama, Qwen3 or Qwen2 family.

    python tools/make_tiny_model.py out/tiny                        # the default 'tiny' preset, a Llama
    python tools/make_tiny_model.py out/1b --preset llama-3.2-1b    # Llama-3.2-1B's exact shape
    python tools/make_tiny_model.py out/q --family qwen3            # the 'tiny' shape as a Qwen3
    python tools/make_tiny_model.py out/q3 --preset qwen3-0.6b      # Qwen3-0.6B's exact shape
    python tools/make_tiny_model.py out/m --hidden-size 192 --num-hidden-layers 3 --dtype f32
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llmrs.models.tiny import FAMILIES, PRESETS, make_model

SIZE_FLAGS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="starting shape (default tiny)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"), help="stored dtype (default bf16)")
    ap.add_argument("--family", choices=FAMILIES, help="model family (default: the preset's, else llama)")
    ap.add_argument("--seed", type=int, default=0)
    for f in SIZE_FLAGS:
        ap.add_argument("--" + f.replace("_", "-"), type=int, help=f"override {f}")
    ap.add_argument("--tied", dest="tie_word_embeddings", action="store_true", default=None)
    ap.add_argument("--untied", dest="tie_word_embeddings", action="store_false")
    args = ap.parse_args(argv)
    overrides = {f: getattr(args, f) for f in SIZE_FLAGS + ("tie_word_embeddings", "family")}
    t0 = time.perf_counter()

    def progress(name: str, i: int, n: int) -> None:
        print(f"\r[{i + 1}/{n}] {name:<50}", end="", file=sys.stderr, flush=True)

    try:
        out = make_model(args.out_dir, args.preset, args.seed, args.dtype, progress=progress, **overrides)
    except ValueError as e:
        print(f"\nmake_tiny_model: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir())
    family = args.family or PRESETS[args.preset].get("family", "llama")
    print(f"\n{out}: {family}, preset {args.preset}, {size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
