#!/usr/bin/env python3
"""Run llama.cpp's own convert_hf_to_gguf.py on a tiny model folder, its pre-tokenizer check answered.

The converter names a byte-level BPE's pre-tokenizer by hashing how the tokenizer splits a test
text, and knows only released models' hashes; a tiny folder's tokenizer (a few hundred merges
learned here) matches none of them. --pre gives the name a released checkpoint of the family gets
('qwen2' for Qwen2/2.5 and Qwen3, 'llama-bpe' for Llama 3); everything else (metadata, tensor
names and layout, vocabulary, chat template) is the converter's own code, run unchanged.

    PYTHONPATH=/work/llama/src/gguf-py python tools/convert_gguf.py /work/llama/src MODEL_DIR --pre qwen2 \\
        -- --outtype f32 --outfile OUT.gguf

Needs the converter's dependencies (torch, transformers, sentencepiece, protobuf); tool only.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp's source folder (holds convert_hf_to_gguf.py)")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--pre", required=True, help="tokenizer.ggml.pre to write, e.g. qwen2")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)   # after --: convert_hf_to_gguf.py's own flags
    args, converter_args = ap.parse_args(argv[:cut]), argv[cut + 1:]
    script = args.llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        print(f"convert_gguf: {script} does not exist; give llama.cpp's source folder", file=sys.stderr)
        return 2
    sys.path.insert(0, str(args.llama_cpp))
    import conversion.base  # the converter's own package, imported once: run_path below reuses it

    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: args.pre
    sys.argv = [str(script), str(args.model_dir), *converter_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
