#!/bin/sh
# The committed Qwen test data (tests/data/qwen*), made from nothing but this repository, transformers
# and llama.cpp's own tools:
#   qwen3-a/ qwen3-b/ qwen2-a/     random folders (tools/make_tiny_model.py; seeds picked for greedy
#                                  steps whose top-2 margin is >= 3% of the logit range)
#   <name>.npz                     transformers' logits for them (tools/make_golden.py)
#   qwen3-b.f32.gguf qwen2-a.f32.gguf   llama.cpp's convert_hf_to_gguf.py --outtype f32 (tools/convert_gguf.py)
#   qwen3-a.q8_0.gguf qwen3-a.q4_0.gguf llama-quantize of qwen3-a's f32 GGUF (its default mix: Q4_0
#                                  keeps output.weight Q8_0, a K-quant fallback for 64-wide rows)
# Needs torch, transformers, sentencepiece and protobuf (tool only), llama.cpp's source and a built
# llama-quantize:
#   LLAMA_CPP=/work/llama/src QUANTIZE=/work/llama/build/bin/llama-quantize sh tools/make_qwen_data.sh
set -eu
LLAMA_CPP=${LLAMA_CPP:-/work/llama/src}
QUANTIZE=${QUANTIZE:-/work/llama/build/bin/llama-quantize}
PYTHON=${PYTHON:-python}
DATA=tests/data
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

for spec in qwen3-a:0 qwen3-b:5 qwen2-a:0; do
    name=${spec%%:*}
    rm -rf "$DATA/$name"
    "$PYTHON" tools/make_tiny_model.py "$DATA/$name" --preset "$name" --seed "${spec##*:}"
    "$PYTHON" tools/make_golden.py "$DATA/$name" -o "$DATA/$name.npz"
done

convert() {  # folder, output
    PYTHONPATH="$LLAMA_CPP/gguf-py" "$PYTHON" tools/convert_gguf.py "$LLAMA_CPP" "$1" --pre qwen2 -- \
        --outtype f32 --outfile "$2" > "$TMP/convert.log" 2>&1 || { cat "$TMP/convert.log"; exit 1; }
}
convert "$DATA/qwen3-b" "$DATA/qwen3-b.f32.gguf"
convert "$DATA/qwen2-a" "$DATA/qwen2-a.f32.gguf"
convert "$DATA/qwen3-a" "$TMP/qwen3-a.f32.gguf"
for t in q8_0 q4_0; do
    LD_LIBRARY_PATH="$(dirname "$QUANTIZE")" "$QUANTIZE" "$TMP/qwen3-a.f32.gguf" "$DATA/qwen3-a.$t.gguf" "$t" 1 \
        > "$TMP/quantize.log" 2>&1 || { cat "$TMP/quantize.log"; exit 1; }
done
ls -l "$DATA"/qwen*
