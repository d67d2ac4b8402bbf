"""Plans of the committed tiny models that carry a chat template, as a GGUF or a tokenizer_config.json
would give one: the compiler here stores no template yet, so the manifest gets it at write time
(same plan format: runtime/chat.py's from_manifest reads these keys)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

from llmrs.compiler import build as compiler_build
from llmrs.compiler import cli as compiler_cli

from ..conftest import DATA

# Llama 3's chat format, whose markers are special tokens of golden-a/-b's tokenizer (ChatML's are not)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHAT_KEYS = {"chat_template": LLAMA3_TEMPLATE, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


@contextlib.contextmanager
def manifest_extras(**keys: Any) -> Iterator[None]:
    """Plans compiled in this block get `keys` in their manifest too."""
    write = compiler_build.write_graph_plan

    def write_with_keys(path, graphs, manifest=None, *args, **kwargs):
        return write(path, graphs, {**(manifest or {}), **keys}, *args, **kwargs)

    with mock.patch.object(compiler_build, "write_graph_plan", write_with_keys):
        yield


def compile_tiny(out: Path, model: str = "golden-a", max_seq_len: int = 256, prefill_chunk: int = 16,
                 target: str = "cpu", **manifest: Any) -> Path:
    """f32 weights and KV cache on the CPU target (or `target`): the CPU and the reference backend
    agree to ~1e-6."""
    with manifest_extras(**manifest):
        rc = compiler_cli.main([str(DATA / model), "-o", str(out), "--target", target, "--weights", "f32",
                                "--kv-type", "f32", "--max-seq-len", str(max_seq_len),
                                "--prefill-chunk", str(prefill_chunk), "-q"])
    assert rc == 0
    return out
